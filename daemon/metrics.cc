#include "daemon/metrics.h"

#include <cmath>
#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace deltad::daemon {
namespace {

// Release decisions run on the path of an allocation that is waiting for
// memory: the interesting range is microseconds to a few milliseconds, and
// anything past 100 ms is simply too slow. Steps of 1, 2.5, 5 per decade.
prometheus::Histogram::BucketBoundaries DecisionBuckets() {
  return {1e-6, 2.5e-6, 5e-6,   1e-5, 2.5e-5, 5e-5,   1e-4, 2.5e-4,
          5e-4, 1e-3,   2.5e-3, 5e-3, 1e-2,   2.5e-2, 5e-2, 1e-1};
}

// Counters only go up, and a NaN would poison the series for good.
bool Countable(double amount) { return std::isfinite(amount) && amount >= 0; }

}  // namespace

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(
    std::vector<GpuLabel> gpus, std::string version, std::string backend) {
  for (size_t i = 0; i < gpus.size(); ++i) {
    if (gpus[i].index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics: negative GPU index ", gpus[i].index));
    }
    for (size_t j = 0; j < i; ++j) {
      if (gpus[j].index == gpus[i].index) {
        return absl::InvalidArgumentError(
            absl::StrCat("metrics: GPU index ", gpus[i].index, " repeated"));
      }
    }
  }

  auto m = std::unique_ptr<Metrics>(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;
  // prometheus-cpp reports invalid names and labels by throwing; the names
  // here are constants, but a Status is what callers of Create handle.
  try {
    prometheus::BuildGauge()
        .Name("deltad_build_info")
        .Help(
            "Always 1; the labels give the daemon's version and the device "
            "backend in use.")
        .Register(r)
        .Add({{"version", std::move(version)}, {"backend", std::move(backend)}})
        .Set(1);

    auto& host = prometheus::BuildGauge()
                     .Name("deltad_host_pool_bytes")
                     .Help(
                         "Host pool memory by state: free (grantable now) "
                         "or granted (held by sessions).")
                     .Register(r);
    m->host_free_ = &host.Add({{"state", "free"}});
    m->host_granted_ = &host.Add({{"state", "granted"}});
    m->heap_in_use_ = &prometheus::BuildGauge()
                           .Name("deltad_heap_in_use_bytes")
                           .Help(
                               "The daemon's heap handed out and not freed "
                               "(jemalloc's stats.allocated, or glibc's "
                               "mallinfo2: arenas plus mappings); "
                               "unlike its resident size, it keeps no "
                               "high-water mark, so a leak shows as a climb.")
                           .Register(r)
                           .Add({});

    auto& refused = prometheus::BuildCounter()
                        .Name("deltad_refused_total")
                        .Help(
                            "Client requests and streams refused at a limit, "
                            "by the limit: invalid_request (did not parse, or "
                            "a field past its limit), max_queued_order_bytes "
                            "(a stream left unread, ended), admission (a "
                            "session whose floor would not fit beside the "
                            "running sessions' floors), max_sessions_per_uid "
                            "and max_sessions_per_gpu (a session past either "
                            "limit), max_side_connections and "
                            "max_side_connections_per_uid (a side-socket "
                            "connection past either), max_ping_strikes (a "
                            "gRPC connection closed for pinging too often), "
                            "max_grpc_connections and "
                            "max_grpc_connections_per_uid (a gRPC connection "
                            "past either), unread_connection (a gRPC "
                            "connection shut down: its client left the "
                            "daemon's bytes unread past the keepalive), "
                            "grpc_max_threads (a call gRPC refused for want "
                            "of a free thread), max_message_bytes (a request "
                            "past it), grpc_ended_unseen (a call gRPC ended "
                            "before the daemon saw it: a message past 4 times "
                            "max_message_bytes, its memory quota, or its "
                            "client cancelled it first), grpc_memory_bytes (a "
                            "gRPC connection gRPC closed with GOAWAY \"Buffers "
                            "full\" for want of memory in its quota), "
                            "max_concurrent_streams (a gRPC connection that "
                            "opened more calls before acknowledging the "
                            "daemon's SETTINGS), settings_ack_ms (one that "
                            "did not acknowledge them in time).")
                        .Register(r);
    for (const auto& [refusal, limit] :
         {std::pair{Refusal::kInvalidRequest, "invalid_request"},
          std::pair{Refusal::kQueuedOrderBytes, "max_queued_order_bytes"},
          std::pair{Refusal::kAdmission, "admission"},
          std::pair{Refusal::kSessionsPerUid, "max_sessions_per_uid"},
          std::pair{Refusal::kSessionsPerGpu, "max_sessions_per_gpu"},
          std::pair{Refusal::kSideConnections, "max_side_connections"},
          std::pair{Refusal::kSideConnectionsPerUid,
                    "max_side_connections_per_uid"},
          std::pair{Refusal::kPingStrikes, "max_ping_strikes"},
          std::pair{Refusal::kGrpcConnections, "max_grpc_connections"},
          std::pair{Refusal::kGrpcConnectionsPerUid,
                    "max_grpc_connections_per_uid"},
          std::pair{Refusal::kUnreadConnection, "unread_connection"},
          std::pair{Refusal::kGrpcThreads, "grpc_max_threads"},
          std::pair{Refusal::kMessageBytes, "max_message_bytes"},
          std::pair{Refusal::kGrpcEndedUnseen, "grpc_ended_unseen"},
          std::pair{Refusal::kGrpcMemory, "grpc_memory_bytes"},
          std::pair{Refusal::kConcurrentStreams, "max_concurrent_streams"},
          std::pair{Refusal::kSettingsAck, "settings_ack_ms"}}) {
      m->refusals_[static_cast<size_t>(refusal)] =
          &refused.Add({{"limit", limit}});
    }

    auto& ended = prometheus::BuildCounter()
                      .Name("deltad_sessions_ended_total")
                      .Help(
                          "Sessions ended, by reason: closed by their "
                          "process, stream_broken (the stream failed or was "
                          "cancelled first), process_gone (its side "
                          "connection closed first).")
                      .Register(r);
    for (const auto& [why, reason] :
         {std::pair{SessionEnd::kClosed, "closed"},
          std::pair{SessionEnd::kStreamBroken, "stream_broken"},
          std::pair{SessionEnd::kProcessGone, "process_gone"}}) {
      m->sessions_ended_[static_cast<size_t>(why)] =
          &ended.Add({{"reason", reason}});
    }

    auto& lease = prometheus::BuildCounter()
                      .Name("deltad_unresponsive_total")
                      .Help(
                          "Leases: sessions marked unresponsive (silent past "
                          "lease.lease_ms), sessions that answered again "
                          "after that, and processes ended for it "
                          "(lease.end_unresponsive_after_ms).")
                      .Register(r);
    for (const auto& [event, name] :
         {std::pair{LeaseEvent::kMarked, "marked"},
          std::pair{LeaseEvent::kAnswered, "answered"},
          std::pair{LeaseEvent::kEnded, "ended"}}) {
      m->lease_events_[static_cast<size_t>(event)] =
          &lease.Add({{"event", name}});
    }

    auto& memory = prometheus::BuildGauge()
                       .Name("deltad_gpu_memory_bytes")
                       .Help("Total memory of the GPU.")
                       .Register(r);
    auto& budget = prometheus::BuildGauge()
                       .Name("deltad_gpu_budget_bytes")
                       .Help("GPU memory the daemon hands out to sessions.")
                       .Register(r);
    auto& used = prometheus::BuildGauge()
                     .Name("deltad_gpu_used_bytes")
                     .Help("GPU memory the sessions report holding.")
                     .Register(r);
    auto& sessions = prometheus::BuildGauge()
                         .Name("deltad_sessions")
                         .Help("Sessions on the GPU.")
                         .Register(r);
    auto& unresponsive =
        prometheus::BuildGauge()
            .Name("deltad_unresponsive_sessions")
            .Help("Sessions on the GPU whose processes stopped answering.")
            .Register(r);
    auto& unresponsive_bytes =
        prometheus::BuildGauge()
            .Name("deltad_unresponsive_bytes")
            .Help(
                "GPU memory in chunks held by sessions that stopped "
                "answering: the others' budgets do not count on it.")
            .Register(r);
    auto& unlisted =
        prometheus::BuildGauge()
            .Name("deltad_unlisted_bytes")
            .Help(
                "GPU memory in chunks that processes still map after their "
                "sessions ended (a stall, a restart, a cut stream), which "
                "the daemon holds no handle of: in use, granted to no one.")
            .Register(r);
    auto& transferred =
        prometheus::BuildCounter()
            .Name("deltad_transferred_bytes_total")
            .Help(
                "Bytes copied between the GPU and the host pool: d2h for "
                "offloads, h2d for reloads and prefetches.")
            .Register(r);
    auto& evictions = prometheus::BuildCounter()
                          .Name("deltad_evictions_total")
                          .Help(
                              "Tensors evicted (freed without a copy, to be "
                              "recomputed when needed).")
                          .Register(r);
    auto& recomputes = prometheus::BuildCounter()
                           .Name("deltad_recomputes_total")
                           .Help("Evicted tensors recomputed.")
                           .Register(r);
    auto& recompute_seconds =
        prometheus::BuildCounter()
            .Name("deltad_recompute_seconds_total")
            .Help("Time spent recomputing evicted tensors.")
            .Register(r);
    auto& orders = prometheus::BuildCounter()
                       .Name("deltad_orders_total")
                       .Help("Orders sent to processes, by kind.")
                       .Register(r);
    auto& decision = prometheus::BuildHistogram()
                         .Name("deltad_release_decision_seconds")
                         .Help(
                             "Time taken to decide what to release when a "
                             "GPU is short of memory.")
                         .Register(r);

    const auto buckets = DecisionBuckets();
    for (const GpuLabel& gpu : gpus) {
      const prometheus::Labels labels = {{"gpu", std::to_string(gpu.index)},
                                         {"uuid", gpu.uuid}};
      auto with = [&labels](const char* name, const char* value) {
        prometheus::Labels l = labels;
        l.emplace(name, value);
        return l;
      };
      GpuMetrics g;
      g.memory = &memory.Add(labels);
      g.memory->Set(static_cast<double>(gpu.memory_bytes));
      g.budget = &budget.Add(labels);
      g.used = &used.Add(labels);
      g.sessions = &sessions.Add(labels);
      g.unresponsive_sessions = &unresponsive.Add(labels);
      g.unresponsive_bytes = &unresponsive_bytes.Add(labels);
      g.unlisted_bytes = &unlisted.Add(labels);
      g.d2h = &transferred.Add(with("direction", "d2h"));
      g.h2d = &transferred.Add(with("direction", "h2d"));
      g.evictions = &evictions.Add(labels);
      g.recomputes = &recomputes.Add(labels);
      g.recompute_seconds = &recompute_seconds.Add(labels);
      g.orders[static_cast<size_t>(OrderKind::kOffload)] =
          &orders.Add(with("kind", "offload"));
      g.orders[static_cast<size_t>(OrderKind::kEvict)] =
          &orders.Add(with("kind", "evict"));
      g.orders[static_cast<size_t>(OrderKind::kPrefetch)] =
          &orders.Add(with("kind", "prefetch"));
      g.orders[static_cast<size_t>(OrderKind::kBudget)] =
          &orders.Add(with("kind", "budget"));
      g.decision = &decision.Add(labels, buckets);
      m->gpus_.emplace(gpu.index, g);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("metrics: cannot register: ", e.what()));
  }
  return m;
}

Metrics::~Metrics() = default;

const Metrics::GpuMetrics* Metrics::Find(int gpu) const {
  auto it = gpus_.find(gpu);
  return it == gpus_.end() ? nullptr : &it->second;
}

void Metrics::SetGpuBudget(int gpu, int64_t bytes) {
  if (const GpuMetrics* g = Find(gpu))
    g->budget->Set(static_cast<double>(bytes));
}

void Metrics::SetGpuUsed(int gpu, int64_t bytes) {
  if (const GpuMetrics* g = Find(gpu)) g->used->Set(static_cast<double>(bytes));
}

void Metrics::SetSessions(int gpu, int64_t sessions) {
  if (const GpuMetrics* g = Find(gpu)) {
    g->sessions->Set(static_cast<double>(sessions));
  }
}

void Metrics::SetUnresponsive(int gpu, int64_t sessions, int64_t bytes) {
  if (const GpuMetrics* g = Find(gpu)) {
    g->unresponsive_sessions->Set(static_cast<double>(sessions));
    g->unresponsive_bytes->Set(static_cast<double>(bytes));
  }
}

void Metrics::SetUnlisted(int gpu, int64_t bytes) {
  if (const GpuMetrics* g = Find(gpu)) {
    g->unlisted_bytes->Set(static_cast<double>(bytes));
  }
}

void Metrics::SetHostPool(int64_t free_bytes, int64_t granted_bytes) {
  host_free_->Set(static_cast<double>(free_bytes));
  host_granted_->Set(static_cast<double>(granted_bytes));
}

void Metrics::SetHeapInUse(int64_t bytes) {
  if (bytes >= 0) heap_in_use_->Set(static_cast<double>(bytes));
}

void Metrics::AddTransferred(int gpu, Direction direction, int64_t bytes) {
  const GpuMetrics* g = Find(gpu);
  if (g == nullptr || bytes < 0) return;
  prometheus::Counter* c =
      direction == Direction::kDeviceToHost ? g->d2h : g->h2d;
  c->Increment(static_cast<double>(bytes));
}

void Metrics::AddEviction(int gpu) {
  if (const GpuMetrics* g = Find(gpu)) g->evictions->Increment();
}

void Metrics::AddRecompute(int gpu, double seconds) {
  const GpuMetrics* g = Find(gpu);
  if (g == nullptr || !Countable(seconds)) return;
  g->recomputes->Increment();
  g->recompute_seconds->Increment(seconds);
}

void Metrics::AddOrders(int gpu, OrderKind kind, int64_t n) {
  const GpuMetrics* g = Find(gpu);
  const auto k = static_cast<size_t>(kind);
  if (g == nullptr || n < 0 || k >= g->orders.size()) return;
  g->orders[k]->Increment(static_cast<double>(n));
}

void Metrics::AddRefusal(Refusal refusal) {
  const auto k = static_cast<size_t>(refusal);
  if (k < refusals_.size()) refusals_[k]->Increment();
}

void Metrics::AddSessionEnded(SessionEnd why) {
  const auto k = static_cast<size_t>(why);
  if (k < sessions_ended_.size()) sessions_ended_[k]->Increment();
}

void Metrics::AddLeaseEvent(LeaseEvent event) {
  const auto k = static_cast<size_t>(event);
  if (k < lease_events_.size()) lease_events_[k]->Increment();
}

void Metrics::ObserveDecision(int gpu, double seconds) {
  const GpuMetrics* g = Find(gpu);
  // A NaN would land in no bucket yet still count, and a negative duration
  // is a clock error, not a decision.
  if (g == nullptr || !Countable(seconds)) return;
  g->decision->Observe(seconds);
}

std::string Metrics::Scrape() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer,
                             std::shared_ptr<prometheus::Registry> registry)
    : exposer_(std::move(exposer)), registry_(std::move(registry)) {}

MetricsServer::~MetricsServer() = default;

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address,
    std::shared_ptr<prometheus::Registry> registry) {
  if (address.empty()) {
    return absl::InvalidArgumentError("metrics: empty listen address");
  }
  if (registry == nullptr) {
    return absl::InvalidArgumentError("metrics: no registry to serve");
  }
  // The exposer (civetweb underneath) throws when it cannot parse the
  // address or bind the port; the daemon must get a Status, not terminate.
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(address);
    // civetweb matches handler URIs as prefixes, so plain "/metrics" would
    // also answer /metricsx and /metrics/anything; "$" anchors the pattern.
    exposer->RegisterCollectable(registry, "/metrics$");
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot serve on \"", address, "\": ", e.what()));
  } catch (...) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot serve on \"", address, "\""));
  }
  return std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(exposer), std::move(registry)));
}

int MetricsServer::port() const {
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace deltad::daemon
