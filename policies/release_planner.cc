#include "policies/release_planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "policies/status_macros.h"

namespace deltad::policy {

namespace {

bool AnyTensor(const Tensor& /*t*/) { return true; }

}  // namespace

absl::StatusOr<uint32_t> ReleasePlanner::Pick(const Scope& scope,
                                              int64_t now_ns,
                                              Filter::Eligible eligible) {
  if (!next_use_) return filter_.Select(table_, scope, now_ns, eligible);
  return filter_.SelectByNextUse(table_, scope, now_ns, eligible, next_use_);
}

absl::StatusOr<std::vector<ReleaseOrder>> ReleasePlanner::Release(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available) {
  return Release(scope, bytes, now_ns, host_bytes_available, AnyTensor);
}

absl::StatusOr<std::vector<ReleaseOrder>> ReleasePlanner::Release(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available, Eligible eligible) {
  int64_t most = 0;
  return Plan(scope, bytes, now_ns, host_bytes_available, eligible, most);
}

absl::StatusOr<std::vector<ReleaseOrder>> ReleasePlanner::ReleaseUpTo(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available) {
  // No more than is resident, so that the planner scans and says how much
  // it can free (its quick refusal does not).
  const int64_t resident = table_.CandidateBytes(scope);
  if (bytes > 0 && resident == 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "asked to release up to ", bytes, " bytes; none is resident"));
  }
  bytes = std::min(bytes, resident);
  // Both plans score one sample (see Filter::Batch).
  Filter::Batch batch(filter_);
  int64_t most = 0;
  auto all = Plan(scope, bytes, now_ns, host_bytes_available, AnyTensor, most);
  if (all.ok() || !absl::IsResourceExhausted(all.status()) || most <= 0 ||
      most >= bytes) {
    return all;
  }
  // The same picks again, asked for no more than they free: the table is
  // as it was, so the plan that found `most` finds it again.
  return Plan(scope, most, now_ns, host_bytes_available, AnyTensor, most);
}

absl::StatusOr<std::vector<ReleaseOrder>> ReleasePlanner::Plan(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available, Eligible eligible, int64_t& most) {
  most = 0;
  // One release, one sample: its misses are most of a pick's time.
  Filter::Batch batch(filter_);
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes to release must be positive, got ", bytes));
  }
  if (host_bytes_available < 0) host_bytes_available = 0;
  // Quick refusal without a scan: nothing beyond the resident bytes exists.
  const int64_t resident = table_.CandidateBytes(scope);
  if (bytes > resident) {
    return absl::ResourceExhaustedError(
        absl::StrCat("asked to release ", bytes, " bytes; can free at most ",
                     resident, " bytes (all resident tensors in scope)"));
  }
  // Greedy in the Filter's order, letting the Director offload what it
  // prefers. That can spend host memory that a tensor which can only be
  // offloaded (evict-pinned, uncomputable) needed; if the first pass falls
  // short after offloading anything, a second keeps the host for those
  // tensors and evicts everything that may be evicted.
  for (const bool reserve_host : {false, true}) {
    std::vector<ReleaseOrder> orders;
    int64_t freed = 0;
    int64_t host_left = host_bytes_available;
    int64_t queued = 0;  // on the link: offloads of tensors not copied ahead
    absl::Status failure;
    while (freed < bytes) {
      auto pick = Pick(scope, now_ns, [&](const Tensor& t) {
        return eligible(t) && director_.CanRelease(t, host_left);
      });
      if (!pick.ok()) break;
      const Tensor& t = table_.AtSlot(*pick);
      // CanRelease(t, 0) holds exactly when t may be evicted.
      const int64_t host_for_t =
          reserve_host && director_.CanRelease(t, 0) ? 0 : host_left;
      auto action = director_.Decide(table_, *pick, host_for_t, queued);
      if (!action.ok()) {  // CanRelease said yes: only a bug gets here
        failure = action.status();
        break;
      }
      const ReleaseOrder order{t.id, *action, t.bytes};
      const bool copied = t.flags.host_copy;  // cleared by the state change
      const absl::Status applied = table_.SetState(
          t.id, *action == ReleaseAction::kEvict ? TensorState::kEvicted
                                                 : TensorState::kOffloading);
      if (!applied.ok()) {
        failure = applied;
        break;
      }
      if (*action == ReleaseAction::kOffload) {
        host_left -= order.bytes;
        if (!copied) queued += order.bytes;
      }
      freed += order.bytes;
      orders.push_back(order);
    }
    if (freed >= bytes) return orders;

    // Undo in reverse so union-find components and lists end as they began.
    for (auto it = orders.rbegin(); it != orders.rend(); ++it) {
      DELTAD_RETURN_IF_ERROR(table_.CancelRelease(it->id));
    }
    if (!failure.ok()) return failure;
    most = std::max(most, freed);
    // Nothing was offloaded: keeping the host back cannot free more.
    if (host_left == host_bytes_available) break;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "asked to release ", bytes, " bytes; can free at most ", most,
      " bytes (the rest is locked, pinned, or needs host memory the pool "
      "lacks)"));
}

std::vector<ReleaseOrder> ReleasePlanner::OffloadAhead(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available) {
  return OffloadAhead(scope, bytes, now_ns, host_bytes_available, AnyTensor);
}

std::vector<ReleaseOrder> ReleasePlanner::OffloadAhead(
    const Scope& scope, int64_t bytes, int64_t now_ns,
    int64_t host_bytes_available, Eligible eligible) {
  Filter::Batch batch(filter_);
  std::vector<ReleaseOrder> orders;
  int64_t host_left = std::max<int64_t>(0, host_bytes_available);
  // Offloads planned in this call queue behind each other on the link.
  const int64_t host_left_at_start = host_left;
  for (int64_t freed = 0; freed < bytes;) {
    auto pick = Pick(scope, now_ns, [&](const Tensor& t) {
      if (!eligible(t) || !director_.CanRelease(t, host_left)) return false;
      auto action = director_.Decide(table_, table_.SlotOfTensor(t), host_left,
                                     host_left_at_start - host_left);
      return action.ok() && *action == ReleaseAction::kOffload;
    });
    if (!pick.ok()) break;
    const Tensor& t = table_.AtSlot(*pick);
    const ReleaseOrder order{t.id, ReleaseAction::kOffload, t.bytes};
    if (!table_.SetState(t.id, TensorState::kOffloading).ok()) break;
    host_left -= order.bytes;
    freed += order.bytes;
    orders.push_back(order);
  }
  return orders;
}

}  // namespace deltad::policy
