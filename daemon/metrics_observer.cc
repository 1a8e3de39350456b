#include "daemon/metrics_observer.h"

namespace deltad::daemon {

void MetricsObserver::GpuBudget(int gpu, int64_t budget_bytes) {
  metrics_.SetGpuBudget(gpu, budget_bytes);
}

void MetricsObserver::GpuChanged(int gpu, const GpuState& state) {
  metrics_.SetGpuUsed(gpu, state.used_bytes);
  metrics_.SetSessions(gpu, state.sessions);
  metrics_.SetUnresponsive(gpu, state.unresponsive_sessions,
                           state.unresponsive_bytes);
  metrics_.SetUnlisted(gpu, state.unlisted_bytes);
}

void MetricsObserver::HostPoolChanged(const HostPoolStats& pool) {
  metrics_.SetHostPool(pool.free_bytes, pool.granted_bytes);
}

void MetricsObserver::OpenRefused(int /*gpu*/, OpenRefusal why) {
  switch (why) {
    case OpenRefusal::kSessionsPerUid:
      metrics_.AddRefusal(Refusal::kSessionsPerUid);
      return;
    case OpenRefusal::kSessionsPerGpu:
      metrics_.AddRefusal(Refusal::kSessionsPerGpu);
      return;
    case OpenRefusal::kAdmission:
      metrics_.AddRefusal(Refusal::kAdmission);
      return;
  }
}

void MetricsObserver::BatchApplied(int gpu, SessionId /*session*/,
                                   const AppliedCounts& applied) {
  metrics_.AddTransferred(gpu, Direction::kDeviceToHost,
                          applied.offloaded_bytes);
  metrics_.AddTransferred(gpu, Direction::kHostToDevice,
                          applied.reloaded_bytes);
  for (int64_t i = 0; i < applied.evictions; ++i) metrics_.AddEviction(gpu);
  for (int64_t i = 0; i < applied.recomputes; ++i) {
    // The costs arrive summed; each recompute is counted once and the time
    // goes with the first.
    metrics_.AddRecompute(
        gpu, i == 0 ? static_cast<double>(applied.recompute_ns) / 1e9 : 0.0);
  }
}

void MetricsObserver::Decided(int gpu, SessionId /*session*/,
                              std::chrono::nanoseconds took) {
  metrics_.ObserveDecision(gpu, std::chrono::duration<double>(took).count());
}

void MetricsObserver::Ordered(int gpu, SessionId /*session*/,
                              const v1::Orders& orders) {
  int64_t offloads = 0;
  int64_t evictions = 0;
  for (const v1::ReleaseOrder& o : orders.release()) {
    (o.action() == v1::ReleaseOrder::OFFLOAD ? offloads : evictions) += 1;
  }
  metrics_.AddOrders(gpu, OrderKind::kOffload, offloads);
  metrics_.AddOrders(gpu, OrderKind::kEvict, evictions);
  metrics_.AddOrders(gpu, OrderKind::kPrefetch,
                     orders.prefetch_tensor_ids_size());
  metrics_.AddOrders(gpu, OrderKind::kBudget,
                     orders.new_budget_bytes() > 0 ? 1 : 0);
}

void MetricsObserver::LeaseChanged(int /*gpu*/, SessionId /*session*/,
                                   LeaseEvent event) {
  metrics_.AddLeaseEvent(event);
}

void MetricsObserver::SessionEnded(int /*gpu*/, SessionId /*session*/,
                                   SessionEnd why) {
  metrics_.AddSessionEnded(why);
}

}  // namespace deltad::daemon
