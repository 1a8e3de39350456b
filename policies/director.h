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

// Algorithm 3 of DELTA: how to release a chosen tensor, and (DELTA §5.5) how
// to bring an offloaded one back. Holds a reference to the cost model, which
// must outlive it. Stateless otherwise; thread compatible.
class Director {
 public:
  explicit Director(const CostModel& costs) : costs_(costs) {}

  // Offload or Evict, or FailedPrecondition saying why the tensor cannot be
  // released at all now (both pinned, or it needs host memory that the pool
  // does not have and eviction is not allowed).
  //  - evict_pinned -> Offload; offload_pinned -> Evict;
  //  - uncomputable -> Offload (recompute is impossible);
  //  - otherwise F = c_r / c_s: Evict when F <= 1, else Offload;
  //  - Offload with the host pool short of the tensor's bytes -> Evict where
  //    the flags allow it.
  // `queued` is what the caller has decided to offload but not yet
  // reported to the cost model's backlog (a planner in mid-plan).
  absl::StatusOr<ReleaseAction> Decide(const TensorTable& table, uint32_t slot,
                                       int64_t host_bytes_available,
                                       int64_t queued = 0) const;
  // Whether Decide would succeed, without computing F (for the Filter).
  bool CanRelease(const Tensor& t, int64_t host_bytes_available) const;

  // For an offloaded tensor needed again: recompute it when that is allowed
  // (not uncomputable, not evict_pinned) and cheaper than copying it back;
  // reload otherwise.
  RestoreAction ChooseRestore(const TensorTable& table, uint32_t slot) const;

  // F(t) = c_r(t) / c_s(t), DELTA eq. (4).
  double DecisionScore(const TensorTable& table, uint32_t slot,
                       int64_t queued = 0) const;

 private:
  const CostModel& costs_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_DIRECTOR_H_
