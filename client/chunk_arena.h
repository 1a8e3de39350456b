#ifndef DELTAD_CLIENT_CHUNK_ARENA_H_
#define DELTAD_CLIENT_CHUNK_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/chunk_mapper.h"

namespace deltad::client {

// Device memory for the framework, carved from the physical chunks the
// daemon granted, with no external fragmentation (the virtual-addressing
// allocator of the out-of-core paper, §4): an allocation of at least half a
// chunk gets ceil(bytes / chunk) whole chunks, any free ones in any order,
// mapped side by side at a free run of the reserved address range; freeing
// it unmaps them and returns them to the free list. Physical memory is
// therefore never split into pieces too small to use: any free chunk serves
// any request, and the waste per allocation is under one chunk (internal
// fragmentation only).
//
// A freed large allocation keeps its chunks mapped where they are: the next
// allocation of as many chunks takes them as they lie, with no mapping at
// all. Mapping and unmapping cost tens of microseconds per chunk on a GPU
// (docs/BENCHMARKS.md, gpu_bench), once per saved tensor, and training
// allocates the same sizes every iteration. Kept chunks count as free: an
// allocation of another size, or ShrinkTo, unmaps them first (the largest
// kept run first).
//
// Smaller allocations share chunks: a chunk mapped for one size class
// (multiples of 256 bytes, four classes per power of two from 1 KiB, so
// the waste is under 256 bytes or 25%) is cut into equal blocks; when its
// last block is freed it goes back to the free list, but for one empty
// page per class, which stays mapped as it is: an allocator that takes and
// gives back one block at a time (PyTorch's, without its cache) would
// otherwise map and unmap a chunk for every pair. Like kept runs, empty
// pages count as free and are unmapped first when chunks are needed. All
// addresses are 256-byte aligned, as cudaMalloc's are.
//
// The address range is reserved once, twice the chunks the arena may hold,
// so that runs of whole chunks find room however the mapped slots lie in
// all but contrived patterns (pages of small blocks are placed from the
// top of the range, runs from the bottom); if it is ever too scattered,
// Allocate returns RESOURCE_EXHAUSTED and says why.
//
// Thread safe: one mutex guards the state and every call to the mapper.
// Owns the chunks it took (the mapper's handles, released at the latest by
// the destructor) and the reservation; does not own the mapper, which must
// outlive it.
class ChunkArena {
 public:
  // chunk_bytes: the size of every chunk (the daemon's chunk size, a
  // multiple of the mapping granularity). max_bytes: the most chunk bytes
  // the arena will ever hold at once (the GPU's memory); address space of
  // twice that is reserved, so that runs of whole chunks find room.
  // INVALID_ARGUMENT for sizes <= 0, max_bytes < chunk_bytes or a chunk
  // size that is not a multiple of 256 (the address alignment); the
  // mapper's error when it cannot reserve the range.
  static absl::StatusOr<std::unique_ptr<ChunkArena>> Create(ChunkMapper& mapper,
                                                            int64_t chunk_bytes,
                                                            int64_t max_bytes);

  ChunkArena(const ChunkArena&) = delete;
  ChunkArena& operator=(const ChunkArena&) = delete;
  // Unmaps and releases every chunk and frees the reservation. Memory still
  // allocated is gone with it.
  ~ChunkArena();

  // Takes the chunk behind `fd` (which stays the caller's; close it after)
  // into the free list. INVALID_ARGUMENT for a size other than
  // chunk_bytes or an id already held; RESOURCE_EXHAUSTED past max_bytes.
  absl::Status AddChunk(uint64_t chunk_id, int fd, int64_t bytes);

  // RESOURCE_EXHAUSTED when the free chunks cannot hold `bytes` (or, for
  // a large allocation, no run of free addresses is long enough);
  // INVALID_ARGUMENT for bytes <= 0; the mapper's error when mapping fails,
  // with every chunk back on the free list.
  absl::StatusOr<void*> Allocate(int64_t bytes);
  // `bytes` as given to Allocate. A pointer the arena did not hand out, one
  // already freed, or a small block freed with a size of another class is
  // ignored.
  void Free(void* p, int64_t bytes);

  // Releases free chunks (unmapped, dropped from the mapper) until at most
  // `bytes` of chunks are held or none is free; returns their ids.
  std::vector<uint64_t> ShrinkTo(int64_t bytes);

  int64_t chunk_bytes() const { return chunk_bytes_; }
  // Chunks held, free or not, in bytes.
  int64_t held_bytes() const;
  // Chunks on the free list, in bytes: what Allocate can still map.
  int64_t free_bytes() const;
  // Sum of the sizes asked of Allocate for the live allocations.
  int64_t allocated_bytes() const;
  // Where the reservation starts and how long it is; every address handed
  // out lies inside it.
  uintptr_t base() const { return base_; }
  int64_t reserved_bytes() const { return reserved_bytes_; }

 private:
  // A run of slots holding one large allocation, its chunks in slot order.
  struct Run {
    int64_t first_slot = 0;
    int64_t requested = 0;
    std::vector<uint64_t> chunks;
  };
  // A chunk cut into equal blocks of one size class. Blocks never handed
  // out yet lie at and past `unused`; freed ones are on `free_blocks`, so a
  // new page needs no list of all its blocks.
  struct Page {
    uint64_t chunk = 0;
    int64_t block_bytes = 0;
    int64_t blocks = 0;
    int64_t unused = 0;
    int64_t live = 0;
    std::vector<int64_t> free_blocks;
    std::vector<bool> allocated;  // catches a double or stray Free
  };

  ChunkArena(ChunkMapper& mapper, int64_t chunk_bytes, int64_t max_bytes,
             uintptr_t base, int64_t reserved_bytes);

  uintptr_t SlotAddress(int64_t slot) const {
    return base_ + static_cast<uintptr_t>(slot * chunk_bytes_);
  }
  absl::StatusOr<void*> AllocateRun(int64_t bytes);
  absl::StatusOr<void*> AllocateBlock(int64_t bytes);
  // Takes `count` slots off the free runs: the lowest run that fits for
  // large allocations, the highest slot for pages, so that pages gather at
  // the top of the range and leave long runs below. -1 when none fits.
  int64_t TakeSlots(int64_t count);
  int64_t TakeTopSlot();
  void ReturnSlots(int64_t first, int64_t count);
  // Unmaps the chunk at `slot` and puts it and the slot back on the free
  // lists; when the mapper cannot unmap, both stay out of use until the
  // destructor (a chunk still mapped must not be mapped elsewhere).
  void UnmapToFree(int64_t slot, uint64_t chunk);
  // Takes a kept run (named by its kept_by_count_ entry) off the kept
  // lists: its first slot and the run, still mapped.
  std::pair<int64_t, Run> TakeKept(
      std::multimap<int64_t, int64_t>::iterator by_count);
  // Unmaps empty pages, then kept runs, the largest first, until `chunks`
  // chunks are on the free list or none is kept.
  void UnkeepUntil(int64_t chunks);
  std::string Describe() const;  // sizes for error messages

  ChunkMapper& mapper_;  // not owned; every call to it is made under mu_
  const int64_t chunk_bytes_;
  const int64_t max_bytes_;
  const uintptr_t base_;
  const int64_t reserved_bytes_;

  mutable std::mutex mu_;
  // Every chunk held: id -> the mapper's handle.
  std::unordered_map<uint64_t, uint64_t> handles_;
  // Held chunks mapped nowhere; any of them serves any request.
  std::vector<uint64_t> free_chunks_;
  // Free slots of the reservation: first slot -> run length, coalesced.
  std::map<int64_t, int64_t> free_slots_;
  // Large allocations by first slot, pages by slot.
  std::unordered_map<int64_t, Run> runs_;
  std::unordered_map<int64_t, Page> pages_;
  // Per block size, the slots of its pages that have a free block; the
  // lowest is used first, so that the others can empty out and go back.
  std::map<int64_t, std::set<int64_t>> partial_;
  // Freed large allocations still mapped, by first slot, and their first
  // slots by chunk count; kept_chunks_ counts their chunks.
  std::unordered_map<int64_t, Run> kept_;
  std::multimap<int64_t, int64_t> kept_by_count_;
  int64_t kept_chunks_ = 0;
  // Pages with no live block, still mapped and among partial_: block size
  // -> slot, one per size class.
  std::map<int64_t, int64_t> empty_pages_;
  // Slot -> chunk for mappings the mapper failed to undo.
  std::unordered_map<int64_t, uint64_t> stuck_;
  int64_t allocated_ = 0;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_CHUNK_ARENA_H_
