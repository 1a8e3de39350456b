#ifndef DELTAD_DAEMON_GRPC_CALL_CENSUS_H_
#define DELTAD_DAEMON_GRPC_CALL_CENSUS_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "common/log_limit.h"
#include "grpcpp/support/server_interceptor.h"

namespace deltad::daemon {

// gRPC ends some calls itself before any of the daemon's code sees them: a
// message past its own limit (4 times limits.max_message_bytes), work its
// memory quota (limits.grpc_memory_bytes) will not take, a call its client
// cancelled before its message came. No hook of gRPC's C++ API reports
// them. But gRPC's channelz counts every call its server starts, and every
// call that reaches the daemon passes the interceptor factory below: calls
// started less calls seen is those ended unseen, plus those between the
// two at that instant (microseconds; a unary call whose message is still
// arriving). Sampled every `period`, the smallest difference over the last
// kWindow samples is what has certainly ended unseen; what it adds is
// passed to `ended_unseen` (a metric) and logged, a line per 10 s at most.
// A call past gRPC's limits is thus counted within kWindow periods.
//
// channelz counts the calls of every server of the process, so the calls
// seen are counted for the process too: every server must take a
// Counter() (two daemons in one process, as tests run them, then each
// count the calls both ended unseen).
class GrpcCallCensus {
 public:
  static constexpr size_t kWindow = 5;

  // Starts sampling on a thread of its own (period > 0), or not at all
  // (period 0: tests call Sample).
  GrpcCallCensus(std::function<void(int64_t)> ended_unseen,
                 std::chrono::milliseconds period);
  ~GrpcCallCensus();
  GrpcCallCensus(const GrpcCallCensus&) = delete;
  GrpcCallCensus& operator=(const GrpcCallCensus&) = delete;

  // For grpc::ServerBuilder: counts each call that reaches the services.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  Counter();

  // One sample: reads the calls seen, then channelz's calls started.
  void Sample();
  // Calls counted as ended unseen so far.
  int64_t ended_unseen() const { return counted_.load(); }
  // Calls that reached the services of this process's servers.
  static int64_t seen();

  // The calls every gRPC server of this process has started (channelz).
  static absl::StatusOr<int64_t> CallsStarted();

 private:
  class Factory;

  void Loop(std::chrono::milliseconds period);

  const std::function<void(int64_t)> ended_unseen_;
  std::atomic<int64_t> counted_{0};
  std::deque<int64_t> recent_;  // started - seen, the last kWindow samples
  common::LogLimit log_{1, std::chrono::seconds(10)};
  bool said_unreadable_ = false;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_GRPC_CALL_CENSUS_H_
