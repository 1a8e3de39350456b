#include "policies/director.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace deltad::policy {

absl::string_view ReleaseActionName(ReleaseAction a) {
  return a == ReleaseAction::kOffload ? "offload" : "evict";
}

absl::string_view RestoreActionName(RestoreAction a) {
  return a == RestoreAction::kReload ? "reload" : "recompute";
}

namespace {

bool CanEvict(const Tensor& t) {
  return !t.flags.evict_pinned && !t.flags.uncomputable;
}

// A copy made ahead lies in room the caller counts as free (copies give way
// to offloads), so offloading its tensor takes that room like any other
// offload: the copy spares the link, not the host.
bool CanOffload(const Tensor& t, int64_t host_bytes_available) {
  return !t.flags.offload_pinned && t.bytes <= host_bytes_available;
}

}  // namespace

bool Director::CanRelease(const Tensor& t, int64_t host_bytes_available) const {
  return CanEvict(t) || CanOffload(t, host_bytes_available);
}

double Director::DecisionScore(const TensorTable& table, uint32_t slot,
                               int64_t queued) const {
  const Tensor& t = table.AtSlot(slot);
  const double swap = std::max<double>(1.0, costs_.SwapNs(t, queued));
  return static_cast<double>(RecomputeNs(table, slot)) / swap;
}

absl::StatusOr<ReleaseAction> Director::Decide(const TensorTable& table,
                                               uint32_t slot,
                                               int64_t host_bytes_available,
                                               int64_t queued) const {
  const Tensor& t = table.AtSlot(slot);
  const bool evictable = CanEvict(t);
  const bool offloadable = CanOffload(t, host_bytes_available);
  if (!evictable && !offloadable) {
    if (t.flags.evict_pinned && t.flags.offload_pinned) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", t.id, " is pinned against both evict and offload"));
    }
    if (t.flags.offload_pinned) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", t.id, " is offload-pinned and cannot be recomputed"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", t.id, " cannot be evicted and the host pool has ",
        host_bytes_available, " bytes free, it needs ", t.bytes));
  }
  if (!offloadable) return ReleaseAction::kEvict;
  if (!evictable) return ReleaseAction::kOffload;
  if (options_.restore_may_recompute && t.flags.host_copy) {
    return ReleaseAction::kOffload;
  }
  return DecisionScore(table, slot, queued) <= 1.0 ? ReleaseAction::kEvict
                                                   : ReleaseAction::kOffload;
}

RestoreAction Director::ChooseRestore(const TensorTable& table, uint32_t slot,
                                      int64_t reload_ns) const {
  const Tensor& t = table.AtSlot(slot);
  // evict_pinned says the bytes must not be rebuilt (e.g. a recompute that
  // would not reproduce them); the host copy is the only faithful one.
  if (t.flags.uncomputable || t.flags.evict_pinned) {
    return RestoreAction::kReload;
  }
  if (reload_ns < 0) reload_ns = costs_.ReloadNs(t.gpu, t.bytes);
  return RecomputeNs(table, slot) < reload_ns ? RestoreAction::kRecompute
                                              : RestoreAction::kReload;
}

}  // namespace deltad::policy
