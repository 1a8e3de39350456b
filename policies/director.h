#ifndef DELTAD_POLICIES_DIRECTOR_H_
#define DELTAD_POLICIES_DIRECTOR_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/cost_model.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

enum class ReleaseAction { kOffload, kEvict };
enum class RestoreAction { kReload, kRecompute };

absl::string_view ReleaseActionName(ReleaseAction a);
absl::string_view RestoreActionName(RestoreAction a);

struct DirectorOptions {
  // Whoever restores an offloaded tensor may rebuild it instead of copying
  // it back (ChooseRestore decides at its next use). Then a tensor whose
  // bytes are on the host already (TensorFlags::host_copy) is offloaded
  // rather than evicted whatever F says: both free its memory at once, and
  // at its next use it is back already (a prefetch) or costs the cheaper
  // of a reload and the rebuild that evicting it would have cost. The
  // daemon's clients reload every offloaded tensor, so it keeps F there.
  bool restore_may_recompute = false;
};

// Algorithm 3 of DELTA: how to release a chosen tensor, and (DELTA §5.5) how
// to bring an offloaded one back. Holds a reference to the cost model, which
// must outlive it. Stateless otherwise; thread compatible.
class Director {
 public:
  explicit Director(const CostModel& costs, DirectorOptions options = {})
      : costs_(costs), options_(options) {}

  // Offload or Evict, or FailedPrecondition saying why the tensor cannot be
  // released at all now (both pinned, or it needs host memory that the pool
  // does not have and eviction is not allowed).
  //  - evict_pinned -> Offload; offload_pinned -> Evict;
  //  - uncomputable -> Offload (recompute is impossible);
  //  - otherwise F = c_r / c_s: Evict when F <= 1, else Offload;
  //  - Offload with the host pool short of the tensor's bytes -> Evict where
  //    the flags allow it;
  //  - with DirectorOptions::restore_may_recompute, Offload where the bytes
  //    are on the host already.
  // `queued` is what the caller has decided to offload but not yet
  // reported to the cost model's backlog (a planner in mid-plan).
  absl::StatusOr<ReleaseAction> Decide(const TensorTable& table, uint32_t slot,
                                       int64_t host_bytes_available,
                                       int64_t queued = 0) const;
  // Whether Decide would succeed, without computing F (for the Filter).
  bool CanRelease(const Tensor& t, int64_t host_bytes_available) const;

  // For an offloaded tensor needed again: recompute it when that is allowed
  // (not uncomputable, not evict_pinned) and cheaper than copying it back
  // (`reload_ns` from now where a copy is on its way already; -1: a copy
  // of its bytes at the link's bandwidth); reload otherwise.
  RestoreAction ChooseRestore(const TensorTable& table, uint32_t slot,
                              int64_t reload_ns = -1) const;

  // F(t) = c_r(t) / c_s(t), DELTA eq. (4).
  double DecisionScore(const TensorTable& table, uint32_t slot,
                       int64_t queued = 0) const;

 private:
  const CostModel& costs_;
  DirectorOptions options_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_DIRECTOR_H_
