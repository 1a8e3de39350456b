#ifndef DELTAD_POLICIES_SIM_CACHING_ALLOCATOR_MODEL_H_
#define DELTAD_POLICIES_SIM_CACHING_ALLOCATOR_MODEL_H_

#include <cstdint>
#include <memory>

#include "policies/sim/allocator_model.h"

namespace deltad::sim {

// PyTorch's CUDA caching allocator with its default settings, one stream:
// what a real training run's tensors occupy. Requests round up to 512
// bytes; those of at most 1 MiB are carved from 2 MiB segments (the small
// pool), larger ones from segments of 20 MiB (requests under 10 MiB) or of
// the request rounded up to 2 MiB (the large pool). A free block of the
// request's pool is reused best-fit and split when the rest is worth
// keeping (512 bytes in the small pool, more than 1 MiB in the large);
// freed blocks merge with free neighbours of their segment, and segments
// stay reserved. When a new segment would pass `capacity`, every wholly
// free segment is released first, as PyTorch does before it reports out of
// memory. Source: c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize,
// kSmallSize, kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge,
// round_size, get_allocation_size, should_split, release_cached_blocks).
// used() is the bytes of the blocks in use; footprint() the reserved
// segments, what the device gives up.
std::unique_ptr<AllocatorModel> MakeCachingAllocatorModel(int64_t capacity);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_CACHING_ALLOCATOR_MODEL_H_
