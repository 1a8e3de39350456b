#ifndef DELTAD_DAEMON_SYSTEMD_WATCHDOG_H_
#define DELTAD_DAEMON_SYSTEMD_WATCHDOG_H_

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::daemon {

// systemd's watchdog (WatchdogSec= in deltad.service). Every half of its
// timeout a NodeStatus call over the daemon's own Unix socket, answered
// within a quarter of it, earns one WATCHDOG=1. The call goes through the
// gRPC server's threads and takes the registry's, every GPU's and the host
// pool's locks, so a daemon wedged in any of them stops petting and systemd
// kills and restarts it.
class SystemdWatchdog {
 public:
  // Starts the thread when systemd asked this process for a watchdog
  // (WATCHDOG_USEC, and WATCHDOG_PID naming this process when it is set);
  // nullptr otherwise.
  static std::unique_ptr<SystemdWatchdog> StartIfEnabled(
      const std::string& socket_path);

  SystemdWatchdog(const SystemdWatchdog&) = delete;
  SystemdWatchdog& operator=(const SystemdWatchdog&) = delete;
  ~SystemdWatchdog();  // stops and joins the thread

 private:
  SystemdWatchdog(const std::string& socket_path,
                  std::chrono::microseconds timeout);
  grpc::Status Check();
  void Run();

  const std::chrono::microseconds period_;
  const std::chrono::microseconds deadline_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SYSTEMD_WATCHDOG_H_
