#ifndef DELTAD_DAEMON_SERVER_H_
#define DELTAD_DAEMON_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/backend/device_backend.h"
#include "daemon/grpc_call_census.h"
#include "daemon/grpc_listener.h"
#include "daemon/host_pool.h"
#include "daemon/memory_manager_service.h"
#include "daemon/metrics.h"
#include "daemon/node.h"
#include "daemon/side_channel.h"
#include "deltad/v1/daemon_config.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::daemon {

// The backend a configuration asks for: "sim" builds the simulated GPUs;
// "auto" picks cuda when this build has CUDA and a driver and a GPU are
// present, else sim (saying why in one line on stderr); "cuda" without
// them is FAILED_PRECONDITION with the reason.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeBackend(
    const v1::DaemonConfig& config);

// What the configuration says the Node's options are.
absl::StatusOr<NodeOptions> NodeOptionsFrom(const v1::DaemonConfig& config);

// The whole daemon, assembled from a configuration: backend, host pool,
// metrics and their HTTP server, the Node, the gRPC server (Unix socket,
// optional TCP, health, reflection) and the side socket. main.cc adds only
// flags, signals and systemd. Thread safe.
class Server {
 public:
  // `config` must have its defaults filled in (WithDefaults) and be valid
  // (ValidateConfig). Refuses to take over a socket another daemon serves.
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const v1::DaemonConfig& config);

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server();  // Shutdown()

  // No new sessions; every stream is told to carry on without the daemon;
  // health turns NOT_SERVING.
  void Drain();
  // Stops the gRPC server (calls in flight get `grace_ms`), the side
  // socket and the metrics server. Idempotent.
  void Shutdown(int grace_ms = 2000);

  const std::string& socket_path() const { return socket_path_; }
  const std::string& side_socket_path() const { return side_path_; }
  int tcp_port() const { return tcp_port_; }
  int metrics_port() const;
  absl::string_view backend_name() const { return backend_->name(); }
  const std::vector<GpuInfo>& gpus() const { return backend_->gpus(); }
  Node& node() { return *node_; }

 private:
  Server() = default;

  std::string socket_path_;
  std::string side_path_;
  int tcp_port_ = 0;
  // Destroyed in reverse: the servers go before what they call into.
  std::unique_ptr<DeviceBackend> backend_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<Node> node_;
  std::unique_ptr<MemoryManagerService> service_;
  std::unique_ptr<GrpcCallCensus> census_;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<GrpcListener> listener_;  // goes before grpc_
  std::unique_ptr<SideChannel> side_;
  std::mutex mu_;
  bool shut_down_ = false;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SERVER_H_
