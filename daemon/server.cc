#include "daemon/server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log_limit.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "daemon/backend/sim_backend.h"
#include "daemon/config.h"
#include "daemon/library_log.h"
#include "daemon/metrics_observer.h"
#include "daemon/thread_refusals.h"
#ifdef DELTAD_HAVE_CUDA
#include "daemon/backend/cuda_backend.h"
#endif
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "policies/heuristic.h"

#ifndef DELTAD_VERSION
#define DELTAD_VERSION "0.0.0"
#endif

namespace deltad::daemon {
namespace {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeSimBackend(
    const v1::DaemonConfig& config) {
  SimBackendOptions sim;
  sim.gpus = config.sim().gpus();
  sim.memory_bytes = config.sim().memory_bytes();
  sim.chunk_bytes = config.sim().chunk_bytes();
  sim.d2h_bytes_per_s = config.sim().d2h_bytes_per_second();
  sim.h2d_bytes_per_s = config.sim().h2d_bytes_per_second();
  auto backend = SimBackend::Create(sim);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<DeviceBackend>(std::move(*backend));
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(
    const v1::DaemonConfig& config) {
#ifdef DELTAD_HAVE_CUDA
  CudaBackendOptions cuda;
  cuda.chunk_bytes = config.cuda().chunk_bytes();
  cuda.measure_bandwidth = config.cuda().measure_bandwidth();
  auto backend = CudaBackend::Create(cuda);
  if (!backend.ok()) return backend.status();
  for (const std::string& note : (*backend)->notes()) {
    std::fprintf(stderr, "deltad: %s\n", note.c_str());
  }
  return std::unique_ptr<DeviceBackend>(std::move(*backend));
#else
  (void)config;
  return absl::FailedPreconditionError(
      "this deltad was built without the CUDA toolkit");
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeBackend(
    const v1::DaemonConfig& config) {
  const std::string& kind = config.backend();
  if (kind != "sim" && kind != "auto" && kind != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend must be auto, cuda or sim, got \"", kind, "\""));
  }
  if (kind == "sim") return MakeSimBackend(config);
  auto cuda = MakeCudaBackend(config);
  if (cuda.ok() || kind == "cuda") {
    if (!cuda.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("backend \"cuda\": ", cuda.status().message(),
                       "; run with --backend=sim for simulated GPUs"));
    }
    return cuda;
  }
  std::fprintf(stderr,
               "deltad: no CUDA GPU (%s); backend auto uses simulated GPUs\n",
               std::string(cuda.status().message()).c_str());
  return MakeSimBackend(config);
}

absl::StatusOr<NodeOptions> NodeOptionsFrom(const v1::DaemonConfig& config) {
  NodeOptions o;
  o.gpu_share = config.gpu_share();
  o.min_session_bytes = config.min_session_bytes();
  o.default_host_quota_bytes = config.default_host_quota_bytes();
  o.max_sessions_per_gpu = config.limits().max_sessions_per_gpu();
  o.max_sessions_per_uid = config.limits().max_sessions_per_uid();
  o.max_host_quota_bytes = config.limits().max_host_quota_bytes();
  o.max_status_sessions = config.limits().max_status_sessions();
  // Half the message limit: the GPUs and the rest of the reply fit beside.
  o.max_status_bytes = config.limits().max_message_bytes() / 2;
  auto heuristic = policy::ParseHeuristic(config.heuristic());
  if (!heuristic.ok()) return heuristic.status();
  o.policy.filter.heuristic = *heuristic;
  o.policy.filter.sampled = config.sampled_search();
  o.policy.filter.skip_small = config.sampled_search();
  o.policy.filter.exact_below = config.exact_search_below();
  o.policy.prefetch_replay_window = config.prefetch_replay_window();
  o.policy.max_recorded_accesses = config.limits().max_recorded_accesses();
  o.policy.high_watermark = config.high_watermark();
  o.policy.low_watermark = config.low_watermark();
  o.policy.max_tensors_per_session = config.limits().max_tensors_per_session();
  o.policy.max_batch_events = config.limits().max_batch_events();
  o.side_socket_path = common::side::SideSocketPath(config.socket_path());
  o.version = DELTAD_VERSION;
  return o;
}

namespace {

// gRPC's defaults let one local client hold a thread per idle stream
// without bound, and grow the daemon with pings (170 KB of PINGs added 57
// MiB): its memory and threads get a quota, and connections a policy.
void ApplyConnectionLimits(const v1::LimitsConfig& l,
                           grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("deltad");
  quota.Resize(static_cast<size_t>(l.grpc_memory_bytes()));
  quota.SetMaxThreads(l.grpc_max_threads());
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             l.max_concurrent_streams());
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      l.min_ping_interval_ms());
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES,
                             l.max_ping_strikes());
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, l.keepalive_time_ms());
  // A connection with no call is pinged too (a flood needs none), and the
  // daemon's own pings are not held back for want of data sent.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             l.keepalive_timeout_ms());
}

// A socket file nobody serves is left over from a daemon that died: remove
// it. A live one means another deltad is running there.
absl::Status ClaimSocketPath(const std::string& path) {
  if (common::ConnectUnix(path).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("another deltad is serving ", path, "; stop it first"));
  }
  return common::RemoveStaleSocket(path);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(
    const v1::DaemonConfig& config) {
  std::unique_ptr<Server> s(new Server());
  s->socket_path_ = config.socket_path();
  s->side_path_ = common::side::SideSocketPath(config.socket_path());

  auto backend = MakeBackend(config);
  if (!backend.ok()) return backend.status();
  s->backend_ = std::move(*backend);
  auto pool =
      HostPool::Create(config.host_pool_bytes(), config.host_slab_bytes());
  if (!pool.ok()) return pool.status();
  s->pool_ = std::move(*pool);

  std::vector<GpuLabel> labels;
  for (const GpuInfo& g : s->backend_->gpus()) {
    labels.push_back({g.index, g.uuid, g.memory_bytes});
  }
  auto metrics =
      Metrics::Create(labels, DELTAD_VERSION, std::string(s->backend_->name()));
  if (!metrics.ok()) return metrics.status();
  s->metrics_ = std::move(*metrics);
  if (!config.metrics_address().empty()) {
    auto server =
        MetricsServer::Start(config.metrics_address(), s->metrics_->registry());
    if (!server.ok()) return server.status();
    s->metrics_server_ = std::move(*server);
  }

  auto options = NodeOptionsFrom(config);
  if (!options.ok()) return options.status();
  auto node =
      Node::Create(*s->backend_, *s->pool_,
                   std::make_unique<MetricsObserver>(*s->metrics_), *options);
  if (!node.ok()) return node.status();
  s->node_ = std::move(*node);
  LeaseOptions leases;
  leases.lease_ns = int64_t{config.lease().lease_ms()} * 1000000;
  leases.end_after_ns =
      int64_t{config.lease().end_unresponsive_after_ms()} * 1000000;
  s->service_ = std::make_unique<MemoryManagerService>(
      *s->node_, RequestLimitsFrom(config), s->metrics_.get(), leases);

  if (absl::Status claim = ClaimSocketPath(s->socket_path_); !claim.ok()) {
    return claim;
  }
  // gRPC and protobuf log what clients make them log: through a limit.
  RouteLibraryLogs();
  Metrics* refusals = s->metrics_.get();
  // gRPC's own GOAWAYs at a limit: counted, and those of its memory quota
  // logged (a client that pings too often has only itself to blame; an idle
  // connection closed for want of gRPC memory may be any client's).
  auto memory_log =
      std::make_shared<common::LogLimit>(1, std::chrono::seconds(10));
  ObserveGoaways([refusals, memory_log](const char* limit) {
    if (std::string_view(limit) == "max_ping_strikes") {
      refusals->AddRefusal(Refusal::kPingStrikes);
      return;
    }
    refusals->AddRefusal(Refusal::kGrpcMemory);
    int64_t held_back = 0;
    if (memory_log->Allow(&held_back)) {
      std::fprintf(stderr,
                   "deltad: gRPC closed an idle connection with GOAWAY "
                   "\"Buffers full\": its buffers reached "
                   "limits.grpc_memory_bytes (%lld such lines held back "
                   "before this one)\n",
                   static_cast<long long>(held_back));
    }
  });
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // The Unix socket and the TCP port are the daemon's own (GrpcListener),
  // not gRPC's: gRPC listens on nothing.
  // Requests past max_message_bytes reach the daemon, which refuses them
  // naming the limit and counts them (gRPC's own refusal is seen by no hook
  // of its C++ API); gRPC refuses what is past the backstop, counted only
  // as a call that ended unseen (GrpcCallCensus).
  const int64_t max_message = config.limits().max_message_bytes();
  constexpr int64_t kMostGrpcTakes = std::numeric_limits<int>::max();
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min(max_message * kMessageBytesBackstop, kMostGrpcTakes)));
  builder.SetMaxSendMessageSize(
      static_cast<int>(std::min(max_message, kMostGrpcTakes)));
  ApplyConnectionLimits(config.limits(), builder);
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<ThreadRefusals>(
      config.limits().grpc_max_threads(),
      [refusals] { refusals->AddRefusal(Refusal::kGrpcThreads); }));
  s->census_ = std::make_unique<GrpcCallCensus>(
      [refusals](int64_t calls) {
        for (int64_t i = 0; i < calls; ++i) {
          refusals->AddRefusal(Refusal::kGrpcEndedUnseen);
        }
      },
      std::chrono::seconds(1));
  interceptors.push_back(GrpcCallCensus::Counter());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.RegisterService(s->service_.get());
  s->grpc_ = builder.BuildAndStart();
  if (s->grpc_ == nullptr) {
    return absl::UnavailableError("gRPC could not start");
  }
  GrpcListener::Options listen;
  listen.path = s->socket_path_;
  listen.tcp_address = config.tcp_address();
  listen.mode = config.socket_mode();
  listen.max_connections_per_uid =
      static_cast<size_t>(config.limits().max_grpc_connections_per_uid());
  listen.max_calls_before_ack =
      static_cast<size_t>(config.limits().max_concurrent_streams());
  listen.ack_within =
      absl::Milliseconds(int64_t{config.limits().settings_ack_ms()});
  // Sooner than gRPC's keepalive would close such a connection (a ping
  // sent before the bytes piled up, unanswered for keepalive_timeout_ms):
  // then it would be closed uncounted, and the two raced in tests.
  listen.unread_for =
      absl::Milliseconds(int64_t{config.limits().keepalive_time_ms()});
  Metrics* gated = s->metrics_.get();
  listen.refused = [gated](const char* limit) {
    const std::string_view l(limit);
    gated->AddRefusal(
        l == "max_grpc_connections"     ? Refusal::kGrpcConnections
        : l == "unread_connection"      ? Refusal::kUnreadConnection
        : l == "max_concurrent_streams" ? Refusal::kConcurrentStreams
        : l == "settings_ack_ms"        ? Refusal::kSettingsAck
                                        : Refusal::kGrpcConnectionsPerUid);
  };
  auto listener = GrpcListener::Start(s->grpc_.get(), std::move(listen));
  if (!listener.ok()) return listener.status();
  s->listener_ = std::move(*listener);
  s->tcp_port_ = s->listener_->tcp_port();
  MemoryManagerService* service = s->service_.get();
  Metrics* counted = s->metrics_.get();
  auto side = SideChannel::Start(
      s->side_path_, config.socket_mode(), *s->node_,
      [service](const OrdersBySession& orders) { service->Deliver(orders); },
      /*max_connections=*/4096,
      static_cast<size_t>(config.limits().max_side_connections_per_uid()),
      [counted](const char* limit) {
        counted->AddRefusal(std::string_view(limit) == "max_side_connections"
                                ? Refusal::kSideConnections
                                : Refusal::kSideConnectionsPerUid);
      });
  if (!side.ok()) return side.status();
  s->side_ = std::move(*side);
  return s;
}

Server::~Server() { Shutdown(); }

int Server::metrics_port() const {
  return metrics_server_ ? metrics_server_->port() : 0;
}

void Server::Drain() {
  if (node_ != nullptr) node_->KeepSlabContents();
  if (grpc_ != nullptr) {
    grpc_->GetHealthCheckService()->SetServingStatus(false);
  }
  if (service_ != nullptr) service_->Drain();
}

void Server::Shutdown(int grace_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (node_ != nullptr) node_->KeepSlabContents();
  // No new connection from here; those open get the grace.
  if (listener_ != nullptr) listener_->Stop();
  if (grpc_ != nullptr) {
    grpc_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(grace_ms));
    grpc_->Wait();
  }
  // The metrics may go before the process does.
  ObserveGoaways(nullptr);
  if (side_ != nullptr) side_->Stop();
  metrics_server_.reset();
}

}  // namespace deltad::daemon
