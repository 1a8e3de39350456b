#include "policies/sim/allocator_model.h"

#include <algorithm>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "policies/sim/caching_allocator_model.h"

namespace deltad::sim {

absl::StatusOr<AllocatorKind> ParseAllocatorKind(absl::string_view name) {
  if (name == "exact") return AllocatorKind::kExact;
  if (name == "best-fit") return AllocatorKind::kBestFit;
  if (name == "vm-chunks") return AllocatorKind::kVmChunks;
  if (name == "pytorch-caching") return AllocatorKind::kPyTorchCaching;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown allocator '", name,
                   "'; expected exact, best-fit, vm-chunks or "
                   "pytorch-caching"));
}

absl::string_view AllocatorKindName(AllocatorKind kind) {
  switch (kind) {
    case AllocatorKind::kExact:
      return "exact";
    case AllocatorKind::kBestFit:
      return "best-fit";
    case AllocatorKind::kVmChunks:
      return "vm-chunks";
    case AllocatorKind::kPyTorchCaching:
      return "pytorch-caching";
  }
  return "unknown";
}

namespace {

// Sizes rounded up to a granule; capacity is the only limit. Blocks smaller
// than the granule round to 512 bytes instead: they share chunks through a
// small-block pool, as real chunked allocators do.
class RoundingAllocator : public AllocatorModel {
 public:
  RoundingAllocator(int64_t capacity, int64_t granule)
      : AllocatorModel(capacity), granule_(granule) {}
  bool Allocate(int64_t id, int64_t bytes) override {
    const int64_t g =
        bytes < granule_ ? std::min<int64_t>(granule_, 512) : granule_;
    const int64_t size = (bytes + g - 1) / g * g;
    if (used_ + size > capacity_) return false;
    blocks_[id] = size;
    used_ += size;
    return true;
  }
  void Free(int64_t id) override {
    auto it = blocks_.find(id);
    if (it == blocks_.end()) return;
    used_ -= it->second;
    blocks_.erase(it);
  }
  int64_t used() const override { return used_; }
  int64_t AdjacentFree(int64_t) const override { return 0; }

 private:
  int64_t granule_;
  int64_t used_ = 0;
  absl::flat_hash_map<int64_t, int64_t> blocks_;
};

// One contiguous arena grown from its bottom: the smallest free hole that
// fits is used, else the block goes on top (taking in a free range that
// ends at the top), as dlmalloc keeps its top chunk for last. Neighbouring
// free ranges merge on free, and a free range at the top lowers it. Where
// a block lands thus never depends on the capacity, which only bounds the
// top: a run that fits once fits again under a capacity of its footprint.
// Sizes round to 512 bytes, as the PyTorch caching allocator does.
class BestFitAllocator : public AllocatorModel {
 public:
  explicit BestFitAllocator(int64_t capacity) : AllocatorModel(capacity) {}
  bool Allocate(int64_t id, int64_t bytes) override {
    const int64_t size = (bytes + 511) / 512 * 512;
    if (size == 0) {
      // An empty tensor takes no memory; a zero-sized block in the arena
      // would share its start with a free range and break the merging.
      blocks_[id] = {-1, 0};
      return true;
    }
    int64_t start;
    auto it = by_size_.lower_bound({size, 0});
    if (it != by_size_.end()) {
      const auto [range, hole] = *it;
      start = hole;
      RemoveFree(hole);
      if (range > size) AddFree(start + size, range - size);
    } else {
      // On top, from the free range that ends there if there is one.
      start = top_;
      auto last =
          by_start_.empty() ? by_start_.end() : std::prev(by_start_.end());
      if (last != by_start_.end() && last->first + last->second == top_) {
        start = last->first;
      }
      if (start + size > capacity_) return false;
      if (start != top_) RemoveFree(start);
      top_ = start + size;
    }
    blocks_[id] = {start, size};
    used_ += size;
    return true;
  }
  void Free(int64_t id) override {
    auto it = blocks_.find(id);
    if (it == blocks_.end()) return;
    int64_t start = it->second.first;
    int64_t size = it->second.second;
    used_ -= size;
    blocks_.erase(it);
    if (size == 0) return;
    // Merge with the free ranges on either side.
    auto next = by_start_.lower_bound(start);
    if (next != by_start_.end() && next->first == start + size) {
      size += next->second;
      RemoveFree(next->first);
    }
    auto prev = by_start_.lower_bound(start);
    if (prev != by_start_.begin()) {
      --prev;
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        RemoveFree(prev->first);
      }
    }
    if (start + size == top_) {
      top_ = start;
    } else {
      AddFree(start, size);
    }
  }
  int64_t used() const override { return used_; }
  int64_t footprint() const override { return top_; }
  std::vector<int64_t> BlocksToFreeForRange(
      int64_t bytes,
      absl::FunctionRef<bool(int64_t id)> movable) const override {
    const int64_t need = (bytes + 511) / 512 * 512;
    struct Block {
      int64_t start, size, id;
      bool movable;
    };
    std::vector<Block> blocks;
    for (const auto& [id, b] : blocks_) {
      if (b.second > 0) blocks.push_back({b.first, b.second, id, movable(id)});
    }
    std::sort(blocks.begin(), blocks.end(),
              [](const Block& a, const Block& b) { return a.start < b.start; });
    // Between two blocks that may not move lies a region whose every block
    // may. A cheapest window of `need` bytes in one starts at the region's
    // start or at a block's start or end: sliding it down to the nearest of
    // those adds no block to it.
    int64_t best_cost = -1;
    size_t best_first = 0;
    size_t best_last = 0;  // one past
    size_t first = 0;      // the region's first block
    int64_t region_start = 0;
    for (size_t i = 0; i <= blocks.size(); ++i) {
      const bool end = i == blocks.size() || !blocks[i].movable;
      if (!end) continue;
      const int64_t region_end =
          i == blocks.size() ? capacity_ : blocks[i].start;
      std::vector<int64_t> starts = {region_start};
      for (size_t j = first; j < i; ++j) {
        starts.push_back(blocks[j].start);
        starts.push_back(blocks[j].start + blocks[j].size);
      }
      for (int64_t a : starts) {
        if (a + need > region_end) continue;
        int64_t cost = 0;
        size_t lo = i;
        size_t hi = first;
        for (size_t j = first; j < i; ++j) {
          if (blocks[j].start < a + need &&
              blocks[j].start + blocks[j].size > a) {
            cost += blocks[j].size;
            lo = std::min(lo, j);
            hi = j + 1;
          }
        }
        if (cost > 0 && (best_cost < 0 || cost < best_cost)) {
          best_cost = cost;
          best_first = lo;
          best_last = hi;
        }
      }
      if (i < blocks.size()) {
        region_start = blocks[i].start + blocks[i].size;
        first = i + 1;
      }
    }
    std::vector<int64_t> ids;
    for (size_t j = best_first; best_cost > 0 && j < best_last; ++j) {
      ids.push_back(blocks[j].id);
    }
    return ids;
  }
  int64_t AdjacentFree(int64_t id) const override {
    auto it = blocks_.find(id);
    if (it == blocks_.end() || it->second.second == 0) return 0;
    const auto [start, size] = it->second;
    int64_t sum = 0;
    auto next = by_start_.find(start + size);
    if (next != by_start_.end()) sum += next->second;
    // The arena's untouched end is as free as a hole.
    if (start + size == top_) sum += capacity_ - top_;
    auto prev = by_start_.lower_bound(start);
    if (prev != by_start_.begin()) {
      --prev;
      if (prev->first + prev->second == start) sum += prev->second;
    }
    return sum;
  }

 private:
  void AddFree(int64_t start, int64_t size) {
    by_start_[start] = size;
    by_size_.insert({size, start});
  }
  void RemoveFree(int64_t start) {
    auto it = by_start_.find(start);
    by_size_.erase({it->second, start});
    by_start_.erase(it);
  }

  int64_t used_ = 0;
  int64_t top_ = 0;                                // end of the highest block
  std::map<int64_t, int64_t> by_start_;            // free: start -> size
  std::set<std::pair<int64_t, int64_t>> by_size_;  // free: (size, start)
  absl::flat_hash_map<int64_t, std::pair<int64_t, int64_t>> blocks_;
};

}  // namespace

std::unique_ptr<AllocatorModel> MakeAllocatorModel(AllocatorKind kind,
                                                   int64_t capacity,
                                                   int64_t chunk_bytes) {
  switch (kind) {
    case AllocatorKind::kExact:
      return std::make_unique<RoundingAllocator>(capacity, 1);
    case AllocatorKind::kBestFit:
      return std::make_unique<BestFitAllocator>(capacity);
    case AllocatorKind::kVmChunks:
      return std::make_unique<RoundingAllocator>(
          capacity, chunk_bytes > 0 ? chunk_bytes : int64_t{2} << 20);
    case AllocatorKind::kPyTorchCaching:
      return MakeCachingAllocatorModel(capacity);
  }
  return nullptr;
}

}  // namespace deltad::sim
