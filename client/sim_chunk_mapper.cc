#include "client/sim_chunk_mapper.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace deltad::client {

namespace {

int64_t PageBytes() { return static_cast<int64_t>(::sysconf(_SC_PAGESIZE)); }

// Address space only: no memory, no swap, no access.
constexpr int kReservedProt = PROT_NONE;
constexpr int kReservedFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

}  // namespace

absl::StatusOr<uintptr_t> SimChunkMapper::Reserve(int64_t bytes,
                                                  int64_t alignment) {
  const int64_t page = PageBytes();
  if (bytes <= 0 || alignment <= 0 || bytes % page != 0 ||
      alignment % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot reserve ", bytes, " bytes aligned to ", alignment,
        ": both must be positive multiples of the page size, ", page));
  }
  // Over-reserve by the alignment, then trim both ends: mmap itself only
  // aligns to pages.
  const size_t total = static_cast<size_t>(bytes + alignment);
  void* raw = ::mmap(nullptr, total, kReservedProt, kReservedFlags, -1, 0);
  if (raw == MAP_FAILED) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("reserving ", bytes, " bytes of address space"));
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t align = static_cast<uintptr_t>(alignment);
  const uintptr_t base = (start + align - 1) / align * align;
  const uintptr_t end = base + static_cast<uintptr_t>(bytes);
  if (base > start) ::munmap(raw, base - start);
  if (start + total > end)
    ::munmap(reinterpret_cast<void*>(end), start + total - end);
  reservations_[base] = bytes;
  return base;
}

void SimChunkMapper::Unreserve(uintptr_t base, int64_t bytes) {
  auto it = reservations_.find(base);
  if (it == reservations_.end() || it->second != bytes) return;
  reservations_.erase(it);
  ::munmap(reinterpret_cast<void*>(base), static_cast<size_t>(bytes));
}

absl::StatusOr<uint64_t> SimChunkMapper::Import(int fd, int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot import a chunk of ", bytes, " bytes"));
  }
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("duplicating the descriptor ", fd,
                            " of a chunk of ", bytes, " bytes"));
  }
  struct stat st;
  if (::fstat(dup, &st) != 0) {
    const int err = errno;
    ::close(dup);
    return absl::ErrnoToStatus(
        err,
        absl::StrCat("reading the size of the chunk behind descriptor ", fd));
  }
  if (st.st_size < bytes) {
    ::close(dup);
    return absl::InvalidArgumentError(
        absl::StrCat("the chunk behind descriptor ", fd, " has ",
                     static_cast<int64_t>(st.st_size), " bytes, not the ",
                     bytes, " it was sent as"));
  }
  return static_cast<uint64_t>(dup);
}

absl::Status SimChunkMapper::Map(uint64_t handle, uintptr_t at, int64_t bytes) {
  if (absl::Status inside = CheckInside(at, bytes); !inside.ok()) {
    return inside;
  }
  void* p = ::mmap(reinterpret_cast<void*>(at), static_cast<size_t>(bytes),
                   PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
  if (p == MAP_FAILED) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("mapping ", bytes, " bytes of chunk descriptor ",
                            handle, " at 0x", absl::Hex(at)));
  }
  return absl::OkStatus();
}

absl::Status SimChunkMapper::Unmap(uintptr_t at, int64_t bytes) {
  if (absl::Status inside = CheckInside(at, bytes); !inside.ok()) {
    return inside;
  }
  // Replacing the mapping, rather than munmap, keeps the range reserved
  // with no window in which another mmap could take it.
  void* p = ::mmap(reinterpret_cast<void*>(at), static_cast<size_t>(bytes),
                   kReservedProt, kReservedFlags | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("unmapping ", bytes, " bytes of a chunk at 0x",
                            absl::Hex(at)));
  }
  return absl::OkStatus();
}

void SimChunkMapper::Release(uint64_t handle) {
  ::close(static_cast<int>(handle));
}

absl::Status SimChunkMapper::CheckInside(uintptr_t at, int64_t bytes) const {
  const int64_t page = PageBytes();
  auto it = reservations_.upper_bound(at);
  if (bytes > 0 && bytes % page == 0 &&
      at % static_cast<uintptr_t>(page) == 0 && it != reservations_.begin()) {
    --it;
    const uintptr_t end = it->first + static_cast<uintptr_t>(it->second);
    if (at < end && static_cast<uintptr_t>(bytes) <= end - at) {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      bytes, " bytes at 0x", absl::Hex(at),
      " are not page-aligned pages inside a reservation of this mapper"));
}

}  // namespace deltad::client
