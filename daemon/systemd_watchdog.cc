#include "daemon/systemd_watchdog.h"

#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {

std::unique_ptr<SystemdWatchdog> SystemdWatchdog::StartIfEnabled(
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
  return std::unique_ptr<SystemdWatchdog>(
      new SystemdWatchdog(socket_path, std::chrono::microseconds(usec)));
}

SystemdWatchdog::~SystemdWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

SystemdWatchdog::SystemdWatchdog(const std::string& socket_path,
                                 std::chrono::microseconds timeout)
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

grpc::Status SystemdWatchdog::Check() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline_);
  context.set_wait_for_ready(true);
  v1::NodeStatusRequest request;
  v1::NodeStatusResponse response;
  return stub_->NodeStatus(&context, request, &response);
}

void SystemdWatchdog::Run() {
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

}  // namespace deltad::daemon
