#ifndef DELTAD_CLIENT_HOST_ARENA_H_
#define DELTAD_CLIENT_HOST_ARENA_H_

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"

namespace deltad::client {

// Host memory for offloaded tensors: the slabs the daemon granted (memfd
// descriptors, mapped here) and, when the daemon is out of reach, a heap
// allowance so that the in-process policy can still offload. Blocks are
// placed first fit and coalesce when freed.
//
// Slab mappings stay valid when the daemon dies (the mapping holds the
// memory), so offloaded bytes are never lost with it. Thread safe.
class HostArena {
 public:
  struct Block {
    char* data = nullptr;
    int64_t bytes = 0;
    int region = -1;  // internal: which region it came from
  };

  HostArena() = default;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  ~HostArena();  // unmaps the slabs, frees the heap regions

  // Called for every region once it is mapped (`pin`) and before it is
  // unmapped or freed (`unpin`), so that the device can page-lock it once
  // (cudaHostRegister) rather than per copy. A failed pin leaves the region
  // in use, unpinned: copies from it are slower, not wrong. Set before the
  // first region comes; the callees must outlive the arena.
  struct Pinner {
    std::function<absl::Status(void*, int64_t)> pin;
    std::function<void(void*)> unpin;
  };
  void SetPinner(Pinner pinner);

  // Maps a slab the daemon sent for session `owner` and takes ownership of
  // `fd` (closed here once mapped). INTERNAL when mmap fails.
  absl::Status AddSlab(int fd, int64_t bytes, uint64_t owner);
  // The session `owner` is about to be closed while this process lives:
  // the daemon then wipes its slabs. Its regions take no new blocks from
  // now on; IsRetired says which blocks must be moved out first, and
  // UnmapRetired drops the regions once they are empty.
  void Retire(uint64_t owner);
  bool IsRetired(const Block& block) const;
  void UnmapRetired();
  // Allows up to `bytes` of heap regions (in 64 MiB pieces) beside the
  // slabs; used while the daemon is out of reach.
  void SetHeapAllowance(int64_t bytes);

  // RESOURCE_EXHAUSTED when no region has `bytes` free in one piece.
  absl::StatusOr<Block> Allocate(int64_t bytes);
  void Free(const Block& block);

  int64_t capacity_bytes() const;
  int64_t used_bytes() const;
  // What new blocks can still take: the free bytes of regions that are not
  // retired, and the heap allowance not yet used (not necessarily in one
  // piece).
  int64_t available_bytes() const;

 private:
  struct Region {
    char* base = nullptr;
    int64_t bytes = 0;
    bool mapped = false;   // a slab (munmap) or heap (free)
    bool retired = false;  // takes no new blocks
    bool pinned = false;   // Pinner::pin succeeded
    uint64_t owner = 0;    // the session whose slab it is
    int64_t used = 0;
    std::map<int64_t, int64_t> free;  // offset -> length, coalesced
  };
  absl::StatusOr<Block> AllocateIn(int index, int64_t bytes);
  void Pin(Region& r);
  void Unpin(Region& r);

  mutable std::mutex mu_;
  Pinner pinner_;
  std::vector<Region> regions_;
  int64_t heap_allowance_ = 0;
  int64_t heap_bytes_ = 0;
  int64_t used_ = 0;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_HOST_ARENA_H_
