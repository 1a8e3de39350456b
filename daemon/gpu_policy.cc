#include "daemon/gpu_policy.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "policies/status_macros.h"

namespace deltad::daemon {

using policy::Tensor;
using policy::TensorState;

GpuPolicy::GpuPolicy(int gpu, int64_t gpu_budget_bytes,
                     GpuPolicyOptions options, policy::Watermarks watermarks)
    : gpu_(gpu),
      gpu_budget_bytes_(gpu_budget_bytes),
      options_(std::move(options)),
      watermarks_(watermarks),
      filter_(options_.filter, &costs_),
      director_(costs_) {}

absl::StatusOr<std::unique_ptr<GpuPolicy>> GpuPolicy::Create(
    int gpu, int64_t gpu_budget_bytes, GpuPolicyOptions options) {
  if (gpu < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative GPU index ", gpu));
  }
  if (gpu_budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu, ": budget must be positive, got ", gpu_budget_bytes));
  }
  if (!(options.prefetch_replay_window >= 0) ||
      options.prefetch_replay_window > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch_replay_window must be in [0, 1], got ",
                     options.prefetch_replay_window));
  }
  if (options.max_recorded_accesses < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_recorded_accesses must not be negative, got ",
                     options.max_recorded_accesses));
  }
  if (options.max_prefetch_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_prefetch_in_flight must be at least 1, got ",
                     options.max_prefetch_in_flight));
  }
  // The compute-cost bound keeps cost sums from overflowing only up to this
  // many tensors in a session (see kMaxComputeCostNs).
  constexpr int64_t kMaxTensorsPerSession =
      std::numeric_limits<int64_t>::max() / 2 / kMaxComputeCostNs;
  if (options.max_tensors_per_session < 1 ||
      options.max_tensors_per_session > kMaxTensorsPerSession) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tensors_per_session must be within 1..", kMaxTensorsPerSession,
        ", got ", options.max_tensors_per_session));
  }
  if (options.max_batch_events < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_events must be at least 1, got ", options.max_batch_events));
  }
  absl::StatusOr<policy::Watermarks> watermarks =
      policy::Watermarks::Create(options.high_watermark, options.low_watermark);
  if (!watermarks.ok()) return watermarks.status();
  const policy::LinkBandwidth link = options.link;
  std::unique_ptr<GpuPolicy> p(
      new GpuPolicy(gpu, gpu_budget_bytes, std::move(options), *watermarks));
  DELTAD_RETURN_IF_ERROR(p->costs_.SetBandwidth(gpu, link));
  return p;
}

absl::Status GpuPolicy::AddSession(SessionId session, int64_t budget_bytes,
                                   int64_t host_quota_bytes) {
  if (sessions_.contains(session)) {
    return absl::AlreadyExistsError(
        absl::StrCat("session ", session, " is already on GPU ", gpu_));
  }
  if (budget_bytes < 0 || host_quota_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", session, ": negative budget (", budget_bytes,
                     " bytes) or host quota (", host_quota_bytes, " bytes)"));
  }
  policy::PrefetchOptions prefetch;
  prefetch.max_in_flight = options_.max_prefetch_in_flight;
  absl::StatusOr<policy::Prefetcher> prefetcher =
      policy::Prefetcher::Create(prefetch);
  if (!prefetcher.ok()) return prefetcher.status();
  Session& s = sessions_[session];
  s.budget_bytes = budget_bytes;
  s.host_quota_bytes = host_quota_bytes;
  s.prefetcher = std::make_unique<policy::Prefetcher>(std::move(*prefetcher));
  s.order = std::make_unique<PrefetchOrder>(options_.max_recorded_accesses,
                                            options_.prefetch_replay_window);
  return absl::OkStatus();
}

absl::StatusOr<const PrefetchOrder*> GpuPolicy::EndIteration(SessionId session,
                                                             int64_t now_ns) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  PrefetchOrder& order = *it->second.order;
  return order.EndIteration(now_ns) ? &order : nullptr;
}

absl::Status GpuPolicy::RemoveSession(SessionId session) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  table_.RemoveSession(session);
  sessions_.erase(it);
  return absl::OkStatus();
}

absl::Status GpuPolicy::SetBudget(SessionId session, int64_t budget_bytes) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  if (budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", session, ": negative budget ", budget_bytes, " bytes"));
  }
  it->second.budget_bytes = budget_bytes;
  return absl::OkStatus();
}

// --- Usage -------------------------------------------------------------------

absl::StatusOr<SessionUsage> GpuPolicy::Usage(SessionId session) const {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  const policy::MemoryStats stats = table_.SessionStats(session);
  SessionUsage u;
  u.budget_bytes = it->second.budget_bytes;
  u.host_quota_bytes = it->second.host_quota_bytes;
  u.device_bytes = stats.committed_bytes();
  u.host_bytes = stats.host_bytes;
  u.tensors = stats.tensors;
  u.releases_ordered = it->second.releases_ordered;
  return u;
}

absl::StatusOr<std::vector<v1::TensorStatus>> GpuPolicy::LargestTensors(
    SessionId session, size_t limit, int64_t now_ns) const {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  // `locals` holds every record of the session, so nothing of another
  // session can show up here.
  std::vector<std::pair<const Tensor*, uint64_t>> live;
  live.reserve(it->second.locals.size());
  for (const auto& [id, local] : it->second.locals) {
    const Tensor* t = table_.Find(id);
    if (t == nullptr || t->state == TensorState::kFreed) continue;
    live.emplace_back(t, local);
  }
  const size_t n = std::min(limit, live.size());
  // Ties broken by id so that repeated calls list the same tensors.
  std::partial_sort(live.begin(), live.begin() + static_cast<ptrdiff_t>(n),
                    live.end(), [](const auto& a, const auto& b) {
                      if (a.first->bytes != b.first->bytes) {
                        return a.first->bytes > b.first->bytes;
                      }
                      return a.second < b.second;
                    });
  std::vector<v1::TensorStatus> out(n);
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = *live[i].first;
    v1::TensorStatus& s = out[i];
    s.set_tensor_id(live[i].second);
    s.set_bytes(t.bytes);
    s.set_state(std::string(policy::TensorStateName(t.state)));
    s.set_recomputes(t.recompute_count);
    s.set_idle_ns(std::max<int64_t>(0, now_ns - t.last_access_ns));
  }
  return out;
}

int64_t GpuPolicy::device_bytes() const {
  return table_.GpuStats(gpu_).committed_bytes();
}

}  // namespace deltad::daemon
