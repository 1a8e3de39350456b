#include "policies/sim/caching_allocator_model.h"

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace deltad::sim {
namespace {

constexpr int64_t kMinBlockSize = 512;
constexpr int64_t kSmallSize = int64_t{1} << 20;
constexpr int64_t kSmallBuffer = int64_t{2} << 20;
constexpr int64_t kLargeBuffer = int64_t{20} << 20;
constexpr int64_t kMinLargeAlloc = int64_t{10} << 20;
constexpr int64_t kRoundLarge = int64_t{2} << 20;

int64_t RoundUp(int64_t bytes, int64_t granule) {
  return (bytes + granule - 1) / granule * granule;
}

int64_t RoundSize(int64_t bytes) {
  return bytes < kMinBlockSize ? kMinBlockSize : RoundUp(bytes, kMinBlockSize);
}

int64_t SegmentSize(int64_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return RoundUp(size, kRoundLarge);
}

class CachingAllocator : public AllocatorModel {
 public:
  explicit CachingAllocator(int64_t capacity) : AllocatorModel(capacity) {}

  bool Allocate(int64_t id, int64_t bytes) override {
    const int64_t size = RoundSize(bytes);
    const bool small = size <= kSmallSize;
    std::set<Key>& pool = small ? small_ : large_;
    auto it = pool.lower_bound({size, 0});
    if (it == pool.end()) {
      const int64_t segment = SegmentSize(size);
      if (reserved_ + segment > capacity_) {
        ReleaseCachedSegments();
        if (reserved_ + segment > capacity_) return false;
      }
      const int64_t start = next_address_;
      // A gap after each segment keeps blocks of two segments from ever
      // looking adjacent.
      next_address_ += segment + kSmallBuffer;
      reserved_ += segment;
      blocks_[start] = Block{
          .segment = start, .size = segment, .free = true, .small = small};
      pool.insert({segment, start});
      it = pool.find({segment, start});
    }
    const int64_t start = it->second;
    pool.erase(it);
    Block& block = blocks_[start];
    const int64_t rest = block.size - size;
    if (small ? rest >= kMinBlockSize : rest > kSmallSize) {
      block.size = size;
      blocks_[start + size] = Block{
          .segment = block.segment, .size = rest, .free = true, .small = small};
      pool.insert({rest, start + size});
    }
    blocks_[start].free = false;
    allocated_ += blocks_[start].size;
    ids_[id] = start;
    return true;
  }

  void Free(int64_t id) override {
    auto found = ids_.find(id);
    if (found == ids_.end()) return;
    int64_t start = found->second;
    ids_.erase(found);
    auto it = blocks_.find(start);
    it->second.free = true;
    allocated_ -= it->second.size;
    std::set<Key>& pool = it->second.small ? small_ : large_;
    auto next = std::next(it);
    if (Mergeable(it, next)) {
      pool.erase({next->second.size, next->first});
      it->second.size += next->second.size;
      blocks_.erase(next);
    }
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (Mergeable(prev, it)) {
        pool.erase({prev->second.size, prev->first});
        prev->second.size += it->second.size;
        blocks_.erase(it);
        it = prev;
      }
    }
    pool.insert({it->second.size, it->first});
  }

  int64_t used() const override { return allocated_; }
  int64_t footprint() const override { return reserved_; }

  int64_t AdjacentFree(int64_t id) const override {
    auto found = ids_.find(id);
    if (found == ids_.end()) return 0;
    auto it = blocks_.find(found->second);
    int64_t sum = 0;
    auto next = std::next(it);
    if (next != blocks_.end() && next->second.segment == it->second.segment &&
        next->second.free) {
      sum += next->second.size;
    }
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.segment == it->second.segment && prev->second.free) {
        sum += prev->second.size;
      }
    }
    return sum;
  }

 private:
  struct Block {
    int64_t segment = 0;  // the start address of its segment
    int64_t size = 0;
    bool free = true;
    bool small = false;
  };
  using Key = std::pair<int64_t, int64_t>;  // (size, start)
  using Blocks = std::map<int64_t, Block>;

  // `b` follows `a` in the same segment and both are free.
  bool Mergeable(Blocks::iterator a, Blocks::iterator b) const {
    return b != blocks_.end() && a->second.free && b->second.free &&
           a->second.segment == b->second.segment;
  }

  // Segments that are one free block go back to the device.
  void ReleaseCachedSegments() {
    for (auto it = blocks_.begin(); it != blocks_.end();) {
      const Block& b = it->second;
      const bool whole = b.free && b.segment == it->first &&
                         (std::next(it) == blocks_.end() ||
                          std::next(it)->second.segment != b.segment);
      if (!whole) {
        ++it;
        continue;
      }
      (b.small ? small_ : large_).erase({b.size, it->first});
      reserved_ -= b.size;
      it = blocks_.erase(it);
    }
  }

  int64_t reserved_ = 0;   // segments
  int64_t allocated_ = 0;  // blocks in use
  int64_t next_address_ = 0;
  Blocks blocks_;  // every block by start address, free or not
  std::set<Key> small_;
  std::set<Key> large_;
  absl::flat_hash_map<int64_t, int64_t> ids_;  // id -> start
};

}  // namespace

std::unique_ptr<AllocatorModel> MakeCachingAllocatorModel(int64_t capacity) {
  return std::make_unique<CachingAllocator>(capacity);
}

}  // namespace deltad::sim
