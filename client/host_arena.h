#ifndef DELTAD_CLIENT_HOST_ARENA_H_
#define DELTAD_CLIENT_HOST_ARENA_H_

#include <algorithm>
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
// placed first fit, in pieces where no region has one large enough (see
// Block), and coalesce when freed.
//
// Slab mappings stay valid when the daemon dies (the mapping holds the
// memory), so offloaded bytes are never lost with it. Thread safe.
class HostArena {
 public:
  // One contiguous part of a block.
  struct Piece {
    char* data = nullptr;
    int64_t bytes = 0;  // taken: the last piece's is rounded up
    int region = -1;    // internal: which region it came from
  };
  // One tensor's host memory: one piece where a region has the room in one
  // piece, else pieces from several (free room split by other blocks, or
  // a tensor larger than a slab), so that every free byte the policy is
  // told of can hold an offload.
  struct Block {
    std::vector<Piece> pieces;
    int64_t bytes = 0;  // asked for: the pieces hold these, in order
    bool empty() const { return pieces.empty(); }
  };
  // Copies one block's bytes into another of the same size.
  static void Copy(const Block& from, const Block& to);
  // Calls copy(piece_data, offset_in_block, bytes) for each piece, over
  // the block's bytes as asked.
  template <typename Copy>
  static void ForEachPiece(const Block& block, Copy copy) {
    int64_t offset = 0;
    for (const Piece& p : block.pieces) {
      const int64_t n = std::min(p.bytes, block.bytes - offset);
      if (n <= 0) break;
      copy(p.data, offset, n);
      offset += n;
    }
  }

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

  // RESOURCE_EXHAUSTED when the regions (and the heap allowance) do not
  // have `bytes` free in all, counting only pieces of at least
  // kMinPieceBytes (or what is left to place, if less): tiny pieces would
  // cost a copy each. Without `grow`, only in regions already there (no new
  // heap region, whatever the allowance).
  absl::StatusOr<Block> Allocate(int64_t bytes, bool grow = true);
  static constexpr int64_t kMinPieceBytes = int64_t{64} << 10;
  void Free(const Block& block);

  int64_t capacity_bytes() const;
  int64_t used_bytes() const;
  // What new blocks can still take: the free bytes of regions that are not
  // retired, and the heap allowance not yet used (in pieces; those under
  // kMinPieceBytes hold only small blocks).
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
  absl::StatusOr<Block> AllocateLocked(int64_t need,
                                       bool grow);  // `need` rounded
  absl::StatusOr<Block> AllocateIn(int index, int64_t bytes);
  // Block's pieces from the free ranges of all regions, largest first;
  // nothing taken when they do not add up to `bytes`.
  absl::StatusOr<Block> Gather(int64_t bytes);
  void FreePiece(const Piece& piece);
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
