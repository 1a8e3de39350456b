#include "daemon/thread_refusals.h"

#include <cstdint>
#include <cstdio>
#include <utility>

namespace deltad::daemon {

namespace {

// gRPC's own message for the refusal (src/cpp/server/server_cc.cc); a
// gRPC that words it otherwise fails GrpcThreadsTest (tests/integration/
// hostile_connection_test.cc), not silently.
constexpr char kThreadpoolExhausted[] = "Server Threadpool Exhausted";

}  // namespace

class ThreadRefusals::Watch final : public grpc::experimental::Interceptor {
 public:
  explicit Watch(ThreadRefusals& owner) : owner_(owner) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS) &&
        IsThreadRefusal(methods->GetSendStatus())) {
      owner_.Refused();
    }
    methods->Proceed();
  }

 private:
  ThreadRefusals& owner_;
};

ThreadRefusals::ThreadRefusals(int max_threads, std::function<void()> refused)
    : max_threads_(max_threads), refused_(std::move(refused)) {}

grpc::experimental::Interceptor* ThreadRefusals::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY) {
    return nullptr;
  }
  return new Watch(*this);
}

bool ThreadRefusals::IsThreadRefusal(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         status.error_message() == kThreadpoolExhausted;
}

void ThreadRefusals::Refused() {
  if (refused_) refused_();
  int64_t held_back = 0;
  if (log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: gRPC refused a call: no thread free "
                 "(limits.grpc_max_threads = %d; %lld such lines held back "
                 "before this one)\n",
                 max_threads_, static_cast<long long>(held_back));
  }
}

}  // namespace deltad::daemon
