// Bad input against the real deltad process: every malformed, forged,
// oversized or out-of-order request gets a specific status code and a
// message that says what was wrong, never touches another session, and
// leaves the daemon serving. Each test starts its own daemon (two
// simulated 8 GiB GPUs, a 1 GiB host pool of 64 MiB slabs, and low limits
// from a config file) and ends by checking that it is still up and that
// SIGTERM stops it cleanly (exit 0: no crash, and under ASan no leak).
#include <arpa/inet.h>
#include <dirent.h>
#include <grp.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kMaxBatchEvents = 8;
constexpr int kMaxMessageBytes = 64 * 1024;

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

class BadInputTest : public DaemonTest {
 protected:
  void SetUp() override {
    StartDaemonWithLimits(
        absl::StrCat("max_batch_events: ", kMaxBatchEvents,
                     " max_message_bytes: ", kMaxMessageBytes));
  }
};

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
  EXPECT_FALSE(s.error_message().empty());
  ExpectServing("an oversized OpenSession");
  EXPECT_EQ(Status().sessions_size(), 0);

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
  ExpectServing("an oversized stream message");
  EXPECT_TRUE(WaitForSessions(0)) << "the session of a failed stream stays";
  // The process can open again.
  MustOpen(peer_->token(), 0);
}

// --- Every malformed request, with the status it gets ----------------------

// One malformed request per row: the call, the code it must get and a piece
// of the message. Batches on the Session stream get no call status (the
// stream carries on); their refusal comes as Orders.rejected_code and
// rejected_batch, which the table checks the same way. Every limit is set
// low here, and each one passed is RESOURCE_EXHAUSTED.
TEST_F(BadInputTest, EachMalformedRequestGetsItsOwnStatus) {
  DaemonOptions options;
  options.config_text =
      "default_host_quota_bytes: 67108864\n"
      "limits { max_batch_events: 8 max_message_bytes: 65536 "
      "max_tensors_per_session: 16 max_sessions_per_gpu: 2 "
      "max_host_quota_bytes: 134217728 }\n";
  options.flags = {"--drain_seconds=5"};
  StartDaemon(std::move(options));

  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  // GPU 1 holds its limit of two sessions, of two other processes.
  auto p1 = PeerProcess::Start(daemon_->side_socket_path());
  auto p2 = PeerProcess::Start(daemon_->side_socket_path());
  auto p3 = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(p1.ok() && p2.ok() && p3.ok());
  MustOpen((*p1)->token(), 1);
  MustOpen((*p2)->token(), 1);
  const v1::OpenSessionResponse closed = MustOpen((*p3)->token(), 0);
  ASSERT_TRUE(Close(closed.session_token()).ok());

  auto open = [&](const std::function<void(v1::OpenSessionRequest&)>& edit) {
    return [this, edit] {
      v1::OpenSessionRequest r;
      r.set_gpu(0);
      r.set_peer_token(peer_->token());
      edit(r);
      return Open(r);
    };
  };
  auto release = [&](const std::function<void(v1::ReleaseRequest&)>& edit) {
    return [this, edit, token = mine.session_token()] {
      v1::ReleaseRequest r;
      r.set_session_token(token);
      r.set_bytes(kMiB);
      edit(r);
      return Release(r);
    };
  };
  auto list = [&](const std::function<void(v1::ListTensorsRequest&)>& edit) {
    return [this, edit, id = mine.session_id()] {
      grpc::ClientContext context;
      context.set_deadline(Deadline());
      v1::ListTensorsRequest r;
      r.set_session_id(id);
      r.set_peer_token(peer_->token());
      edit(r);
      v1::ListTensorsResponse response;
      return stub_->ListTensors(&context, r, &response);
    };
  };
  // A batch on the stream, as a status: its refusal, or OK when it went in.
  auto batch = [&](v1::EventBatch b) {
    return [&stream, b] {
      if (!stream.Send(b)) return grpc::Status(grpc::StatusCode::UNKNOWN, "");
      auto o = stream.NextMatching(
          [](const v1::Orders& x) { return !x.rejected_batch().empty(); },
          absl::Seconds(5));
      if (!o) return grpc::Status::OK;
      return grpc::Status(static_cast<grpc::StatusCode>(o->rejected_code()),
                          o->rejected_batch());
    };
  };
  auto with = [](v1::EventBatch b,
                 const std::function<void(v1::EventBatch&)>& edit) {
    edit(b);
    return b;
  };
  v1::EventBatch nine;
  for (uint64_t id = 100; id < 109; ++id) {
    *nine.add_created() = Created({id}).created(0);
  }
  using Code = grpc::StatusCode;
  struct Row {
    std::string request;
    std::function<grpc::Status()> call;
    Code code;
    std::string says;
  };
  const std::vector<Row> table = {
      // OpenSession
      {"OpenSession without a peer token",
       open([](auto& r) { r.clear_peer_token(); }), Code::UNAUTHENTICATED,
       "peer token"},
      {"OpenSession with a made-up peer token",
       open([](auto& r) { r.set_peer_token("0123456789abcdef"); }),
       Code::UNAUTHENTICATED, "peer token"},
      {"OpenSession on GPU -1", open([](auto& r) { r.set_gpu(-1); }),
       Code::INVALID_ARGUMENT, "no GPU -1"},
      {"OpenSession on GPU 2 of 2", open([](auto& r) { r.set_gpu(2); }),
       Code::INVALID_ARGUMENT, "no GPU 2"},
      {"OpenSession asking a negative budget",
       open([](auto& r) { r.set_requested_budget_bytes(-1); }),
       Code::INVALID_ARGUMENT, "negative"},
      {"OpenSession asking negative host bytes",
       open([](auto& r) { r.set_requested_host_bytes(-1); }),
       Code::INVALID_ARGUMENT, "negative"},
      {"OpenSession at priority 101",
       open([](auto& r) { r.set_priority(101); }), Code::INVALID_ARGUMENT,
       "priority"},
      {"OpenSession a second time on one GPU", open([](auto&) {}),
       Code::ALREADY_EXISTS, "already"},
      {"OpenSession past max_sessions_per_gpu", open([&](auto& r) {
         r.set_gpu(1);
         r.set_peer_token((*p3)->token());
       }),
       Code::RESOURCE_EXHAUSTED, "2"},
      {"OpenSession past max_host_quota_bytes", open([&](auto& r) {
         r.set_peer_token((*p3)->token());
         r.set_requested_host_bytes(128 * kMiB + 1);
       }),
       Code::RESOURCE_EXHAUSTED, "max_host_quota_bytes"},
      {"OpenSession past max_message_bytes",
       open([](auto& r) { r.set_label(std::string(128 << 10, 'L')); }),
       Code::RESOURCE_EXHAUSTED, ""},
      // CloseSession
      {"CloseSession without a token", [&] { return Close(""); },
       Code::UNAUTHENTICATED, "session token"},
      {"CloseSession of a closed session",
       [&] { return Close(closed.session_token()); }, Code::UNAUTHENTICATED,
       "session token"},
      // Release
      {"Release with an unknown session token",
       release([](auto& r) { r.set_session_token("nobody"); }),
       Code::UNAUTHENTICATED, "session token"},
      {"Release of a negative size", release([](auto& r) { r.set_bytes(-1); }),
       Code::INVALID_ARGUMENT, "must be positive"},
      {"Release of more than the GPU's budget",
       release([](auto& r) { r.set_bytes(int64_t{1} << 40); }),
       Code::RESOURCE_EXHAUSTED, "budget"},
      {"Release with a batch past max_batch_events",
       release([&](auto& r) { *r.mutable_batch() = nine; }),
       Code::RESOURCE_EXHAUSTED, "the limit is 8"},
      // ListTensors
      {"ListTensors without a peer token",
       list([](auto& r) { r.clear_peer_token(); }), Code::UNAUTHENTICATED,
       "peer token"},
      {"ListTensors of an unknown session",
       list([](auto& r) { r.set_session_id(987654); }), Code::NOT_FOUND,
       "no session 987654"},
      {"ListTensors past 1000", list([](auto& r) { r.set_limit(1001); }),
       Code::INVALID_ARGUMENT, "at most 1000"},
      // Batches on the Session stream
      {"a tensor of 0 bytes",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->set_bytes(0); })),
       Code::INVALID_ARGUMENT, "size"},
      {"a negative compute cost",
       batch(with(
           Created({2}),
           [](auto& b) { b.mutable_created(0)->set_compute_cost_ns(-1); })),
       Code::INVALID_ARGUMENT, "compute cost"},
      {"an unknown parent",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->add_parent_ids(42); })),
       Code::NOT_FOUND, "parent 42"},
      {"a tensor that is its own parent",
       batch(with(Created({2}),
                  [](auto& b) { b.mutable_created(0)->add_parent_ids(2); })),
       Code::INVALID_ARGUMENT, "cycle"},
      {"a tensor id that exists", batch(Created({1})), Code::ALREADY_EXISTS,
       "already exists"},
      {"an event for an unknown tensor",
       batch(Event(v1::TensorEvent::ACCESSED, 77)), Code::NOT_FOUND,
       "tensor 77"},
      {"an unknown event kind",
       batch(Event(static_cast<v1::TensorEvent::Kind>(99), 1)),
       Code::INVALID_ARGUMENT, "unknown event kind"},
      {"RELOADED for a resident tensor",
       batch(Event(v1::TensorEvent::RELOADED, 1)), Code::FAILED_PRECONDITION,
       "tensor 1"},
      {"a batch past max_batch_events", batch(nine), Code::RESOURCE_EXHAUSTED,
       "the limit is 8"},
  };
  for (const Row& row : table) {
    const grpc::Status s = row.call();
    EXPECT_EQ(s.error_code(), row.code)
        << row.request << ": got " << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr(row.says))
        << row.request << ": got " << Describe(s);
    ExpectServing(row.request);
  }
  // Each refused batch applied nothing: only tensor 1 is there.
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 1u);

  // max_tensors_per_session, in batches within the batch limit: 15 more
  // fit, the 17th tensor does not.
  for (uint64_t first = 2; first <= 16; first += 5) {
    v1::EventBatch b;
    for (uint64_t id = first; id < std::min<uint64_t>(first + 5, 17); ++id) {
      *b.add_created() = Created({id}).created(0);
    }
    ASSERT_TRUE(stream.Send(b));
  }
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 16));
  const grpc::Status over = batch(Created({17}))();
  EXPECT_EQ(over.error_code(), Code::RESOURCE_EXHAUSTED) << Describe(over);
  EXPECT_THAT(over.error_message(), HasSubstr("the limit is 16"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 16u);
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

// --- The Session stream -----------------------------------------------------

TEST_F(BadInputTest, BatchNamingAnotherSessionsTensorsDoesNotTouchThem) {
  // Session A belongs to another process, on the same GPU as ours (B).
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse a = MustOpen((*other)->token(), 0);
  SessionStream stream_a(*stub_, a.session_token());
  ASSERT_TRUE(stream_a.Send(Created({1, 2, 3})));
  ASSERT_TRUE(WaitForTensors(a.session_id(), 3));
  const v1::SessionStatus a_before = SessionOf(a.session_id());
  EXPECT_EQ(a_before.device_bytes(), 3 * kMiB);

  const v1::OpenSessionResponse b = MustOpen(peer_->token(), 0);
  SessionStream stream_b(*stub_, b.session_token());
  const struct {
    v1::TensorEvent::Kind kind;
    uint64_t id;
  } foreign[] = {
      {v1::TensorEvent::FREED, 1},     {v1::TensorEvent::ACCESSED, 2},
      {v1::TensorEvent::OFFLOADED, 3}, {v1::TensorEvent::EVICTED, 1},
      {v1::TensorEvent::RELOADED, 2},  {v1::TensorEvent::RELEASE_FAILED, 3},
  };
  for (const auto& f : foreign) {
    SCOPED_TRACE(absl::StrCat(v1::TensorEvent::Kind_Name(f.kind), " ", f.id));
    ASSERT_TRUE(stream_b.Send(Event(f.kind, f.id)));
    EXPECT_THAT(stream_b.NextRejection(), HasSubstr("has no such tensor"));
    ExpectServing("a batch naming another session's tensor");
  }
  v1::EventBatch child = Created({10});
  child.mutable_created(0)->add_parent_ids(1);
  ASSERT_TRUE(stream_b.Send(child));
  EXPECT_THAT(stream_b.NextRejection(),
              HasSubstr("parent 1 is not a tensor of this session"));

  // B's ids are its own: B may create and free its own tensor 1.
  ASSERT_TRUE(stream_b.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(b.session_id(), 1));
  ASSERT_TRUE(stream_b.Send(Event(v1::TensorEvent::FREED, 1)));
  ASSERT_TRUE(WaitForTensors(b.session_id(), 0));

  const v1::SessionStatus a_after = SessionOf(a.session_id());
  EXPECT_EQ(a_after.tensors(), 3u);
  EXPECT_EQ(a_after.device_bytes(), a_before.device_bytes());
  EXPECT_EQ(a_after.host_bytes(), a_before.host_bytes());
  EXPECT_EQ(Status().gpus(0).used_bytes(), 3 * kMiB);
  // And A still works: its tensors are there to be freed.
  ASSERT_TRUE(stream_a.Send(Event(v1::TensorEvent::FREED, 2)));
  EXPECT_TRUE(WaitForTensors(a.session_id(), 2));
}

TEST_F(BadInputTest, ZeroNegativeAndAbsurdTensorSizesAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  const struct {
    int64_t bytes;
    const char* says;
  } sizes[] = {
      {0, "size must be positive, got 0"},
      {-1, "size must be positive, got -1"},
      {std::numeric_limits<int64_t>::min(), "size must be positive"},
      {8 * kGiB, "whole budget"},  // the GPU's memory; its budget is 90%
      {std::numeric_limits<int64_t>::max(), "whole budget"},
  };
  for (const auto& size : sizes) {
    SCOPED_TRACE(absl::StrCat("bytes ", size.bytes));
    ASSERT_TRUE(stream.Send(Created({7}, size.bytes)));
    EXPECT_THAT(stream.NextRejection(), HasSubstr(size.says));
    ExpectServing("a bad tensor size");
  }
  v1::EventBatch cost = Created({7});
  cost.mutable_created(0)->set_compute_cost_ns(-1);
  ASSERT_TRUE(stream.Send(cost));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("compute cost"));
  // One bad tensor refuses the batch whole.
  v1::EventBatch mixed = Created({1, 2, 3});
  mixed.mutable_created(2)->set_bytes(0);
  ASSERT_TRUE(stream.Send(mixed));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("tensor 3: size"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  // The stream carries on.
  ASSERT_TRUE(stream.Send(Created({7})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
}

TEST_F(BadInputTest, UnknownParentsAndCyclesAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());

  v1::EventBatch unknown = Created({1});
  unknown.mutable_created(0)->add_parent_ids(42);
  ASSERT_TRUE(stream.Send(unknown));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("parent 42 is not a tensor of this session"));

  v1::EventBatch self = Created({1});
  self.mutable_created(0)->add_parent_ids(1);
  ASSERT_TRUE(stream.Send(self));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("cycle"));

  v1::EventBatch loop = Created({1, 2, 3});
  loop.mutable_created(0)->add_parent_ids(3);
  loop.mutable_created(1)->add_parent_ids(1);
  loop.mutable_created(2)->add_parent_ids(2);
  ASSERT_TRUE(stream.Send(loop));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("cycle in parents"));
  ExpectServing("parents that do not exist");
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);

  // A parent freed before its child is reported is gone too.
  ASSERT_TRUE(stream.Send(Created({5})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::FREED, 5)));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 0));
  v1::EventBatch orphan = Created({6});
  orphan.mutable_created(0)->add_parent_ids(5);
  ASSERT_TRUE(stream.Send(orphan));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("parent 5"));

  // Parents later in the same batch are fine.
  v1::EventBatch forward = Created({10, 11});
  forward.mutable_created(0)->add_parent_ids(11);
  ASSERT_TRUE(stream.Send(forward));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 2));
}

TEST_F(BadInputTest, DuplicateTensorIdsAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1, 2, 1})));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("tensor 1 is created twice in one batch"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);

  ASSERT_TRUE(stream.Send(Created({5})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(stream.Send(Created({5}, 2 * kMiB)));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("tensor 5 already exists"));
  ExpectServing("duplicate tensor ids");
  EXPECT_EQ(SessionOf(mine.session_id()).device_bytes(), kMiB);

  // Freed twice: the second FREED names a tensor that is gone.
  v1::EventBatch twice = Event(v1::TensorEvent::FREED, 5);
  *twice.add_events() = twice.events(0);
  ASSERT_TRUE(stream.Send(twice));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("freed earlier in this batch"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 1u);

  // Once freed, the id may be reused.
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::FREED, 5)));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 0));
  ASSERT_TRUE(stream.Send(Created({5})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
}

TEST_F(BadInputTest, UnknownEventKindsAndIllegalTransitionsAreRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  for (int kind : {0, 8, 1000, -1}) {
    SCOPED_TRACE(absl::StrCat("kind ", kind));
    ASSERT_TRUE(
        stream.Send(Event(static_cast<v1::TensorEvent::Kind>(kind), 1)));
    EXPECT_THAT(stream.NextRejection(), HasSubstr("unknown event kind"));
  }
  // Reloaded without having been offloaded.
  ASSERT_TRUE(stream.Send(Event(v1::TensorEvent::RELOADED, 1)));
  EXPECT_THAT(stream.NextRejection(), HasSubstr("for tensor 1"));
  ExpectServing("unknown event kinds");
  EXPECT_EQ(SessionOf(mine.session_id()).device_bytes(), kMiB);
}

TEST_F(BadInputTest, BatchOverMaxBatchEventsIsRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  v1::EventBatch too_many;
  for (uint64_t id = 1; id <= kMaxBatchEvents + 1; ++id) {
    *too_many.add_created() = Created({id}).created(0);
  }
  ASSERT_TRUE(stream.Send(too_many));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr(absl::StrCat("the limit is ", kMaxBatchEvents)));
  // Creations and events count together.
  v1::EventBatch mixed = Created({1, 2, 3, 4});
  for (uint64_t id = 1; id <= kMaxBatchEvents - 3; ++id) {
    v1::TensorEvent* e = mixed.add_events();
    e->set_kind(v1::TensorEvent::ACCESSED);
    e->set_tensor_id(1 + id % 4);
  }
  ASSERT_TRUE(stream.Send(mixed));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr(absl::StrCat("the limit is ", kMaxBatchEvents)));
  ExpectServing("an oversized batch");
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  // Exactly the limit is fine.
  v1::EventBatch full;
  for (uint64_t id = 1; id <= kMaxBatchEvents; ++id) {
    *full.add_created() = Created({id}).created(0);
  }
  ASSERT_TRUE(stream.Send(full));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), kMaxBatchEvents));
}

TEST_F(BadInputTest, StreamNamingAnotherSessionMidwayIsRejected) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  const v1::OpenSessionResponse other = MustOpen(peer_->token(), 1);
  SessionStream stream(*stub_, mine.session_token());
  v1::SessionMessage m;
  m.set_session_token(other.session_token());
  *m.mutable_batch() = Created({1});
  ASSERT_TRUE(stream.SendMessage(m));
  EXPECT_THAT(stream.NextRejection(),
              HasSubstr("a stream carries one session's batches"));
  EXPECT_EQ(SessionOf(mine.session_id()).tensors(), 0u);
  EXPECT_EQ(SessionOf(other.session_id()).tensors(), 0u);
  // A second stream for a session is refused; the first carries on.
  SessionStream second(*stub_, mine.session_token());
  const grpc::Status s = second.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("already has a stream"));
  ASSERT_TRUE(stream.Send(Created({1})));
  EXPECT_TRUE(WaitForTensors(mine.session_id(), 1));
  ExpectServing("a stream naming another session");
}

TEST_F(BadInputTest, RequestsAfterCloseSessionAreUnauthenticated) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  ASSERT_TRUE(Close(mine.session_token()).ok());
  EXPECT_EQ(Status().sessions_size(), 0);

  grpc::Status s = Close(mine.session_token());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("unknown or closed session token"));

  v1::ReleaseRequest release;
  release.set_session_token(mine.session_token());
  release.set_bytes(kMiB);
  s = Release(release);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  SessionStream stream(*stub_, mine.session_token());
  stream.Send(Created({1}));
  s = stream.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  // Slabs of a closed session are refused too.
  auto slabs = peer_->FetchSlabs(mine.session_token());
  ASSERT_FALSE(slabs.ok());
  EXPECT_THAT(slabs.status().message(), HasSubstr("UNAUTHENTICATED"));
  ExpectServing("requests after CloseSession");
  // The process may open on that GPU again.
  MustOpen(peer_->token(), 0);
}

TEST_F(BadInputTest, BatchOnAStreamWhoseSessionWasClosedEndsItUnauthenticated) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  SessionStream stream(*stub_, mine.session_token());
  ASSERT_TRUE(stream.Send(Created({1})));
  ASSERT_TRUE(WaitForTensors(mine.session_id(), 1));
  ASSERT_TRUE(Close(mine.session_token()).ok());
  EXPECT_EQ(Status().sessions_size(), 0);
  EXPECT_EQ(Status().gpus(0).used_bytes(), 0);
  // The stream outlived its session: the next batch cannot be applied, and
  // the process must learn why rather than see a clean end.
  stream.Send(Created({2}));
  const grpc::Status s = stream.FinishWithoutWritesDone();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  ExpectServing("a batch after CloseSession");
}

// --- The side socket --------------------------------------------------------

TEST_F(BadInputTest, SideSocketUnknownTagGetsAnErrorAndTheConnectionEnds) {
  auto garbage = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(garbage.ok()) << garbage.status();
  const v1::OpenSessionResponse doomed = MustOpen(garbage->token(), 1);
  for (uint64_t tag :
       {uint64_t{0}, uint64_t{99}, std::numeric_limits<uint64_t>::max()}) {
    SCOPED_TRACE(absl::StrCat("tag ", tag));
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(peer->Send(tag, "whatever").ok());
    auto answer = peer->Receive();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->tag, side::kError);
    EXPECT_THAT(answer->payload, HasSubstr(absl::StrCat(
                                     "unknown side-socket message tag ", tag)));
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("an unknown side-socket tag");
  }
  // A process that breaks the protocol loses its sessions, as if it died.
  ASSERT_TRUE(garbage->Send(side::kSlab, "x").ok());
  EXPECT_TRUE(garbage->WaitClosedByDaemon());
  EXPECT_TRUE(WaitForSessions(0));
  EXPECT_EQ(SessionOf(doomed.session_id()).session_id(), 0u);
}

TEST_F(BadInputTest, SideSocketMalformedMessagesCloseOnlyThatConnection) {
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  // A payload over the protocol's bound.
  {
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(peer->Send(side::kSlabsWanted,
                           std::string(side::kMaxMessageBytes + 1, 'p'))
                    .ok());
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("an oversized side-socket payload");
  }
  // Descriptors sent to the daemon, which never accepts any.
  {
    auto peer = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(peer.ok()) << peer.status();
    const int fds[] = {0, 1, 2};
    ASSERT_TRUE(peer->Send(side::kSlabsWanted, mine.session_token(), fds).ok());
    EXPECT_TRUE(peer->WaitClosedByDaemon());
    ExpectServing("descriptors sent to the side socket");
  }
  // A header announcing a huge payload, then nothing.
  {
    auto fd = common::ConnectUnix(daemon_->side_socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    char header[common::kHeaderBytes];
    const uint64_t tag = side::kSlabsWanted;
    const uint32_t length = std::numeric_limits<uint32_t>::max();
    std::memcpy(header, &tag, sizeof tag);
    std::memcpy(header + sizeof tag, &length, sizeof length);
    ASSERT_EQ(::send(fd->get(), header, sizeof header, MSG_NOSIGNAL),
              static_cast<ssize_t>(sizeof header));
    ExpectServing("a side-socket header announcing 4 GiB");
  }
  // Half a header, then the connection closes.
  {
    auto fd = common::ConnectUnix(daemon_->side_socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_EQ(::send(fd->get(), "\x02\x00\x00", 3, MSG_NOSIGNAL), 3);
  }
  ExpectServing("half a side-socket header");
  // Many connections at once, dropped at once.
  {
    std::vector<common::UniqueFd> many;
    for (int i = 0; i < 200; ++i) {
      auto fd = common::ConnectUnix(daemon_->side_socket_path());
      ASSERT_TRUE(fd.ok()) << i << ": " << fd.status();
      many.push_back(std::move(*fd));
    }
  }
  ExpectServing("200 side connections");
  // None of it touched the well-behaved peer.
  EXPECT_EQ(Status().sessions_size(), 1);
  auto slabs = peer_->FetchSlabs(mine.session_token());
  ASSERT_TRUE(slabs.ok()) << slabs.status();
  EXPECT_EQ(slabs->size(), 1u);
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

TEST_F(BadInputTest, SlabsOfAnotherProcessSessionArePermissionDenied) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs =
      MustOpen((*other)->token(), 0, 128 * kMiB);
  ASSERT_EQ(theirs.host_slabs_size(), 2);
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  ASSERT_EQ(mine.host_slabs_size(), 1);

  auto stolen = peer_->FetchSlabs(theirs.session_token());
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(stolen.status().message(),
              HasSubstr(absl::StrCat("session ", theirs.session_id(),
                                     " belongs to another process")));
  // A second connection of this very process is another peer too: slabs
  // go only over the connection whose token opened the session.
  auto second = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(second.ok()) << second.status();
  stolen = second->FetchSlabs(mine.session_token());
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));

  for (const std::string& token :
       {std::string(), std::string("bogus"), std::string(4000, 'z')}) {
    auto unknown = peer_->FetchSlabs(token);
    ASSERT_FALSE(unknown.ok());
    EXPECT_THAT(unknown.status().message(), HasSubstr("UNAUTHENTICATED"));
  }
  ExpectServing("asking for another process's slabs");

  // The connection stays usable after refusals: the own slabs come, with
  // descriptors that map memory of the announced size.
  auto own = peer_->FetchSlabs(mine.session_token());
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->size(), 1u);
  EXPECT_EQ((*own)[0].id, mine.host_slabs(0).slab_id());
  EXPECT_EQ((*own)[0].bytes, 64 * kMiB);
  struct stat st;
  ASSERT_EQ(::fstat((*own)[0].fd.get(), &st), 0);
  EXPECT_GE(st.st_size, 64 * kMiB);
  void* mapped = ::mmap(nullptr, 64 * kMiB, PROT_READ | PROT_WRITE, MAP_SHARED,
                        (*own)[0].fd.get(), 0);
  ASSERT_NE(mapped, MAP_FAILED);
  static_cast<char*>(mapped)[64 * kMiB - 1] = 1;
  ::munmap(mapped, 64 * kMiB);
  // The other session is untouched.
  EXPECT_EQ(SessionOf(theirs.session_id()).gpu(), 0);
  EXPECT_EQ(Status().sessions_size(), 2);
}

TEST_F(BadInputTest, ChunksOfAnotherSessionCannotBeFetchedOrReturned) {
  // Two connections of this process are two peers; one session each.
  auto other = Peer::Connect(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0);
  const v1::OpenSessionResponse theirs = MustOpen(other->token(), 1);
  ASSERT_GT(mine.chunk_bytes(), 0);
  EXPECT_EQ(mine.backend(), "sim");

  auto own = peer_->FetchChunks(mine.session_token(), 4 * mine.chunk_bytes());
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_EQ(own->size(), 4u);
  struct stat st;
  ASSERT_EQ(::fstat((*own)[0].fd.get(), &st), 0);
  EXPECT_EQ(st.st_size, mine.chunk_bytes());
  auto their_own =
      other->FetchChunks(theirs.session_token(), theirs.chunk_bytes());
  ASSERT_TRUE(their_own.ok()) << their_own.status();
  ASSERT_EQ(their_own->size(), 1u);

  // Another peer's session: no chunks for it over this connection.
  auto stolen = peer_->FetchChunks(theirs.session_token(), 1 << 30);
  ASSERT_FALSE(stolen.ok());
  EXPECT_THAT(stolen.status().message(), HasSubstr("PERMISSION_DENIED"));
  // Its chunks cannot be returned in this session's name, alone or beside
  // this session's own: nothing is returned at all.
  const uint64_t their_chunk = (*their_own)[0].id;
  for (const std::vector<uint64_t>& ids :
       {std::vector<uint64_t>{their_chunk},
        std::vector<uint64_t>{(*own)[0].id, their_chunk}}) {
    const absl::Status s = peer_->ReturnChunks(mine.session_token(), ids);
    EXPECT_THAT(s.message(), HasSubstr("NOT_FOUND")) << s;
  }
  // Nor in the other session's name over this connection.
  EXPECT_THAT(
      peer_->ReturnChunks(theirs.session_token(), {their_chunk}).message(),
      HasSubstr("PERMISSION_DENIED"));
  EXPECT_EQ(SessionOf(mine.session_id()).chunk_bytes(), 4 * mine.chunk_bytes());
  EXPECT_EQ(SessionOf(theirs.session_id()).chunk_bytes(), theirs.chunk_bytes());

  // Malformed requests are refused and the connection carries on.
  ASSERT_TRUE(peer_->Send(side::kChunksWanted, "short").ok());
  auto answer = peer_->Receive();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->tag, side::kError);
  EXPECT_THAT(answer->payload, HasSubstr("malformed chunk request"));
  ASSERT_TRUE(peer_
                  ->Send(side::kChunksWanted,
                         side::EncodeChunksWanted({mine.session_token(), -1}))
                  .ok());
  answer = peer_->Receive();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->tag, side::kError);
  for (const std::string& payload :
       {std::string(), std::string(3, 'x'), std::string("\xff\xff\xff\x7f"),
        side::EncodeChunksReturned({mine.session_token(), {}}) + "odd"}) {
    ASSERT_TRUE(peer_->Send(side::kChunksReturned, payload).ok());
    answer = peer_->Receive();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->tag, side::kError);
    EXPECT_THAT(answer->payload, HasSubstr("malformed chunk return"));
  }
  ExpectServing("chunk requests naming other sessions");

  // The own chunks go back; the GPU's accounting follows.
  std::vector<uint64_t> ids;
  for (const Peer::Grant& g : *own) ids.push_back(g.id);
  EXPECT_TRUE(peer_->ReturnChunks(mine.session_token(), ids).ok());
  EXPECT_EQ(SessionOf(mine.session_id()).chunk_bytes(), 0);
  EXPECT_EQ(Status().gpus(0).chunk_bytes(), 0);
}

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

// --- Fuzz -------------------------------------------------------------------

TEST_F(BadInputTest, RandomBatchesNeverHurtTheDaemon) {
  auto other = PeerProcess::Start(daemon_->side_socket_path());
  ASSERT_TRUE(other.ok()) << other.status();
  const v1::OpenSessionResponse theirs = MustOpen((*other)->token(), 0);
  SessionStream their_stream(*stub_, theirs.session_token());
  ASSERT_TRUE(their_stream.Send(Created({1, 2})));
  ASSERT_TRUE(WaitForTensors(theirs.session_id(), 2));

  const v1::OpenSessionResponse mine = MustOpen(peer_->token(), 0, 64 * kMiB);
  SessionStream stream(*stub_, mine.session_token());
  std::mt19937_64 random(20240611);
  auto pick = [&](int n) {
    return static_cast<int>(random() % static_cast<uint64_t>(n));
  };
  const int64_t sizes[] = {0,
                           -1,
                           1,
                           4096,
                           kMiB,
                           kGiB,
                           8 * kGiB,
                           std::numeric_limits<int64_t>::max(),
                           std::numeric_limits<int64_t>::min()};
  for (int round = 0; round < 300; ++round) {
    v1::EventBatch b;
    const int entries = pick(kMaxBatchEvents + 3);
    for (int i = 0; i < entries; ++i) {
      const uint64_t id = static_cast<uint64_t>(pick(12));
      if (pick(2) == 0) {
        v1::TensorCreated* c = b.add_created();
        c->set_tensor_id(id);
        c->set_bytes(pick(3) == 0 ? sizes[pick(std::size(sizes))] : kMiB);
        c->set_compute_cost_ns(pick(10) == 0 ? -5 : pick(100000));
        for (int p = pick(3); p > 0; --p) {
          c->add_parent_ids(static_cast<uint64_t>(pick(12)));
        }
        c->mutable_flags()->set_evict_pinned(pick(4) == 0);
        c->mutable_flags()->set_offload_pinned(pick(4) == 0);
        c->mutable_flags()->set_uncomputable(pick(4) == 0);
      } else {
        v1::TensorEvent* e = b.add_events();
        e->set_kind(static_cast<v1::TensorEvent::Kind>(pick(9)));
        e->set_tensor_id(id);
        e->set_at_ns(round);
      }
    }
    b.set_device_bytes_in_use(sizes[pick(std::size(sizes))]);
    ASSERT_TRUE(stream.Send(b)) << "stream broke at round " << round;
    if (round % 50 == 0) {
      ExpectServing(absl::StrCat("random batch ", round));
      v1::ReleaseRequest release;
      release.set_session_token(mine.session_token());
      release.set_bytes(sizes[pick(std::size(sizes))]);
      (void)Release(release);
    }
  }
  ExpectServing("300 random batches");
  // None of it reached the other process's session.
  const v1::SessionStatus after = SessionOf(theirs.session_id());
  EXPECT_EQ(after.tensors(), 2u);
  EXPECT_EQ(after.device_bytes(), 2 * kMiB);
  // Ending the stream reclaims everything the session held.
  const grpc::Status s = stream.Finish();
  EXPECT_TRUE(s.ok()) << Describe(s);
  EXPECT_TRUE(WaitForSessions(1));
  EXPECT_TRUE(WaitForStatus([](const v1::NodeStatusResponse& r) {
    return r.gpus(0).used_bytes() == 2 * kMiB;
  }));
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
