#ifndef DELTAD_POLICIES_SIM_ALLOCATOR_MODEL_H_
#define DELTAD_POLICIES_SIM_ALLOCATOR_MODEL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::sim {

enum class AllocatorKind {
  kExact,     // bytes as asked: no fragmentation at all
  kBestFit,   // one arena, best-fit placement: external fragmentation shows
              // (holes below the top count in its footprint)
  kVmChunks,  // fixed-size physical chunks mapped into a virtual range
              // (out-of-core paper §4): rounding, but no external
              // fragmentation
  kPyTorchCaching,  // PyTorch's CUDA caching allocator: segments, pools,
                    // splitting and its rounding (caching_allocator_model.h)
};

absl::StatusOr<AllocatorKind> ParseAllocatorKind(absl::string_view name);
absl::string_view AllocatorKindName(AllocatorKind kind);

// Device memory of a given capacity, as an allocator would hand it out.
// Blocks are named by the caller's ids. Not thread safe.
class AllocatorModel {
 public:
  virtual ~AllocatorModel() = default;
  // False when the block does not fit now (capacity or fragmentation).
  virtual bool Allocate(int64_t id, int64_t bytes) = 0;
  virtual void Free(int64_t id) = 0;
  // Device bytes in use, rounding included.
  virtual int64_t used() const = 0;
  // What the device must have for the blocks where they lie: used() plus
  // the holes a contiguous arena cannot give back. A run's peak footprint
  // is the capacity at which it fits again.
  virtual int64_t footprint() const { return used(); }
  // Free bytes adjacent to the block (MegEngine's fragmentation term);
  // 0 where the model has no addresses.
  virtual int64_t AdjacentFree(int64_t id) const = 0;
  // Fragmentation: the blocks whose release would leave one free range in
  // which a block of `bytes` fits, freeing the fewest bytes, all of them
  // blocks that `movable` accepts. Empty when there is no such range, and
  // where the model places no blocks at addresses (capacity is then its
  // only limit).
  virtual std::vector<int64_t> BlocksToFreeForRange(
      int64_t /*bytes*/,
      absl::FunctionRef<bool(int64_t id)> /*movable*/) const {
    return {};
  }
  int64_t capacity() const { return capacity_; }

 protected:
  explicit AllocatorModel(int64_t capacity) : capacity_(capacity) {}
  int64_t capacity_;
};

// chunk_bytes is used by kVmChunks only.
std::unique_ptr<AllocatorModel> MakeAllocatorModel(AllocatorKind kind,
                                                   int64_t capacity,
                                                   int64_t chunk_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_ALLOCATOR_MODEL_H_
