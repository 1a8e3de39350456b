#include "daemon/grpc_call_census.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int kMaxReceiveBytes = 1024;

// Answers NodeStatus; the other methods answer UNIMPLEMENTED, as the base
// does: a call that reaches them is seen all the same.
class StatusOnly final : public v1::MemoryManager::Service {
  grpc::Status NodeStatus(grpc::ServerContext* /*context*/,
                          const v1::NodeStatusRequest* /*request*/,
                          v1::NodeStatusResponse* /*response*/) override {
    return grpc::Status::OK;
  }
};

// A server whose calls the census counts, taking messages up to
// kMaxReceiveBytes.
class CensusServer {
 public:
  CensusServer() {
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(kMaxReceiveBytes);
    std::vector<
        std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(GrpcCallCensus::Counter());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::MemoryManager::NewStub(
        server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~CensusServer() { server_->Shutdown(); }

  grpc::Status Status() {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::NodeStatusResponse response;
    return stub_->NodeStatus(&context, v1::NodeStatusRequest(), &response);
  }

  // An OpenSession whose label is `label_bytes` long.
  grpc::Status Open(size_t label_bytes) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::OpenSessionRequest request;
    request.set_label(std::string(label_bytes, 'L'));
    v1::OpenSessionResponse response;
    return stub_->OpenSession(&context, request, &response);
  }

 private:
  static std::chrono::system_clock::time_point Deadline() {
    return std::chrono::system_clock::now() + std::chrono::seconds(10);
  }

  StatusOnly service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
};

TEST(GrpcCallCensus, CallsGrpcEndsBeforeTheServicesSeeThemAreCounted) {
  int64_t counted = 0;
  GrpcCallCensus census([&counted](int64_t calls) { counted += calls; },
                        std::chrono::milliseconds(0));
  CensusServer server;
  const int64_t seen_before = GrpcCallCensus::seen();
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(server.Status().ok());
  EXPECT_EQ(GrpcCallCensus::seen() - seen_before, 10);
  for (size_t i = 0; i < GrpcCallCensus::kWindow; ++i) census.Sample();
  EXPECT_EQ(counted, 0) << "calls the service answered";

  // Past the server's limit gRPC answers the call itself: no service or
  // interceptor sees it.
  const grpc::Status refused = server.Open(4 * kMaxReceiveBytes);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(GrpcCallCensus::seen() - seen_before, 10);
  // Counted once every sample of the window has it.
  for (size_t i = 0; i + 1 < GrpcCallCensus::kWindow; ++i) census.Sample();
  EXPECT_EQ(counted, 0);
  census.Sample();
  EXPECT_EQ(counted, 1);
  EXPECT_EQ(census.ended_unseen(), 1);
  // Counted once only, and answered calls still not at all.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(server.Status().ok());
  for (size_t i = 0; i < GrpcCallCensus::kWindow; ++i) census.Sample();
  EXPECT_EQ(counted, 1);
}

TEST(GrpcCallCensus, ChannelzCountsTheCallsOfTheProcesssServers) {
  CensusServer server;
  absl::StatusOr<int64_t> before = GrpcCallCensus::CallsStarted();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE(server.Status().ok());
  ASSERT_TRUE(server.Status().ok());
  absl::StatusOr<int64_t> after = GrpcCallCensus::CallsStarted();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after - *before, 2);
}

}  // namespace
}  // namespace deltad::daemon
