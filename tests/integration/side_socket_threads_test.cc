// The side socket under many connections: each training process holds one
// for its whole life, mostly idle, so they must not cost the daemon a
// thread (a stack and a malloc arena) each; and a client that stops
// reading its answers must not hold up anyone else's.
#include <sys/resource.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

namespace side = common::side;
using ::testing::HasSubstr;

constexpr int kConnections = 64;

// The threads of process `pid` (/proc/<pid>/status); -1 if unknown.
int Threads(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

class SideSocketThreadsTest : public DaemonTest {
 protected:
  void SetUp() override {
    // Room for every connection the tests hold, and for the descriptors
    // of a large grant in this process.
    rlimit files;
    if (::getrlimit(RLIMIT_NOFILE, &files) == 0 &&
        files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
    }
    StartDaemonWithLimits(
        absl::StrCat("max_side_connections_per_uid: ", 2 * kConnections));
  }
};

// With a thread per connection, 64 processes were 64 more threads; the
// daemon's thread count now stays where it was, and every connection is
// still served: a token at once, slabs and chunks on request, and its
// sessions reclaimed when it closes.
TEST_F(SideSocketThreadsTest, IdleConnectionsCostNoThreadEach) {
  // Settled first: gRPC starts some of its threads with the first calls.
  ExpectServing("start-up");
  const int before = Threads(daemon_->pid());
  ASSERT_GT(before, 0);
  std::vector<Peer> peers;
  for (int i = 0; i < kConnections; ++i) {
    auto p = Peer::Connect(daemon_->side_socket_path(), absl::Seconds(10));
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
    peers.push_back(std::move(*p));
  }
  const int during = Threads(daemon_->pid());
  std::printf("daemon threads: %d before, %d with %d more side connections\n",
              before, during, kConnections);
  EXPECT_LT(during - before, kConnections / 8);

  // Each connection is answered on its own: a refusal for a token it
  // does not hold, and for two of them (a process holds one session per
  // GPU) their own session's slabs and chunks.
  for (int i = 0; i < kConnections; ++i) {
    auto refused = peers[i].FetchSlabs("bogus", absl::Seconds(10));
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(refused.status().message(), HasSubstr("UNAUTHENTICATED"));
  }
  std::vector<v1::OpenSessionResponse> opened;
  for (int gpu = 0; gpu < 2; ++gpu) {
    Peer& peer = peers[gpu * (kConnections - 1)];
    opened.push_back(MustOpen(peer.token(), gpu, 64 * kMiB));
    const v1::OpenSessionResponse& s = opened.back();
    auto slabs = peer.FetchSlabs(s.session_token(), absl::Seconds(10));
    ASSERT_TRUE(slabs.ok()) << gpu << ": " << slabs.status();
    EXPECT_EQ(slabs->size(), 1u);
    auto chunks = peer.FetchChunks(s.session_token(), 2 * s.chunk_bytes(),
                                   absl::Seconds(10));
    ASSERT_TRUE(chunks.ok()) << gpu << ": " << chunks.status();
    EXPECT_EQ(chunks->size(), 2u);
  }
  EXPECT_EQ(Status().sessions_size(), static_cast<int>(opened.size()));
  peers.clear();  // every process gone: their sessions go with them
  EXPECT_TRUE(WaitForSessions(0));
  EXPECT_LT(Threads(daemon_->pid()) - before, kConnections / 8);
}

// A process that ends one connection and opens another at once (a client
// library that reconnects) gets its new session on the same GPU: the old
// connection's sessions are gone before the new one's token is handed out,
// never refused as a second session of the process on that GPU.
TEST_F(SideSocketThreadsTest, ANewConnectionFindsTheClosedOnesSessionsGone) {
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    auto old_peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(old_peer.ok()) << old_peer.status();
    MustOpen(old_peer->token(), 1);
    old_peer->Close();
    auto new_peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(new_peer.ok()) << new_peer.status();
    v1::OpenSessionResponse opened;
    const grpc::Status s = Open(new_peer->token(), 1, &opened);
    ASSERT_TRUE(s.ok()) << Describe(s);
    new_peer->Close();
  }
  EXPECT_TRUE(WaitForSessions(0));
}

// One thread serves every connection, so no connection may make it wait: a
// client that sends requests and never reads the answers, until neither
// side's buffer takes more, leaves the others served, down to a grant of
// more chunk messages than a socket buffer holds; its sessions are
// reclaimed when it finally goes.
TEST_F(SideSocketThreadsTest, AClientThatNeverReadsHoldsUpNoOne) {
  auto hostile = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  const v1::OpenSessionResponse theirs = MustOpen(hostile->token(), 1);
  // Every one of these requests is answered with an error message.
  const std::string payload = "bogus session token";
  const uint64_t tag = side::kSlabsWanted;
  const uint32_t length = static_cast<uint32_t>(payload.size());
  std::string request;
  for (int i = 0; i < 64; ++i) {
    request.append(reinterpret_cast<const char*>(&tag), sizeof tag);
    request.append(reinterpret_cast<const char*>(&length), sizeof length);
    request += payload;
  }
  int64_t sent = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  // The buffers fill once the daemon stops taking requests; a pause first
  // lets it answer what it has.
  int full = 0;
  while (full < 3 && absl::Now() < give_up) {
    const ssize_t n = ::send(hostile->fd(), request.data(), request.size(),
                             MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      sent += n;
      full = 0;
      continue;
    }
    ASSERT_TRUE(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        << "the daemon closed the connection after " << sent << " bytes";
    ++full;
    absl::SleepFor(absl::Milliseconds(200));
  }
  std::printf("a client that never reads sent %lld bytes of requests\n",
              static_cast<long long>(sent));
  ASSERT_EQ(full, 3) << "the daemon read " << sent
                     << " bytes of requests and still took more";

  // Others are served all the while: a new connection, and a grant of 512
  // chunks (a message each, more than one socket buffer holds).
  auto other = Peer::Connect(daemon_->side_socket_path(), absl::Seconds(10));
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  auto chunks = peer_->FetchChunks(mine.session_token(),
                                   512 * mine.chunk_bytes(), absl::Seconds(10));
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  EXPECT_EQ(chunks->size(), 512u);
  auto slabs = other->FetchSlabs("bogus", absl::Seconds(10));
  ASSERT_FALSE(slabs.ok());
  EXPECT_THAT(slabs.status().message(), HasSubstr("UNAUTHENTICATED"));
  ExpectServing("a side-socket client that never reads");

  hostile->Close();
  EXPECT_TRUE(WaitForStatus([&](const v1::NodeStatusResponse& r) {
    for (const v1::SessionStatus& s : r.sessions()) {
      if (s.session_id() == theirs.session_id()) return false;
    }
    return true;
  }));
  EXPECT_EQ(Status().sessions_size(), 1);
}

}  // namespace
}  // namespace deltad::testing_util
