#ifndef DELTAD_DAEMON_METRICS_OBSERVER_H_
#define DELTAD_DAEMON_METRICS_OBSERVER_H_

#include <chrono>
#include <cstdint>

#include "daemon/metrics.h"
#include "daemon/node_events.h"

namespace deltad::daemon {

// The Node's events as Prometheus metrics: the one place that knows which
// event moves which series, so that the node stays free of them. Does not
// own the metrics, which must outlive it. Thread safe, as Metrics is.
class MetricsObserver : public NodeEvents {
 public:
  explicit MetricsObserver(Metrics& metrics) : metrics_(metrics) {}

  void GpuBudget(int gpu, int64_t budget_bytes) override;
  void GpuChanged(int gpu, const GpuState& state) override;
  void HostPoolChanged(const HostPoolStats& pool) override;
  void OpenRefused(int gpu, OpenRefusal why) override;
  void BatchApplied(int gpu, SessionId session,
                    const AppliedCounts& applied) override;
  void Decided(int gpu, SessionId session,
               std::chrono::nanoseconds took) override;
  void Ordered(int gpu, SessionId session, const v1::Orders& orders) override;
  void LeaseChanged(int gpu, SessionId session, LeaseEvent event) override;
  void SessionEnded(int gpu, SessionId session, SessionEnd why) override;

 private:
  Metrics& metrics_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_METRICS_OBSERVER_H_
