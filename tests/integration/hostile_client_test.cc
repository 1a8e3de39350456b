// A hostile local client against the real deltad process, written from the
// proto alone: it sends what no library would (labels of any size or
// encoding, bytes that are no message, batches past every limit, claims
// past the GPU) and tries to wear the daemon down. Each case checks that
// the refusal is a clear status naming the field or limit, that nothing
// else changed, and that an honest session on the same GPU can still
// Release. Attacks on connections are in hostile_connection_test.cc.
#include "tests/integration/hostile_client.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// A string field `number` holding `bytes` on the wire, which protobuf's
// own serializer would refuse to write when they are not UTF-8.
std::string RawStringField(int number, const std::string& bytes) {
  std::string wire;
  wire.push_back(static_cast<char>((number << 3) | 2));
  wire.push_back(static_cast<char>(bytes.size()));  // under 128 here
  return wire + bytes;
}

TEST_F(HostileClientTest, ALabelOverTheLimitIsInvalidArgumentNamingIt) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  v1::OpenSessionRequest request;
  request.set_gpu(0);
  request.set_peer_token((*other)->token());
  request.set_label(std::string(kMaxLabelBytes + 1, 'L'));
  const grpc::Status s = Open(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("OpenSessionRequest.label"));
  EXPECT_THAT(s.error_message(), HasSubstr("limits.max_label_bytes"));
  EXPECT_EQ(Status().sessions_size(), 1) << "a refused request opened one";
  // At the limit, it opens.
  request.set_label(std::string(kMaxLabelBytes, 'L'));
  EXPECT_TRUE(Open(request).ok());
}

TEST_F(HostileClientTest, ALabelThatIsNotUtf8IsInvalidArgumentAndNotLogged) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  v1::OpenSessionRequest base;
  base.set_gpu(0);
  base.set_peer_token((*other)->token());
  const std::string wire =
      base.SerializeAsString() + RawStringField(5, "job \xff\xfe rank 0");
  for (int i = 0; i < 20; ++i) {
    const grpc::Status s =
        RawCall("/deltad.v1.MemoryManager/OpenSession", wire);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("OpenSessionRequest.label"));
    EXPECT_THAT(s.error_message(), HasSubstr("UTF-8"));
  }
  EXPECT_EQ(Status().sessions_size(), 1) << "a refused request opened one";
  EXPECT_THAT(daemon_->Output(), ::testing::Not(HasSubstr("UTF-8")))
      << "each refused request wrote a log line";
}

TEST_F(HostileClientTest, BytesThatAreNoRequestAreInvalidArgument) {
  // A length-delimited field 3 that claims more bytes than follow.
  const std::string garbage("\x1a\x7f\x01\x02", 4);
  for (const char* method : {"/deltad.v1.MemoryManager/OpenSession",
                             "/deltad.v1.MemoryManager/CloseSession",
                             "/deltad.v1.MemoryManager/Release",
                             "/deltad.v1.MemoryManager/ListTensors"}) {
    const grpc::Status s = RawCall(method, garbage);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("not a valid deltad.v1."))
        << method;
  }
}

TEST_F(HostileClientTest, AStreamWhoseFirstMessageDoesNotParseIsInvalid) {
  const grpc::Status garbage = RawStream(std::string("\x12\x7f\x01", 3));
  EXPECT_EQ(garbage.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << Describe(garbage);
  EXPECT_THAT(garbage.error_message(), HasSubstr("deltad.v1.SessionMessage"));
  const grpc::Status not_utf8 = RawStream(RawStringField(1, "\xc0\xaf"));
  EXPECT_EQ(not_utf8.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << Describe(not_utf8);
  EXPECT_THAT(not_utf8.error_message(),
              HasSubstr("SessionMessage.session_token"));
}

TEST_F(HostileClientTest, TooManyRepeatedFieldsAreRefusedAndNothingApplied) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse mine = MustOpen((*other)->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  v1::EventBatch many;
  for (uint64_t id = 1; id <= kMaxBatchEvents + 1; ++id) {
    *many.add_created() = Created({id}).created(0);
  }
  ASSERT_TRUE(stream.Send(many));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("limits.max_batch_events"));
  v1::EventBatch parents = Created({100});
  for (int i = 0; i < 5000; ++i) {
    parents.mutable_created(0)->add_parent_ids(1);
  }
  ASSERT_TRUE(stream.Send(parents));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("parent_ids"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  // The stream and its session carry on.
  ASSERT_TRUE(stream.Send(Created({7})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
}

TEST_F(HostileClientTest, ManySessionsWithLongLabelsLeaveNodeStatusBounded) {
  // Three more processes, each with a session on both GPUs: seven in all.
  std::vector<std::unique_ptr<PeerProcess>> others;
  for (int p = 0; p < 3; ++p) {
    auto other = PeerProcess::Start(daemon_->side_socket_path());
    ASSERT_TRUE(other.ok()) << other.status();
    for (int gpu = 0; gpu < 2; ++gpu) {
      v1::OpenSessionRequest request;
      request.set_gpu(gpu);
      request.set_peer_token((*other)->token());
      request.set_label(std::string(kMaxLabelBytes, 'L'));
      ASSERT_TRUE(Open(request).ok());
    }
    others.push_back(std::move(*other));
  }
  // As deltactl status and sessions ask.
  const v1::NodeStatusResponse status = Status();
  EXPECT_EQ(status.sessions_size(), kMaxStatusSessions);
  EXPECT_EQ(status.sessions_omitted(), 7u - kMaxStatusSessions);
  uint32_t on_gpus = 0;
  for (const v1::GpuStatus& g : status.gpus()) on_gpus += g.sessions();
  EXPECT_EQ(on_gpus, 7u) << "the GPUs count every session";
  EXPECT_LT(status.ByteSizeLong(), size_t{4} << 20);
}

TEST_F(HostileClientTest, AStreamNeverReadIsEndedWithResourceExhausted) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse mine = MustOpen((*other)->token(), 0);
  [[maybe_unused]] const int64_t rss_before = RssBytes(daemon_->pid());
  auto stub = v1::MemoryManager::NewStub(daemon_->NewChannel());
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  auto stream = stub->Session(&context);
  v1::SessionMessage hello;
  hello.set_session_token(mine.session_token());
  ASSERT_TRUE(stream->Write(hello));
  // Each batch is refused (no tensor 999), and each refusal is an order
  // that waits for the process to read it, which it never does.
  v1::SessionMessage refused;
  *refused.mutable_batch() = Event(v1::TensorEvent::ACCESSED, 999);
  constexpr int kMostBatches = 300000;
  int sent = 0;
  while (sent < kMostBatches && stream->Write(refused)) ++sent;
  // gRPC hands a client the status only once it has read what came before.
  v1::Orders unread;
  while (stream->Read(&unread)) {
  }
  const grpc::Status s = stream->Finish();
  EXPECT_LT(sent, kMostBatches) << "the daemon never ended the stream";
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("limits.max_queued_order_bytes"));
  EXPECT_TRUE(WaitForStatus([&](const v1::NodeStatusResponse& r) {
    return r.sessions_size() == 1;  // the honest one
  })) << "the unread session was not closed";
#ifndef __SANITIZE_ADDRESS__
  // Under AddressSanitizer (the asan preset builds the daemon too) freed
  // memory waits in its quarantine, so resident memory says nothing of
  // what the daemon holds.
  EXPECT_LT(RssBytes(daemon_->pid()) - rss_before, kFloodRssBound);
#endif
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, HasSubstr("deltad_refused_total{limit=\"max_queued_"
                                 "order_bytes\"} 1"));
}

// The attack of issue #17: processes report pinned tensors they never
// allocated. One session may claim no more than the GPU's whole budget;
// two such sessions claim twice the GPU, and the honest session, within its
// share, still gets its Release and keeps its tensor.
TEST_F(HostileClientTest, ClaimsBeyondTheGpuNeverFailAnHonestRelease) {
  const int64_t budget = Status().gpus(0).budget_bytes();
  std::vector<std::unique_ptr<PeerProcess>> others;
  std::vector<std::unique_ptr<SessionStream>> streams;
  for (int i = 0; i < 2; ++i) {
    auto other = PeerProcess::Start(daemon_->side_socket_path());
    ASSERT_TRUE(other.ok()) << other.status();
    others.push_back(std::move(*other));
    const v1::OpenSessionResponse mine = MustOpen(others.back()->token(), 0);
    streams.push_back(
        std::make_unique<SessionStream>(*stub_, mine.session_token()));
    v1::EventBatch claim = Created({1}, budget);
    claim.mutable_created(0)->mutable_flags()->set_evict_pinned(true);
    claim.mutable_created(0)->mutable_flags()->set_offload_pinned(true);
    ASSERT_TRUE(streams.back()->Send(claim));
    ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
    // A byte more than the GPU is refused whole.
    ASSERT_TRUE(streams.back()->Send(Created({2}, 1)));
    const std::string refused = streams.back()->NextRejection();
    EXPECT_THAT(refused, HasSubstr(absl::StrCat("session ", mine.session_id(),
                                                " would hold ", budget + 1)));
    EXPECT_THAT(refused, HasSubstr("EventBatch.created"));
    EXPECT_THAT(refused, HasSubstr(absl::StrCat("whole budget of ", budget)));
    EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 1u);
  }
  ExpectHonestSessionUnaffected();
}

}  // namespace
}  // namespace deltad::testing_util
