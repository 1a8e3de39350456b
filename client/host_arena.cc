#include "client/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace deltad::client {

namespace {
constexpr int64_t kHeapRegionBytes = int64_t{64} << 20;
// Blocks start on cache-line multiples, as copy engines prefer.
constexpr int64_t kAlign = 256;
int64_t Rounded(int64_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

void HostArena::SetPinner(Pinner pinner) {
  std::lock_guard<std::mutex> lock(mu_);
  pinner_ = std::move(pinner);
}

void HostArena::Pin(Region& r) {
  r.pinned = pinner_.pin && pinner_.pin(r.base, r.bytes).ok();
}

void HostArena::Unpin(Region& r) {
  if (r.pinned && pinner_.unpin) pinner_.unpin(r.base);
  r.pinned = false;
}

HostArena::~HostArena() {
  for (Region& r : regions_) {
    if (r.base == nullptr) continue;
    Unpin(r);
    if (r.mapped) {
      ::munmap(r.base, static_cast<size_t>(r.bytes));
    } else {
      std::free(r.base);
    }
  }
}

absl::Status HostArena::AddSlab(int fd, int64_t bytes, uint64_t owner) {
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                   MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::ErrnoToStatus(
        err, absl::StrCat("mapping a host slab of ", bytes, " bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Region r;
  r.base = static_cast<char*>(p);
  r.bytes = bytes;
  r.mapped = true;
  r.owner = owner;
  r.free[0] = bytes;
  Pin(r);
  regions_.push_back(std::move(r));
  return absl::OkStatus();
}

void HostArena::SetHeapAllowance(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  heap_allowance_ = std::max<int64_t>(0, bytes);
}

absl::StatusOr<HostArena::Block> HostArena::AllocateIn(int index,
                                                       int64_t bytes) {
  Region& r = regions_[index];
  if (r.retired) return absl::ResourceExhaustedError("retired region");
  for (auto it = r.free.begin(); it != r.free.end(); ++it) {
    if (it->second < bytes) continue;
    const int64_t offset = it->first;
    const int64_t left = it->second - bytes;
    r.free.erase(it);
    if (left > 0) r.free[offset + bytes] = left;
    used_ += bytes;
    r.used += bytes;
    Block block;
    block.pieces.push_back({r.base + offset, bytes, index});
    block.bytes = bytes;
    return block;
  }
  return absl::ResourceExhaustedError("no room in this region");
}

absl::StatusOr<HostArena::Block> HostArena::Allocate(int64_t bytes, bool grow) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " host bytes"));
  }
  const int64_t need = Rounded(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<Block> block = AllocateLocked(need, grow);
  if (block.ok()) block->bytes = bytes;
  return block;
}

absl::StatusOr<HostArena::Block> HostArena::AllocateLocked(int64_t need,
                                                           bool grow) {
  for (int i = 0; i < static_cast<int>(regions_.size()); ++i) {
    auto block = AllocateIn(i, need);
    if (block.ok()) return block;
  }
  if (!grow) {
    auto gathered = Gather(need);
    if (gathered.ok()) return gathered;
    return absl::ResourceExhaustedError(absl::StrCat(
        "no room for ", need, " host bytes in the regions mapped"));
  }
  // 64 MiB pieces, or what is left of a smaller allowance: an allowance
  // below one piece still holds offloads.
  // Whole units of kAlign: aligned_alloc takes no other size (glibc
  // forgives it, AddressSanitizer does not).
  const int64_t region_bytes = std::max(
      need, std::min(kHeapRegionBytes,
                     (heap_allowance_ - heap_bytes_) / kAlign * kAlign));
  if (heap_bytes_ + region_bytes <= heap_allowance_) {
    void* p = std::aligned_alloc(kAlign, static_cast<size_t>(region_bytes));
    if (p != nullptr) {
      Region r;
      r.base = static_cast<char*>(p);
      r.bytes = region_bytes;
      r.free[0] = region_bytes;
      Pin(r);
      regions_.push_back(std::move(r));
      heap_bytes_ += region_bytes;
      return AllocateIn(static_cast<int>(regions_.size()) - 1, need);
    }
  }
  auto gathered = Gather(need);
  if (gathered.ok()) return gathered;
  int64_t capacity = 0;
  for (const Region& r : regions_) capacity += r.bytes;
  return absl::ResourceExhaustedError(
      absl::StrCat("host memory for offloads is full: ", need, " bytes asked, ",
                   capacity - used_, " of ", capacity, " free, ",
                   gathered.status().message()));
}

absl::StatusOr<HostArena::Block> HostArena::Gather(int64_t bytes) {
  struct Range {
    int region;
    int64_t offset, length;
  };
  std::vector<Range> ranges;
  for (int i = 0; i < static_cast<int>(regions_.size()); ++i) {
    const Region& r = regions_[i];
    if (r.retired) continue;
    for (const auto& [offset, length] : r.free) {
      ranges.push_back({i, offset, length});
    }
  }
  // Largest first: the fewest pieces, so the fewest copies.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.length > b.length; });
  std::vector<Range> taken;
  int64_t left = bytes;
  for (const Range& range : ranges) {
    if (left == 0 || range.length < std::min(kMinPieceBytes, left)) break;
    const int64_t part = std::min(range.length, left);
    taken.push_back({range.region, range.offset, part});
    left -= part;
  }
  if (left > 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("not even in pieces of ", kMinPieceBytes, " bytes"));
  }
  Block block;
  block.bytes = bytes;
  for (const Range& t : taken) {
    Region& r = regions_[t.region];
    auto it = r.free.find(t.offset);
    const int64_t rest = it->second - t.length;
    r.free.erase(it);
    if (rest > 0) r.free[t.offset + t.length] = rest;
    used_ += t.length;
    r.used += t.length;
    block.pieces.push_back({r.base + t.offset, t.length, t.region});
  }
  return block;
}

void HostArena::Copy(const Block& from, const Block& to) {
  // The two blocks' pieces need not line up: each copy runs to the nearer
  // piece end of the two.
  size_t i = 0, j = 0;
  int64_t in_i = 0, in_j = 0;  // bytes done within pieces i and j
  int64_t left = std::min(from.bytes, to.bytes);
  while (left > 0 && i < from.pieces.size() && j < to.pieces.size()) {
    const Piece& a = from.pieces[i];
    const Piece& b = to.pieces[j];
    const int64_t n = std::min({a.bytes - in_i, b.bytes - in_j, left});
    std::memcpy(b.data + in_j, a.data + in_i, static_cast<size_t>(n));
    left -= n;
    in_i += n;
    in_j += n;
    if (in_i == a.bytes) ++i, in_i = 0;
    if (in_j == b.bytes) ++j, in_j = 0;
  }
}

void HostArena::Free(const Block& block) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Piece& piece : block.pieces) FreePiece(piece);
}

void HostArena::FreePiece(const Piece& piece) {
  Region& r = regions_[piece.region];
  int64_t offset = piece.data - r.base;
  int64_t length = piece.bytes;
  used_ -= length;
  r.used -= length;
  auto next = r.free.lower_bound(offset);
  if (next != r.free.end() && next->first == offset + length) {
    length += next->second;
    next = r.free.erase(next);
  }
  if (next != r.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      r.free.erase(prev);
    }
  }
  r.free[offset] = length;
}

void HostArena::Retire(uint64_t owner) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Region& r : regions_) {
    if (r.mapped && r.owner == owner) r.retired = true;
  }
}

bool HostArena::IsRetired(const Block& block) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Piece& piece : block.pieces) {
    if (regions_[piece.region].retired) return true;
  }
  return false;
}

void HostArena::UnmapRetired() {
  std::lock_guard<std::mutex> lock(mu_);
  // Regions keep their index (blocks name it), so an unmapped one stays as
  // an empty, retired entry.
  for (Region& r : regions_) {
    if (!r.retired || !r.mapped || r.used != 0 || r.base == nullptr) continue;
    Unpin(r);
    ::munmap(r.base, static_cast<size_t>(r.bytes));
    r.base = nullptr;
    r.bytes = 0;
    r.free.clear();
  }
}

int64_t HostArena::capacity_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t capacity = 0;
  for (const Region& r : regions_) capacity += r.bytes;
  return capacity;
}

int64_t HostArena::available_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  // An allowance lowered below the heap already taken (a daemon session
  // began) offers no more heap, but the room left in the taken heap stays.
  int64_t available = std::max<int64_t>(0, heap_allowance_ - heap_bytes_);
  for (const Region& r : regions_) {
    if (!r.retired) available += r.bytes - r.used;
  }
  return std::max<int64_t>(0, available);
}

int64_t HostArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

}  // namespace deltad::client
