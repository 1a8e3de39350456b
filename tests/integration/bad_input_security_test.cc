// Security: socket modes, sessions owned by the peer token's process,
// chunks never handed on with their bytes, TCP off unless configured and
// a read-only metrics page.
#include <dirent.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/bad_input_fixture.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The TCP ports process `pid` listens on (its socket inodes matched
// against /proc/net/tcp and tcp6).
std::set<int> ListeningTcpPorts(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fds = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* dir = ::opendir(fds.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      char target[256] = {};
      const std::string link = fds + "/" + e->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
      absl::string_view t(target, n > 0 ? n : 0);
      if (absl::ConsumePrefix(&t, "socket:[")) {
        inodes.insert(std::string(t.substr(0, t.size() - 1)));
      }
    }
    ::closedir(dir);
  }
  std::set<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the heading
    while (std::getline(in, line)) {
      const std::vector<std::string> f =
          absl::StrSplit(line, ' ', absl::SkipEmpty());
      // local_address is ADDR:PORT in hex, st 0A is LISTEN, inode is f[9].
      if (f.size() < 10 || f[3] != "0A" || inodes.count(f[9]) == 0) continue;
      ports.insert(std::stoi(f[1].substr(f[1].rfind(':') + 1), nullptr, 16));
    }
  }
  return ports;
}
// --- Security ---------------------------------------------------------------

// Whether a process of user `uid` may connect to the Unix socket at `path`:
// a child that drops to that user and tries.
bool UserCanConnect(uid_t uid, const std::string& path) {
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 ||
        ::setuid(uid) != 0) {
      ::_exit(2);
    }
    ::_exit(common::ConnectUnix(path).ok() ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST_F(BadInputTest, BothSocketsAreDeltadsWithTheConfiguredMode) {
  for (const unsigned mode : {0660u, 0600u}) {
    DaemonOptions options;
    options.config_text = absl::StrCat("socket_mode: ", mode, "\n");
    StartDaemon(std::move(options));
    for (const std::string& path :
         {daemon_->socket_path(), daemon_->side_socket_path()}) {
      struct stat st {};
      ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
      EXPECT_TRUE(S_ISSOCK(st.st_mode)) << path;
      EXPECT_EQ(st.st_mode & 07777, mode) << path;
      EXPECT_EQ(st.st_uid, ::geteuid()) << path;
      if (::geteuid() == 0) {
        // Another user (nobody), in neither the owner nor the group, is
        // kept out by the mode: connecting needs write permission.
        EXPECT_FALSE(UserCanConnect(65534, path)) << path;
      }
    }
  }
  if (::geteuid() != 0) {
    std::printf("(not root: another user's connect was not tried)\n");
  }
}

TEST_F(BadInputTest, ASessionBelongsToThePeerTokensProcessNotTheCaller) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  // This process calls, with the other's peer token.
  const v1::OpenSessionResponse theirs = MustOpen((*other)->token(), 0);
  const v1::SessionStatus s = SessionOf(theirs.session_id());
  EXPECT_EQ(s.pid(), (*other)->pid());
  EXPECT_EQ(s.uid(), ::geteuid());
  // And it dies with that process, not with the caller.
  (*other)->Kill();
  EXPECT_TRUE(WaitForSessions(0));
}

TEST_F(BadInputTest, AReleaseNamingAnotherSessionsTensorsTouchesNothing) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs = MustOpen((*other)->token(), 0);
  SessionStream their_stream(*stub_, theirs.session_token());
  ASSERT_TRUE(their_stream.Send(Created({5}, 4 * kMiB)));
  ASSERT_TRUE(WaitForTensors(theirs.session_id(), 1));
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  // Tensor 5 in my request is my tensor 5, which does not exist.
  for (const v1::TensorEvent::Kind kind :
       {v1::TensorEvent::FREED, v1::TensorEvent::EVICTED,
        v1::TensorEvent::OFFLOADED}) {
    v1::ReleaseRequest release;
    release.set_session_token(mine.session_token());
    release.set_bytes(kMiB);
    *release.mutable_batch() = Event(kind, 5);
    const grpc::Status s = Release(release);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  }
  const v1::SessionStatus t = SessionOf(theirs.session_id());
  EXPECT_EQ(t.tensors(), 1u);
  EXPECT_EQ(t.device_bytes(), 4 * kMiB);
}

TEST_F(BadInputTest, ChunksAreNeverHandedOnWithTheirBytes) {
  const v1::OpenSessionResponse first = MustOpen(peer_->token(), 0);
  auto chunks = peer_->FetchChunks(first.session_token(), first.chunk_bytes());
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 1u);
  const int64_t bytes = (*chunks)[0].bytes;
  {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                     (*chunks)[0].fd.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    std::memset(p, 0xAB, bytes);
    ::munmap(p, bytes);
  }
  const uint64_t first_id = (*chunks)[0].id;
  ASSERT_TRUE(peer_->ReturnChunks(first.session_token(), {first_id}).ok());
  chunks->clear();
  ASSERT_TRUE(Close(first.session_token()).ok());
  // The next session on the GPU gets fresh memory, not the chunk back.
  const v1::OpenSessionResponse next = MustOpen(peer_->token(), 0);
  auto again = peer_->FetchChunks(next.session_token(), next.chunk_bytes());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->size(), 1u);
  EXPECT_NE((*again)[0].id, first_id);
  void* p =
      ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, (*again)[0].fd.get(), 0);
  ASSERT_NE(p, MAP_FAILED);
  const auto* b = static_cast<const unsigned char*>(p);
  EXPECT_EQ(std::count(b, b + bytes, 0), bytes) << "the chunk is not zeroed";
  ::munmap(p, bytes);
}

TEST_F(BadInputTest, TcpIsOffUnlessConfiguredAndOnlyMetricsListenByDefault) {
  const int metrics = MetricsPort(daemon_->Output());
  ASSERT_GT(metrics, 0) << daemon_->Output();
  EXPECT_EQ(ListeningTcpPorts(daemon_->pid()), std::set<int>{metrics});
  // Asked for, TCP is one port more: the one deltad reports. gRPC once
  // opened a second, unreported one (a listener per poller).
  DaemonOptions options;
  options.config_text = "tcp_address: \"127.0.0.1:0\"\n";
  StartDaemon(std::move(options));
  const std::string out = daemon_->Output();
  const size_t at = out.find(" and 127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << out;
  const int tcp = std::atoi(out.c_str() + at + 15);
  EXPECT_EQ(ListeningTcpPorts(daemon_->pid()),
            (std::set<int>{MetricsPort(out), tcp}))
      << out;
}

TEST_F(BadInputTest, TheMetricsPageIsReadOnly) {
  const int port = MetricsPort(daemon_->Output());
  ASSERT_GT(port, 0) << daemon_->Output();
  const auto [status, page] = Http(port, "GET", "/metrics");
  EXPECT_THAT(status, HasSubstr(" 200 "));
  EXPECT_THAT(page, HasSubstr("deltad_"));
  const v1::NodeStatusResponse before = Status();
  for (const char* method : {"POST", "PUT", "DELETE", "PATCH"}) {
    const auto [code, body] = Http(port, method, "/metrics");
    EXPECT_THAT(code, Not(HasSubstr(" 2"))) << method << ": " << code;
  }
  for (const char* path : {"/", "/admin", "/metrics/../etc/passwd"}) {
    const auto [code, body] = Http(port, "GET", path);
    EXPECT_THAT(code, HasSubstr(" 404 ")) << path << ": " << code;
  }
  const v1::NodeStatusResponse after = Status();
  EXPECT_EQ(after.sessions_size(), before.sessions_size());
  EXPECT_EQ(after.host_pool_granted_bytes(), before.host_pool_granted_bytes());
  ExpectServing("requests to the metrics page");
}

}  // namespace
}  // namespace deltad::testing_util
