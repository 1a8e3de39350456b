#ifndef DELTAD_TESTS_UNIT_DAEMON_SIM_NODE_H_
#define DELTAD_TESTS_UNIT_DAEMON_SIM_NODE_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/backend/sim_backend.h"
#include "daemon/host_pool.h"
#include "daemon/metrics.h"
#include "daemon/metrics_observer.h"
#include "daemon/node.h"

namespace deltad::daemon::testing_util {

// A Node over two simulated 10 GiB GPUs (9 GiB of budget each at the
// default share), a host pool in 64 MiB slabs, and metrics: what the daemon
// runs, minus the sockets.
struct SimNode {
  std::unique_ptr<SimBackend> backend;
  std::unique_ptr<HostPool> pool;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Node> node;
};

inline absl::StatusOr<SimNode> MakeSimNode(int64_t pool_bytes,
                                           NodeOptions options) {
  SimNode n;
  SimBackendOptions sim;
  sim.gpus = 2;
  sim.memory_bytes = int64_t{10} << 30;
  auto backend = SimBackend::Create(sim);
  if (!backend.ok()) return backend.status();
  n.backend = std::move(*backend);
  auto pool = HostPool::Create(pool_bytes, int64_t{64} << 20);
  if (!pool.ok()) return pool.status();
  n.pool = std::move(*pool);
  std::vector<GpuLabel> labels;
  for (const GpuInfo& g : n.backend->gpus()) {
    labels.push_back({g.index, g.uuid, g.memory_bytes});
  }
  auto metrics = Metrics::Create(labels, "test", "sim");
  if (!metrics.ok()) return metrics.status();
  n.metrics = std::move(*metrics);
  auto node =
      Node::Create(*n.backend, *n.pool,
                   std::make_unique<MetricsObserver>(*n.metrics), options);
  if (!node.ok()) return node.status();
  n.node = std::move(*node);
  return n;
}

}  // namespace deltad::daemon::testing_util

#endif  // DELTAD_TESTS_UNIT_DAEMON_SIM_NODE_H_
