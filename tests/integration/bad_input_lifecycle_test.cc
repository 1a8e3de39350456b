// Lifelines and the daemon's start and stop: sessions reclaimed with
// their side connection or their process, SIGTERM with streams open,
// and a second daemon on the same socket.
#include <sys/stat.h>

#include <csignal>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// --- Lifelines --------------------------------------------------------------

TEST_F(BadInputTest, ClosingTheSideConnectionReclaimsTheProcessSessions) {
  auto peer = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const v1::OpenSessionResponse g0 = MustOpen(peer->token(), 0, 64 * kMiB);
  const v1::OpenSessionResponse g1 = MustOpen(peer->token(), 1, 64 * kMiB);
  SessionStream stream(*stub_, g0.session_token());
  ASSERT_TRUE(stream.Send(Created({1, 2})));
  ASSERT_TRUE(WaitForTensors(g0.session_id(), 2));
  EXPECT_EQ(Status().host_pool_granted_bytes(), 128 * kMiB);

  peer->Close();
  EXPECT_TRUE(WaitForSessions(0))
      << "sessions of a closed side connection were not reclaimed";
  // The registry forgets the sessions first, then each GPU and the pool let
  // go of them: wait for all of it.
  EXPECT_TRUE(WaitForStatus([](const v1::NodeStatusResponse& r) {
    return r.gpus(0).used_bytes() == 0 && r.gpus(0).sessions() == 0 &&
           r.gpus(1).sessions() == 0 && r.host_pool_granted_bytes() == 0;
  })) << "a reclaimed session still holds memory: "
      << Status().ShortDebugString();
  v1::ReleaseRequest release;
  release.set_session_token(g1.session_token());
  release.set_bytes(kMiB);
  const grpc::Status s = Release(release);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  ExpectServing("a closed side connection");
}

TEST_F(BadInputTest, AKilledProcessHasItsSessionsReclaimed) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs =
      MustOpen((*other)->token(), 0, 64 * kMiB);
  SessionStream stream(*stub_, theirs.session_token());
  ASSERT_TRUE(stream.Send(Created({1, 2, 3})));
  ASSERT_TRUE(WaitForTensors(theirs.session_id(), 3));
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);

  const ExitStatus e = (*other)->Kill();
  EXPECT_EQ(e.signal, SIGKILL) << e.ToString();
  EXPECT_TRUE(WaitForSessions(1));
  EXPECT_EQ(SessionOf(mine.session_id()).gpu(), 0);
  EXPECT_EQ(SessionOf(theirs.session_id()).session_id(), 0u);
  // What is left granted is mine (the rest of the pool, short of the
  // default quota).
  EXPECT_TRUE(WaitForStatus([&](const v1::NodeStatusResponse& r) {
    return r.gpus(0).used_bytes() == 0 &&
           r.host_pool_granted_bytes() == mine.host_quota_bytes();
  }));
  // Its stream, still open, cannot act for the reclaimed session.
  stream.Send(Created({4}));
  const grpc::Status s = stream.FinishWithoutWritesDone();
  EXPECT_NE(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(s);
  ExpectServing("a killed process");
}

// --- Start and stop ---------------------------------------------------------

TEST_F(BadInputTest, SigtermWithAnOpenStreamSendsDrainingAndExitsZero) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));

  daemon_->Terminate();
  const auto draining = stream.NextMatching(
      [](const v1::Orders& o) { return o.draining(); }, absl::Seconds(60));
  ASSERT_TRUE(draining.has_value())
      << "no Orders with draining=true on the open stream\n"
      << daemon_->Output();
  // While draining, nothing new opens.
  const grpc::Status refused = Open(peer_->token(), 1);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
      << Describe(refused);
  EXPECT_THAT(refused.error_message(), HasSubstr("shutting down"));
  // The client goes on alone and ends its stream; the daemon then exits.
  const grpc::Status s = stream.Finish();
  EXPECT_TRUE(s.ok()) << Describe(s);
  stopped_ = true;
  const ExitStatus e = daemon_->Wait(absl::Seconds(60));
  EXPECT_TRUE(e.ok()) << e.ToString() << "\n" << daemon_->Output();
  EXPECT_THAT(daemon_->Output(), HasSubstr("draining"));
}

TEST_F(BadInputTest, SigtermWithAStreamLeftOpenStillExitsZero) {
  // drain_seconds is 5 (SetUp): the daemon stops waiting for the stream.
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  stopped_ = true;
  const ExitStatus e = daemon_->Stop(absl::Seconds(60));
  EXPECT_TRUE(e.ok()) << e.ToString() << "\n" << daemon_->Output();
  EXPECT_THAT(daemon_->Output(), HasSubstr("1 sessions still open at exit"));
  EXPECT_TRUE(stream.WaitEnded()) << "the stream outlived the daemon";
}

TEST_F(BadInputTest, SecondDaemonOnTheSameSocketRefusesToStart) {
  DaemonOptions second;
  second.socket_path = daemon_->socket_path();
  second.wait_ready = false;
  auto intruder = DaemonProcess::Start(second);
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  const ExitStatus e = (*intruder)->Wait(absl::Seconds(60));
  EXPECT_TRUE(e.exited) << e.ToString();
  EXPECT_NE(e.code, 0) << e.ToString();
  EXPECT_THAT((*intruder)->Output(), HasSubstr("another deltad is serving"));
  // The first one still serves, on its socket file.
  ExpectServing("a second daemon on the same socket");
  MustOpen(peer_->token(), 0);
  auto peer = Peer::Connect(daemon_->side_socket_path());
  EXPECT_TRUE(peer.ok()) << peer.status();
}

TEST_F(BadInputTest, StaleSocketOfAKilledDaemonIsTakenOver) {
  peer_.reset();
  const ExitStatus killed = daemon_->Kill();
  EXPECT_EQ(killed.signal, SIGKILL) << killed.ToString();
  stopped_ = true;
  struct stat st;
  ASSERT_EQ(::lstat(daemon_->socket_path().c_str(), &st), 0)
      << "SIGKILL left no socket file";
  // The successor's socket is in the dead daemon's dir, which daemon_ keeps
  // until the end of the test.
  DaemonOptions options;
  options.socket_path = daemon_->socket_path();
  auto successor = DaemonProcess::Start(options);
  ASSERT_TRUE(successor.ok()) << successor.status();
  auto peer = Peer::Connect((*successor)->side_socket_path());
  ASSERT_TRUE(peer.ok()) << peer.status();
  stub_ = (*successor)->NewStub();
  MustOpen(peer->token(), 0);
  EXPECT_EQ(Status().sessions_size(), 1);
  peer->Close();
  const ExitStatus e = (*successor)->Stop();
  EXPECT_TRUE(e.ok()) << e.ToString() << "\n" << (*successor)->Output();
}

}  // namespace
}  // namespace deltad::testing_util
