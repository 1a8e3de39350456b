#include "client/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

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
    return Block{r.base + offset, bytes, index};
  }
  return absl::ResourceExhaustedError("no room in this region");
}

absl::StatusOr<HostArena::Block> HostArena::Allocate(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " host bytes"));
  }
  const int64_t need = Rounded(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < static_cast<int>(regions_.size()); ++i) {
    auto block = AllocateIn(i, need);
    if (block.ok()) return block;
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
  int64_t capacity = 0;
  for (const Region& r : regions_) capacity += r.bytes;
  return absl::ResourceExhaustedError(
      absl::StrCat("host memory for offloads is full: ", bytes,
                   " bytes asked, ", capacity - used_, " of ", capacity,
                   " free, none of it in one piece that large"));
}

void HostArena::Free(const Block& block) {
  if (block.data == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  Region& r = regions_[block.region];
  int64_t offset = block.data - r.base;
  int64_t length = block.bytes;
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
  return block.data != nullptr && regions_[block.region].retired;
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
