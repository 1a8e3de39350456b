// deltad: the node daemon. Reads its configuration (file, then flags),
// starts the server, reports readiness to systemd (and pets its watchdog
// while the daemon serves), and drains on SIGTERM or SIGINT: no new
// sessions, clients told to carry on by themselves, then a clean exit.
#include <signal.h>
#include <systemd/sd-daemon.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fd_limit.h"
#include "daemon/config.h"
#include "daemon/server.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, config, "/etc/deltad/deltad.conf",
          "configuration file (protobuf text format, see "
          "proto/deltad/v1/daemon_config.proto); a missing file at the "
          "default path means all defaults");
ABSL_FLAG(std::string, socket, "", "gRPC Unix socket path (socket_path)");
ABSL_FLAG(std::string, tcp, "", "also serve gRPC on host:port (tcp_address)");
ABSL_FLAG(std::string, metrics, "",
          "Prometheus metrics host:port (metrics_address)");
ABSL_FLAG(std::string, backend, "", "auto, cuda or sim (backend)");
ABSL_FLAG(int, sim_gpus, 0, "simulated GPUs (sim.gpus)");
ABSL_FLAG(std::string, sim_memory, "",
          "memory per simulated GPU, e.g. 80GiB (sim.memory_bytes)");
ABSL_FLAG(std::string, host_pool, "",
          "pinned host pool size, e.g. 64GiB (host_pool_bytes)");
ABSL_FLAG(std::string, host_slab, "",
          "host pool slab size, e.g. 256MiB (host_slab_bytes)");
ABSL_FLAG(std::string, heuristic, "", "filter heuristic (heuristic)");
ABSL_FLAG(int, drain_seconds, 10,
          "on SIGTERM, how long to wait for sessions to end before exiting");
ABSL_FLAG(bool, print_config, false,
          "print the effective configuration and exit");

namespace {

using deltad::daemon::Server;
namespace v1 = deltad::v1;

// "123", "64KiB", "256MiB", "80GiB", "1TiB".
bool ParseBytes(const std::string& text, int64_t* out) {
  static constexpr struct {
    const char* suffix;
    int shift;
  } kUnits[] = {{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}};
  for (const auto& u : kUnits) {
    const std::string suffix = u.suffix;
    if (text.size() > suffix.size() &&
        text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0) {
      int64_t n;
      if (!absl::SimpleAtoi(text.substr(0, text.size() - suffix.size()), &n) ||
          n < 0 || n > (int64_t{1} << (62 - u.shift))) {
        return false;
      }
      *out = n << u.shift;
      return true;
    }
  }
  return absl::SimpleAtoi(text, out) && *out >= 0;
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "deltad: %s\n", message.c_str());
  return 1;
}

// Flags override the file; a flag left at its default leaves the field.
bool ApplyFlags(v1::DaemonConfig& c, std::string* error) {
  if (!absl::GetFlag(FLAGS_socket).empty()) {
    c.set_socket_path(absl::GetFlag(FLAGS_socket));
  }
  if (!absl::GetFlag(FLAGS_tcp).empty()) {
    c.set_tcp_address(absl::GetFlag(FLAGS_tcp));
  }
  if (!absl::GetFlag(FLAGS_metrics).empty()) {
    c.set_metrics_address(absl::GetFlag(FLAGS_metrics));
  }
  if (!absl::GetFlag(FLAGS_backend).empty()) {
    c.set_backend(absl::GetFlag(FLAGS_backend));
  }
  if (absl::GetFlag(FLAGS_sim_gpus) != 0) {
    c.mutable_sim()->set_gpus(absl::GetFlag(FLAGS_sim_gpus));
  }
  if (!absl::GetFlag(FLAGS_heuristic).empty()) {
    c.set_heuristic(absl::GetFlag(FLAGS_heuristic));
  }
  const struct {
    const char* flag;
    std::string value;
    void (*set)(v1::DaemonConfig&, int64_t);
  } sizes[] = {
      {"--sim_memory", absl::GetFlag(FLAGS_sim_memory),
       [](v1::DaemonConfig& d, int64_t v) {
         d.mutable_sim()->set_memory_bytes(v);
       }},
      {"--host_pool", absl::GetFlag(FLAGS_host_pool),
       [](v1::DaemonConfig& d, int64_t v) { d.set_host_pool_bytes(v); }},
      {"--host_slab", absl::GetFlag(FLAGS_host_slab),
       [](v1::DaemonConfig& d, int64_t v) { d.set_host_slab_bytes(v); }},
  };
  for (const auto& s : sizes) {
    if (s.value.empty()) continue;
    int64_t bytes;
    if (!ParseBytes(s.value, &bytes)) {
      *error = absl::StrCat(s.flag, "=", s.value,
                            " is not a size (bytes, or e.g. 256MiB, 80GiB)");
      return false;
    }
    s.set(c, bytes);
  }
  return true;
}

std::string GiB(int64_t bytes) {
  return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1 << 30));
}

// systemd's watchdog (WatchdogSec= in deltad.service). Every half of its
// timeout a NodeStatus call over the daemon's own Unix socket, answered
// within a quarter of it, earns one WATCHDOG=1. The call goes through the
// gRPC server's threads and takes the registry's, every GPU's and the host
// pool's locks, so a daemon wedged in any of them stops petting and systemd
// kills and restarts it.
class Watchdog {
 public:
  // Starts the thread when systemd asked this process for a watchdog
  // (WATCHDOG_USEC, and WATCHDOG_PID naming this process when it is set);
  // nullptr otherwise.
  static std::unique_ptr<Watchdog> StartIfEnabled(
      const std::string& socket_path) {
    uint64_t usec = 0;
    const int enabled = sd_watchdog_enabled(0, &usec);
    if (enabled < 0) {
      std::fprintf(stderr, "deltad: ignoring the watchdog settings: %s\n",
                   std::strerror(-enabled));
      return nullptr;
    }
    if (enabled == 0 || usec == 0) return nullptr;
    // The constructor is private, hence no make_unique.
    return std::unique_ptr<Watchdog>(
        new Watchdog(socket_path, std::chrono::microseconds(usec)));
  }

  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

 private:
  Watchdog(const std::string& socket_path, std::chrono::microseconds timeout)
      : period_(timeout / 2), deadline_(timeout / 4) {
    grpc::ChannelArguments args;
    // A connection of its own, which comes back quickly after a failure:
    // one failed check must not make the next ones fail by backing off.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    stub_ = v1::MemoryManager::NewStub(grpc::CreateCustomChannel(
        "unix:" + socket_path, grpc::InsecureChannelCredentials(), args));
    std::fprintf(stderr,
                 "deltad: systemd watchdog: a NodeStatus check every %.1f s\n",
                 std::chrono::duration<double>(period_).count());
    thread_ = std::thread([this] { Run(); });
  }

  grpc::Status Check() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline_);
    context.set_wait_for_ready(true);
    v1::NodeStatusRequest request;
    v1::NodeStatusResponse response;
    return stub_->NodeStatus(&context, request, &response);
  }

  void Run() {
    bool healthy = true;
    auto next = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      const grpc::Status status = Check();
      if (status.ok()) {
        sd_notify(0, "WATCHDOG=1");
        if (!healthy) {
          std::fprintf(stderr, "deltad: watchdog: serving again\n");
          sd_notify(0, "STATUS=serving");
        }
      } else if (healthy) {
        // Said once per failing spell; systemd acts on the missing pets.
        const std::string why =
            absl::StrCat("NodeStatus on its own socket failed (",
                         static_cast<int>(status.error_code()), ": ",
                         status.error_message(), ")");
        std::fprintf(stderr, "deltad: watchdog: %s; not petting systemd\n",
                     why.c_str());
        sd_notify(0, absl::StrCat("STATUS=unhealthy: ", why).c_str());
      }
      healthy = status.ok();
      lock.lock();
      next = std::max(next + period_, std::chrono::steady_clock::now());
      wake_.wait_until(lock, next, [this] { return stop_; });
    }
  }

  const std::chrono::microseconds period_;
  const std::chrono::microseconds deadline_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "deltad: the node's GPU memory manager.\n"
      "  deltad [--config=FILE] [--socket=PATH] [--backend=sim] ...\n"
      "Flags override the configuration file.");
  absl::ParseCommandLine(argc, argv);

  v1::DaemonConfig config;
  const std::string path = absl::GetFlag(FLAGS_config);
  auto loaded = deltad::daemon::LoadConfigFile(path);
  if (loaded.ok()) {
    config = std::move(*loaded);
  } else if (!(loaded.status().code() == absl::StatusCode::kNotFound &&
               path == "/etc/deltad/deltad.conf")) {
    return Fail(std::string(loaded.status().message()));
  }
  std::string error;
  if (!ApplyFlags(config, &error)) return Fail(error);
  config = deltad::daemon::WithDefaults(config);
  if (absl::Status valid = deltad::daemon::ValidateConfig(config);
      !valid.ok()) {
    return Fail(std::string(valid.message()));
  }
  if (absl::GetFlag(FLAGS_print_config)) {
    std::string text;
    google::protobuf::TextFormat::PrintToString(config, &text);
    std::fputs(text.c_str(), stdout);
    return 0;
  }

  // Every thread the server starts inherits this mask, so the signals
  // reach only the sigwait below.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  signal(SIGPIPE, SIG_IGN);
  if (absl::Status s = deltad::common::RaiseDescriptorLimit(); !s.ok()) {
    std::fprintf(stderr, "deltad: %s\n", std::string(s.message()).c_str());
  }

  auto server = Server::Start(config);
  if (!server.ok()) return Fail(server.status().ToString());
  Server& s = **server;
  // With port 0 in the configuration, the port the kernel chose.
  std::string tcp;
  if (!config.tcp_address().empty()) {
    const std::string& a = config.tcp_address();
    tcp = absl::StrCat(" and ", a.substr(0, a.rfind(':')), ":", s.tcp_port());
  }
  std::fprintf(stderr,
               "deltad %s: %s backend, %zu GPUs x %s (%.0f%% as budgets)\n"
               "deltad: gRPC on unix:%s%s, side socket %s\n"
               "deltad: metrics on http://%s/metrics (port %d)\n",
               DELTAD_VERSION, std::string(s.backend_name()).c_str(),
               s.gpus().size(),
               GiB(s.gpus().empty() ? 0 : s.gpus()[0].memory_bytes).c_str(),
               100 * config.gpu_share(), s.socket_path().c_str(), tcp.c_str(),
               s.side_socket_path().c_str(), config.metrics_address().c_str(),
               s.metrics_port());
  sd_notify(0, "READY=1\nSTATUS=serving");
  // Started after READY=1: systemd's watchdog runs from then on.
  std::unique_ptr<Watchdog> watchdog =
      Watchdog::StartIfEnabled(s.socket_path());

  int signal_number = 0;
  sigwait(&stop, &signal_number);
  std::fprintf(stderr, "deltad: %s, draining\n",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1\nSTATUS=draining");
  // systemd stops watching once it is told STOPPING=1; draining can take
  // longer than the watchdog's timeout anyway.
  watchdog.reset();
  s.Drain();
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::seconds(absl::GetFlag(FLAGS_drain_seconds));
  // The registry's count, not a full status report: the sessions still
  // draining need the GPU locks that a report would take.
  while (std::chrono::steady_clock::now() < deadline &&
         s.node().registry().sessions() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const size_t left = s.node().registry().sessions();
  s.Shutdown();
  std::fprintf(stderr, "deltad: stopped (%zu sessions still open at exit)\n",
               left);
  return 0;
}
