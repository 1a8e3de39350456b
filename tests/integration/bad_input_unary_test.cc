// Bad input on the unary calls (OpenSession, CloseSession, Release):
// unknown and forged tokens, bad GPU indexes, negative, absurd and
// oversized sizes, each refused with its own status.
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// --- Unary calls ------------------------------------------------------------

TEST_F(BadInputTest, UnknownSessionTokenIsUnauthenticatedEverywhere) {
  for (const std::string& token :
       {std::string(), std::string("not-a-token"), std::string(32, '0'),
        std::string(4000, 'x')}) {
    SCOPED_TRACE(absl::StrCat("token of ", token.size(), " bytes"));
    grpc::Status s = Close(token);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("session token"));

    v1::ReleaseRequest release;
    release.set_session_token(token);
    release.set_bytes(kMiB);
    s = Release(release);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("session token"));

    SessionStream stream(*stub_, token);
    s = stream.FinishWithoutWritesDone();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("session token"));
    ExpectServing("an unknown session token");
  }
}

TEST_F(BadInputTest,
       ReleaseWithUnknownTokenIsUnauthenticatedAndAppliesNothing) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  v1::ReleaseRequest release;
  release.set_session_token(mine.session_token() + "0");
  release.set_bytes(kMiB);
  *release.mutable_batch() = Created({1, 2});
  v1::ReleaseResponse response;
  const grpc::Status s = Release(release, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown or closed session token"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  ExpectServing("Release with an unknown token");
}

TEST_F(BadInputTest, OpenSessionWithoutPeerTokenIsUnauthenticated) {
  const grpc::Status s = Open("", 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("peer token"));
  EXPECT_EQ(Status().sessions_size(), 0);
  ExpectServing("OpenSession without a peer token");
}

TEST_F(BadInputTest, OpenSessionWithBogusPeerTokenIsUnauthenticated) {
  std::string near_miss = peer_->token();
  near_miss.back() = near_miss.back() == '0' ? '1' : '0';
  for (const std::string& token :
       {std::string("forged"), near_miss, peer_->token() + "00",
        std::string(peer_->token().size(), '\0'), std::string(10000, 'a')}) {
    SCOPED_TRACE(absl::StrCat("token of ", token.size(), " bytes"));
    const grpc::Status s = Open(token, 0);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("peer token"));
    ExpectServing("OpenSession with a bogus peer token");
  }
  EXPECT_EQ(Status().sessions_size(), 0);
  // The real token still works.
  MustOpen(peer_->token(), 0);
}

TEST_F(BadInputTest, SecondSessionOnOneGpuFromOneProcessIsAlreadyExists) {
  const v1::OpenSessionResponse first = MustOpen(peer_->token(), 0);
  grpc::Status s = Open(peer_->token(), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("already has session ", first.session_id(),
                                     " on GPU 0")));
  // A second side connection of the same process is the same process.
  auto again = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(again.ok()) << again.status();
  s = Open(again->token(), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  ExpectServing("a second session on one GPU");
  // Another GPU is fine, and the first session is untouched.
  MustOpen(peer_->token(), 1);
  EXPECT_EQ(Status().sessions_size(), 2);
  EXPECT_EQ(SessionOf(first.session_id()).gpu(), 0);
}

TEST_F(BadInputTest, BadGpuIndexIsInvalidArgument) {
  for (int gpu : {-1, 2, 64, std::numeric_limits<int32_t>::max(),
                  std::numeric_limits<int32_t>::min()}) {
    SCOPED_TRACE(absl::StrCat("gpu ", gpu));
    const grpc::Status s = Open(peer_->token(), gpu);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << Describe(s);
    EXPECT_THAT(s.error_message(),
                HasSubstr(absl::StrCat("no GPU ", gpu, ": this node has 2")));
    ExpectServing("a bad GPU index");
  }
  EXPECT_EQ(Status().sessions_size(), 0);
}

TEST_F(BadInputTest, NegativeRequestedSizesAreInvalidArgument) {
  for (int64_t bad :
       {int64_t{-1}, -kGiB, std::numeric_limits<int64_t>::min()}) {
    for (bool host : {false, true}) {
      SCOPED_TRACE(absl::StrCat(host ? "host " : "budget ", bad));
      v1::OpenSessionRequest request;
      request.set_gpu(0);
      request.set_peer_token(peer_->token());
      if (host) {
        request.set_requested_host_bytes(bad);
      } else {
        request.set_requested_budget_bytes(bad);
      }
      const grpc::Status s = Open(request);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << Describe(s);
      EXPECT_THAT(s.error_message(), HasSubstr("must not be negative"));
      ExpectServing("a negative requested size");
    }
  }
  const v1::NodeStatusResponse status = Status();
  EXPECT_EQ(status.sessions_size(), 0);
  EXPECT_EQ(status.host_pool_granted_bytes(), 0);
}

TEST_F(BadInputTest, PriorityAbove100IsInvalidArgument) {
  for (uint32_t priority :
       {101u, 1000u, std::numeric_limits<uint32_t>::max()}) {
    SCOPED_TRACE(absl::StrCat("priority ", priority));
    v1::OpenSessionRequest request;
    request.set_gpu(0);
    request.set_peer_token(peer_->token());
    request.set_priority(priority);
    const grpc::Status s = Open(request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << Describe(s);
    EXPECT_THAT(s.error_message(),
                HasSubstr(absl::StrCat("priority must be at most 100, got ",
                                       priority)));
    ExpectServing("a priority above 100");
  }
  EXPECT_EQ(Status().sessions_size(), 0);
  v1::OpenSessionRequest request;
  request.set_gpu(0);
  request.set_peer_token(peer_->token());
  request.set_priority(100);
  const grpc::Status s = Open(request);
  EXPECT_TRUE(s.ok()) << "priority 100 is allowed: " << Describe(s);
}

TEST_F(BadInputTest, AbsurdRequestedSizesAreCappedNotOverflowed) {
  // Larger than anything the node has: granted what there is (or refused
  // with a code), never an overflowed grant, never a crash.
  v1::OpenSessionRequest request;
  request.set_gpu(0);
  request.set_peer_token(peer_->token());
  request.set_requested_budget_bytes(std::numeric_limits<int64_t>::max());
  request.set_requested_host_bytes(std::numeric_limits<int64_t>::max());
  v1::OpenSessionResponse response;
  const grpc::Status s = Open(request, &response);
  ExpectServing("absurd requested sizes");
  if (s.ok()) {
    const v1::NodeStatusResponse status = Status();
    EXPECT_GT(response.granted_budget_bytes(), 0);
    EXPECT_LE(response.granted_budget_bytes(), status.gpus(0).budget_bytes());
    EXPECT_GE(response.host_quota_bytes(), 0);
    EXPECT_LE(response.host_quota_bytes(), status.host_pool_bytes());
  } else {
    EXPECT_THAT(s.error_code(), AnyOf(grpc::StatusCode::INVALID_ARGUMENT,
                                      grpc::StatusCode::RESOURCE_EXHAUSTED))
        << Describe(s);
  }
  // And a second process asking for everything too.
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  request.set_peer_token((*other)->token());
  const grpc::Status second = Open(request, &response);
  ExpectServing("a second session with absurd requested sizes");
  if (second.ok()) {
    EXPECT_GT(response.granted_budget_bytes(), 0);
    EXPECT_LE(response.granted_budget_bytes(), Status().gpus(0).budget_bytes());
  }
}

TEST_F(BadInputTest, ReleaseWithBadSizesIsRefusedAndAppliesNothing) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  v1::ReleaseRequest release;
  release.set_session_token(mine.session_token());
  *release.mutable_batch() = Created({1});
  for (int64_t bytes :
       {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    SCOPED_TRACE(absl::StrCat("bytes ", bytes));
    release.set_bytes(bytes);
    const grpc::Status s = Release(release);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("must be positive"));
    ExpectServing("Release of a non-positive size");
  }
  for (int64_t bytes : {9 * kGiB, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(absl::StrCat("bytes ", bytes));
    release.set_bytes(bytes);
    const grpc::Status s = Release(release);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr("whole budget"));
    ExpectServing("Release of more than the GPU");
  }
  // A bad batch in an otherwise fine Release refuses the whole call.
  release.set_bytes(kMiB);
  *release.mutable_batch() = Created({1}, /*bytes=*/-5);
  const grpc::Status s = Release(release);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("size must be positive"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
}

TEST_F(BadInputTest, MessageOverMaxMessageBytesIsResourceExhausted) {
  v1::OpenSessionRequest request;
  request.set_gpu(0);
  request.set_peer_token(peer_->token());
  request.set_label(std::string(2 * kMaxMessageBytes, 'L'));
  grpc::Status s = Open(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("limits.max_message_bytes"));
  ExpectServing("an oversized OpenSession");
  EXPECT_EQ(Status().sessions_size(), 0);
  // Past gRPC's own backstop (4 times the limit) gRPC refuses it before the
  // daemon sees it: the same code, gRPC's message, counted as a call gRPC
  // ended unseen (below).
  request.set_label(std::string(5 * kMaxMessageBytes, 'L'));
  s = Open(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(s);
  ExpectServing("a message past gRPC's backstop");

  // On the stream: within the event limit, over the byte limit. The stream
  // fails; as it is the session's lifeline, the session goes with it.
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  v1::EventBatch big = Created({2});
  for (int i = 0; i < kMaxMessageBytes; ++i) {
    big.mutable_created(0)->add_parent_ids(1);
  }
  stream.Send(big);
  s = stream.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("limits.max_message_bytes"));
  ExpectServing("an oversized stream message");
  EXPECT_TRUE(WaitForSessions(0)) << "the session of a failed stream stays";
  // The process can open again.
  MustOpen(peer_->token(), 0);
  // Both refusals the daemon saw are counted.
  const int port = MetricsPort(daemon_->Output());
  std::string metrics = Http(port, "GET", "/metrics").second;
  EXPECT_THAT(metrics,
              HasSubstr("deltad_refused_total{limit=\"max_message_bytes\"} 2"));
  // The one gRPC refused, once the daemon's census has it for certain (a
  // sample a second, the least of the last five), and nothing else: the
  // calls and the stream the daemon answered are not counted.
  const std::string unseen =
      "deltad_refused_total{limit=\"grpc_ended_unseen\"} ";
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (metrics.find(unseen + "1") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    metrics = Http(port, "GET", "/metrics").second;
  }
  EXPECT_THAT(metrics, HasSubstr(unseen + "1\n"));
  EXPECT_THAT(daemon_->Output(),
              HasSubstr("gRPC ended 1 call(s) before the daemon saw them"));
}

// Not bad input, but the fixture fits: a release asked by one process is
// taken from another process above its share, on that process's stream.
TEST_F(BadInputTest, ReleaseTakesFromAnotherProcessAboveItsShare) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse a = MustOpen((*other)->token(), 0);
  SessionStream stream_a(*stub_, a.session_token());
  ASSERT_TRUE(stream_a.Send(Created({1, 2, 3, 4, 5, 6}, kGiB)));
  ASSERT_TRUE(WaitForTensors(a.session_id(), 6));
  // B joins: the GPU's 7.2 GiB are split, and A (6 GiB) is above its share.
  const v1::OpenSessionResponse b = MustOpen(peer_->token(), 0);
  ASSERT_LT(b.granted_budget_bytes(), 6 * kGiB);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  v1::ReleaseRequest request;
  request.set_session_token(b.session_token());
  request.set_bytes(3 * kGiB);
  v1::ReleaseResponse response;
  const grpc::Status s = stub_->Release(&context, request, &response);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_TRUE(response.room_available());
  EXPECT_EQ(response.release_size(), 0);  // B loses nothing
  auto orders = stream_a.NextMatching(
      [](const v1::Orders& o) { return o.release_size() > 0; });
  ASSERT_TRUE(orders.has_value());
  int64_t bytes = 0;
  for (const v1::ReleaseOrder& o : orders->release()) {
    EXPECT_GE(o.tensor_id(), 1u);
    EXPECT_LE(o.tensor_id(), 6u);
    bytes += o.bytes();
  }
  // What the GPU lacked: 6 + 3 GiB against 7.2 GiB.
  EXPECT_GE(bytes, 2 * kGiB);
  EXPECT_LE(bytes, 3 * kGiB);
  ExpectServing("a cross-session release");
}

}  // namespace
}  // namespace deltad::testing_util
