// deltad: the node daemon. Reads its configuration (file, then flags),
// starts the server, reports readiness to systemd (and pets its watchdog
// while the daemon serves), and drains on SIGTERM or SIGINT: no new
// sessions, clients told to carry on by themselves, then a clean exit.
#include <signal.h>
#include <systemd/sd-daemon.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
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
#include "daemon/heap_return.h"
#include "daemon/server.h"
#include "daemon/systemd_watchdog.h"
#include "google/protobuf/text_format.h"

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

// jemalloc, where it is the daemon's malloc, reads this when it starts: a
// background thread gives freed pages back after a second (decayed ones at
// once), so the RSS follows what the daemon holds instead of its busiest
// minute (docs/RELIABILITY.md). One such thread, not jemalloc's default of
// up to one per CPU: the daemon runs on every node, however many cores it
// has, and purging is a few calls a second. MALLOC_CONF in the environment
// still wins. Unused under glibc.
extern "C" {
const char* malloc_conf =
    "background_thread:true,max_background_threads:1,dirty_decay_ms:1000,"
    "muzzy_decay_ms:0";
}

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

  // Before the server's threads start, each of which could claim an arena
  // (limits.malloc_arenas, by default glibc's choice).
  (void)deltad::daemon::LimitHeapArenas(config.limits().malloc_arenas());

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
               "deltad: metrics on http://%s/metrics (port %d); heap: %s\n",
               DELTAD_VERSION, std::string(s.backend_name()).c_str(),
               s.gpus().size(),
               GiB(s.gpus().empty() ? 0 : s.gpus()[0].memory_bytes).c_str(),
               100 * config.gpu_share(), s.socket_path().c_str(), tcp.c_str(),
               s.side_socket_path().c_str(), config.metrics_address().c_str(),
               s.metrics_port(), deltad::daemon::HeapAllocatorName().c_str());
  sd_notify(0, "READY=1\nSTATUS=serving");
  // Started after READY=1: systemd's watchdog runs from then on.
  std::unique_ptr<deltad::daemon::SystemdWatchdog> watchdog =
      deltad::daemon::SystemdWatchdog::StartIfEnabled(s.socket_path());

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
