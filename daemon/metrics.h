#ifndef DELTAD_DAEMON_METRICS_H_
#define DELTAD_DAEMON_METRICS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "daemon/session_lifecycle.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace deltad::daemon {

// One GPU as it appears in the labels of the per-GPU metrics.
struct GpuLabel {
  int index = 0;     // the daemon's GPU index, label `gpu`
  std::string uuid;  // label `uuid`: stable across reboots, unlike the index
  int64_t memory_bytes = 0;  // reported as deltad_gpu_memory_bytes
};

// Direction of a copy between a GPU and the host pool.
enum class Direction {
  kDeviceToHost,  // an offload, direction="d2h"
  kHostToDevice,  // a reload or prefetch, direction="h2d"
};

// What an order sent to a process asks of it.
enum class OrderKind {
  kOffload,   // kind="offload"
  kEvict,     // kind="evict"
  kPrefetch,  // kind="prefetch"
  kBudget,    // kind="budget"
};

// A limit a client was refused at (label `limit`).
enum class Refusal {
  kInvalidRequest,    // "invalid_request": did not parse, or a field past
                      // its limit (INVALID_ARGUMENT)
  kQueuedOrderBytes,  // "max_queued_order_bytes": a stream left unread
  kAdmission,  // "admission": a session whose floor would not fit beside the
               // running sessions' floors
  kSessionsPerUid,         // "max_sessions_per_uid"
  kSessionsPerGpu,         // "max_sessions_per_gpu"
  kSideConnections,        // "max_side_connections": the side socket's
  kSideConnectionsPerUid,  // "max_side_connections_per_uid": and per user
  kPingStrikes,      // "max_ping_strikes": a connection gRPC closed with GOAWAY
                     // ENHANCE_YOUR_CALM for pinging too often
  kGrpcConnections,  // "max_grpc_connections": the gRPC socket's
  kGrpcConnectionsPerUid,  // "max_grpc_connections_per_uid": and per user
  kUnreadConnection,       // "unread_connection": a gRPC connection shut down,
                           // its client leaving the daemon's bytes unread
  kGrpcThreads,   // "grpc_max_threads": a unary call gRPC answered itself for
                  // want of a free thread (daemon/thread_refusals.h)
  kMessageBytes,  // "max_message_bytes": a request past it (up to gRPC's own
                  // backstop, request_limits.h)
  kGrpcEndedUnseen,  // "grpc_ended_unseen": a call gRPC ended before the
                     // daemon saw it (past the backstop, its memory quota;
                     // daemon/grpc_call_census.h)
  kGrpcMemory,  // "grpc_memory_bytes": a connection gRPC closed with GOAWAY
                // ENHANCE_YOUR_CALM "Buffers full", its memory quota short
  kConcurrentStreams,  // "max_concurrent_streams": a gRPC connection that
                       // opened more calls before it acknowledged the
                       // daemon's SETTINGS
  kSettingsAck,  // "settings_ack_ms": one that did not acknowledge them in
                 // time (or sent a buffer's worth first)
};

// The daemon's Prometheus metrics. Call sites use the typed methods and never
// build metric names or labels, which keeps names, units and label sets in
// one place (and keeps tensor ids, whose number is unbounded, out of labels).
//
// Every metric is named deltad_*, in base units (bytes, seconds); per-GPU
// metrics carry `gpu` (index) and `uuid` labels. A GPU index the metrics were
// not created with is ignored: indexes come from clients and must never crash
// the daemon nor create new series.
//
// Thread safe: every method may be called from any thread. The set of GPUs is
// fixed at Create, so lookups need no lock; the metrics themselves are atomic.
class Metrics {
 public:
  // InvalidArgument for a negative or repeated GPU index.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(
      std::vector<GpuLabel> gpus, std::string version, std::string backend);

  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Gauges, in bytes. deltad_gpu_budget_bytes is what the daemon hands out on
  // the GPU; deltad_gpu_used_bytes what the sessions report holding.
  void SetGpuBudget(int gpu, int64_t bytes);
  void SetGpuUsed(int gpu, int64_t bytes);
  // Sessions on the GPU.
  void SetSessions(int gpu, int64_t sessions);
  // Sessions on the GPU that stopped answering, and the chunk bytes they
  // hold.
  void SetUnresponsive(int gpu, int64_t sessions, int64_t bytes);
  // Chunks processes map that the daemon holds no handle of.
  void SetUnlisted(int gpu, int64_t bytes);
  // The host pool, which is not per GPU.
  void SetHostPool(int64_t free_bytes, int64_t granted_bytes);
  // The daemon's own heap in use (HeapInUseBytes); negative: unknown, not
  // set.
  void SetHeapInUse(int64_t bytes);

  // Counters. Negative or non-finite amounts are ignored: a counter that went
  // down or became NaN would corrupt every rate() over it.
  void AddTransferred(int gpu, Direction direction, int64_t bytes);
  void AddEviction(int gpu);
  // One recompute of an evicted tensor, which took `seconds`.
  void AddRecompute(int gpu, double seconds);
  void AddOrders(int gpu, OrderKind kind, int64_t n);
  // deltad_refused_total{limit}: one client request or stream refused.
  void AddRefusal(Refusal refusal);
  // Node-wide: one session ended, and why.
  void AddSessionEnded(SessionEnd why);
  // Node-wide: a lease event.
  void AddLeaseEvent(LeaseEvent event);

  // Latency of one release decision (choosing what to offload or evict).
  void ObserveDecision(int gpu, double seconds);

  // The text exposition format, as /metrics serves it.
  std::string Scrape() const;

  // For MetricsServer::Start.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  struct GpuMetrics {
    prometheus::Gauge* memory = nullptr;
    prometheus::Gauge* budget = nullptr;
    prometheus::Gauge* used = nullptr;
    prometheus::Gauge* sessions = nullptr;
    prometheus::Gauge* unresponsive_sessions = nullptr;
    prometheus::Gauge* unresponsive_bytes = nullptr;
    prometheus::Gauge* unlisted_bytes = nullptr;
    prometheus::Counter* d2h = nullptr;
    prometheus::Counter* h2d = nullptr;
    prometheus::Counter* evictions = nullptr;
    prometheus::Counter* recomputes = nullptr;
    prometheus::Counter* recompute_seconds = nullptr;
    std::array<prometheus::Counter*, 4> orders{};  // indexed by OrderKind
    prometheus::Histogram* decision = nullptr;
  };

  Metrics() = default;
  // nullptr for an unknown GPU.
  const GpuMetrics* Find(int gpu) const;

  // The metrics below point into families the registry owns; shared so that
  // a MetricsServer can keep collecting through a weak_ptr.
  std::shared_ptr<prometheus::Registry> registry_;
  absl::flat_hash_map<int, GpuMetrics> gpus_;  // immutable after Create
  prometheus::Gauge* host_free_ = nullptr;
  prometheus::Gauge* host_granted_ = nullptr;
  prometheus::Gauge* heap_in_use_ = nullptr;
  std::array<prometheus::Counter*, 17> refusals_{};       // indexed by Refusal
  std::array<prometheus::Counter*, 3> sessions_ended_{};  // by SessionEnd
  std::array<prometheus::Counter*, 3> lease_events_{};    // by LeaseEvent
};

// Serves a registry's text exposition over HTTP at /metrics (GET only; any
// other path is 404). Read-only: nothing it serves changes the daemon.
// Stops serving when destroyed.
class MetricsServer {
 public:
  // `address` is host:port, e.g. "127.0.0.1:9464"; port 0 picks a free
  // port (see port()). Errors (bad address, port in use) come back as a
  // Status: UNAVAILABLE when the server could not start, INVALID_ARGUMENT
  // for an empty address or a null registry.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address,
      std::shared_ptr<prometheus::Registry> registry);

  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port actually listened on; 0 if unknown.
  int port() const;

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer,
                std::shared_ptr<prometheus::Registry> registry);

  std::unique_ptr<prometheus::Exposer> exposer_;
  // The exposer holds only a weak_ptr; this keeps the registry alive for as
  // long as it is served.
  std::shared_ptr<prometheus::Registry> registry_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_METRICS_H_
