#ifndef DELTAD_POLICIES_TENSOR_H_
#define DELTAD_POLICIES_TENSOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/string_view.h"

namespace deltad::policy {

using TensorId = uint64_t;
using SessionId = uint64_t;
using GpuId = int32_t;

// Where a tensor's bytes are. Transitions are checked by TensorTable.
enum class TensorState : uint8_t {
  kResident,    // on the GPU
  kOffloading,  // on the GPU, copy to host in flight; bytes freed when it ends
  kOffloaded,   // on the host only
  kReloading,   // copy back to the GPU in flight; occupies GPU memory already
  kEvicted,     // nowhere; rebuilt by recompute from its parents
  kFreed,       // released by the framework; kept only while a live child may
                // need it to be recomputed (DTR's "banishing" comes later)
};

absl::string_view TensorStateName(TensorState state);

// Whether the tensor's bytes occupy GPU memory in this state.
constexpr bool OccupiesDevice(TensorState s) {
  return s == TensorState::kResident || s == TensorState::kOffloading ||
         s == TensorState::kReloading;
}

struct TensorFlags {
  bool evict_pinned = false;    // may not be evicted (offload is allowed)
  bool offload_pinned = false;  // may not be offloaded (evict is allowed)
  bool uncomputable = false;    // no recompute path: inputs, parameters
  // Its bytes are on the host already, copied ahead while it stayed on the
  // device: an offload costs no copy. Its room there counts as free (copies
  // give way to offloads), so the offload takes that room as any other.
  // Only a resident tensor has it; leaving the device clears it.
  bool host_copy = false;
};

// What a client reports when a tensor is created.
struct TensorSpec {
  TensorId id = 0;  // 0 is reserved (it marks a free slot in the table)
  SessionId session = 0;
  GpuId gpu = 0;
  int64_t bytes = 0;
  TensorFlags flags;
  int64_t compute_cost_ns = 0;  // measured time of the op that produced it
  std::vector<TensorId> parents;
  // Identifies "the same tensor" across training iterations (e.g. producer op
  // index and output number); 0 when unknown. Used by the replay prefetch plan.
  uint64_t stable_key = 0;
};

// A tensor as the policy sees it. Owned by TensorTable; read it through the
// table, never keep a reference across a call that adds tensors.
struct alignas(64) Tensor {
  // The fields every Filter score and the daemon's eligibility read come
  // first, in one cache line (the alignment keeps them in one): a sampled
  // decision touches sqrt(N) random tensors and is bound by misses.
  int64_t bytes = 0;
  int64_t last_access_ns = 0;  // wall (or simulated) time
  int64_t compute_cost_ns = 0;
  TensorId id = 0;
  uint32_t lock_count = 0;  // > 0 while an op uses it: not releasable
  TensorFlags flags;
  TensorState state = TensorState::kResident;
  // Evicted straight from the device (a cancellable release), rather than by
  // dropping the host copy of an offloaded tensor.
  bool evicted_from_device = false;
  GpuId gpu = 0;
  SessionId session = 0;  // whose: the daemon's release checks it

  // MegEngine's terms (not the default heuristic) in the next line.
  uint32_t recompute_count = 0;
  // Free bytes next to this tensor in the allocator, when an allocator model
  // reports them (MegEngine's fragmentation term); 0 otherwise.
  int64_t adjacent_free_bytes = 0;

  uint64_t stable_key = 0;
  uint64_t last_access_tick = 0;  // the session's logical clock
  // Slots in the table. Most tensors have a few of each: held inline, so
  // adding and retiring one allocates nothing (malloc and free were a
  // seventh of a replay in the simulator), in the 24 bytes a vector takes.
  absl::InlinedVector<uint32_t, 4> parents;
  absl::InlinedVector<uint32_t, 4> children;
  uint32_t live_children = 0;  // children not yet retired
  // Positions in the table's candidate lists (kResident only); internal.
  uint32_t gpu_pos = UINT32_MAX;
  uint32_t session_pos = UINT32_MAX;

  // Back to a default tensor, in place: GCC 12 takes assigning a Tensor{}
  // for a read of the temporary's uninitialised inline storage.
  void Reset() {
    std::destroy_at(this);
    std::construct_at(this);
  }
};

// What every Filter score but MegEngine's reads of a tensor to bound it
// (and, for delta, lru and greedy, to score it), copied beside the slot in
// the candidate lists: a sampled decision at a million tensors then costs
// one cache miss a sample (the entry) instead of two (the entry, then the
// tensor), and loads the tensor only for the few samples that can win.
// The table keeps the copies equal to the tensor's fields.
struct CandidateEntry {
  int64_t bytes = 0;
  int64_t last_access_ns = 0;
  int64_t compute_cost_ns = 0;
  uint32_t slot = 0;
  TensorFlags flags;

  static CandidateEntry Of(const Tensor& t, uint32_t slot) {
    return {t.bytes, t.last_access_ns, t.compute_cost_ns, slot, t.flags};
  }
};
// Two to a cache line: an entry never straddles two.
static_assert(sizeof(CandidateEntry) == 32);

// The set of tensors a decision looks at: one GPU, or one session on it.
struct Scope {
  GpuId gpu = 0;
  std::optional<SessionId> session;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_TENSOR_H_
