#ifndef DELTAD_POLICIES_RELEASE_PLANNER_H_
#define DELTAD_POLICIES_RELEASE_PLANNER_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

struct ReleaseOrder {
  TensorId id;
  ReleaseAction action;
  int64_t bytes;
};

// The loop of DELTA Algorithm 1 (lines 11-19): Filter picks, Director
// decides, until the bytes asked for are released. Each chosen release is
// applied to the table at once (evict -> kEvicted, offload -> kOffloading) so
// the next pick sees it; the executor later moves offloads to kOffloaded.
// Does not own its collaborators; not thread safe.
class ReleasePlanner {
 public:
  // Which tensors the caller allows as victims, checked with the Director's
  // own test (both must hold). The daemon restricts a GPU-wide release to
  // the sessions that may lose tensors; the other overloads allow all.
  using Eligible = absl::FunctionRef<bool(const Tensor&)>;

  ReleasePlanner(TensorTable& table, Filter& filter, const Director& director)
      : table_(table), filter_(filter), director_(director) {}

  // From now on, picks know how far ahead each tensor is next used (a
  // recorded iteration: Filter::SelectByNextUse); empty: they guess from
  // staleness, as DELTA does.
  void SetNextUse(std::function<int64_t(const Tensor&)> next_use) {
    next_use_ = std::move(next_use);
  }

  // Orders releasing at least `bytes` from `scope`, in the order chosen.
  // All or nothing: when the scope cannot free that much, no state changes
  // and the error says "can free at most N bytes".
  absl::StatusOr<std::vector<ReleaseOrder>> Release(
      const Scope& scope, int64_t bytes, int64_t now_ns,
      int64_t host_bytes_available);
  // The same, choosing only tensors that pass `eligible` (read at each pick,
  // so it may depend on the releases already chosen in this call).
  absl::StatusOr<std::vector<ReleaseOrder>> Release(
      const Scope& scope, int64_t bytes, int64_t now_ns,
      int64_t host_bytes_available, Eligible eligible);

  // As much of `bytes` as the scope can free (all of it when it can): for
  // a caller whose real need is whole chunks, which a part of the bytes
  // asked for may free. An error only when nothing can be released.
  absl::StatusOr<std::vector<ReleaseOrder>> ReleaseUpTo(
      const Scope& scope, int64_t bytes, int64_t now_ns,
      int64_t host_bytes_available);

  // The early start of DELTA (§4.2), for use above the high watermark:
  // offloads, in the Filter's order, up to `bytes` of the tensors the
  // Director would offload, so their copies overlap compute. Best effort:
  // returns what it could, possibly nothing. Evictions are left for when
  // memory is actually short, since an eviction frees memory at once and
  // gains nothing by going early, while it may cost a recompute.
  std::vector<ReleaseOrder> OffloadAhead(const Scope& scope, int64_t bytes,
                                         int64_t now_ns,
                                         int64_t host_bytes_available);
  // The same, offloading only tensors that pass `eligible`.
  std::vector<ReleaseOrder> OffloadAhead(const Scope& scope, int64_t bytes,
                                         int64_t now_ns,
                                         int64_t host_bytes_available,
                                         Eligible eligible);

 private:
  // Release's work; `most` is what a refused plan could have freed.
  absl::StatusOr<std::vector<ReleaseOrder>> Plan(const Scope& scope,
                                                 int64_t bytes, int64_t now_ns,
                                                 int64_t host_bytes_available,
                                                 Eligible eligible,
                                                 int64_t& most);

  // Filter::Select, or SelectByNextUse with next_use_.
  absl::StatusOr<uint32_t> Pick(const Scope& scope, int64_t now_ns,
                                Filter::Eligible eligible);

  TensorTable& table_;
  Filter& filter_;
  const Director& director_;
  std::function<int64_t(const Tensor&)> next_use_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_RELEASE_PLANNER_H_
