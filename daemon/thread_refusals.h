#ifndef DELTAD_DAEMON_THREAD_REFUSALS_H_
#define DELTAD_DAEMON_THREAD_REFUSALS_H_

#include <chrono>
#include <functional>

#include "common/log_limit.h"
#include "grpcpp/support/server_interceptor.h"

namespace deltad::daemon {

// gRPC's synchronous server answers a unary call for which no thread is
// free (past limits.grpc_max_threads) by itself, RESOURCE_EXHAUSTED "Server
// Threadpool Exhausted", and tells the application nothing. That answer
// still passes the server's interceptors: this one sees it go out, counts
// it (`refused`, e.g. deltad_refused_total{limit="grpc_max_threads"}) and
// says so in the log, at most a line per 10 s. The Session stream, which
// holds no thread, is not intercepted.
class ThreadRefusals final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  ThreadRefusals(int max_threads, std::function<void()> refused);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  class Watch;

  // The status is gRPC's refusal for want of a thread.
  static bool IsThreadRefusal(const grpc::Status& status);

  void Refused();

  const int max_threads_;
  const std::function<void()> refused_;
  common::LogLimit log_{1, std::chrono::seconds(10)};
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_THREAD_REFUSALS_H_
