// A hostile local client against the gRPC socket's own limits: more
// connections than one user may hold (on the Unix socket and the TCP
// port), and calls past gRPC's threads. Each refusal names its limit, and
// an honest session on the same GPU is unaffected (the fixture's
// TearDown).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"
#include "tests/integration/hostile_client.h"
#include "tests/integration/raw_http2.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// NodeStatus on a new channel (made by `channel`) with a deadline of
// `wait`, how long it took, and its status.
grpc::Status NodeStatusOn(
    const std::function<std::shared_ptr<grpc::Channel>()>& channel,
    absl::Duration wait, absl::Duration* took = nullptr) {
  auto stub = v1::MemoryManager::NewStub(channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + wait));
  v1::NodeStatusResponse response;
  const absl::Time start = absl::Now();
  grpc::Status s =
      stub->NodeStatus(&context, v1::NodeStatusRequest(), &response);
  if (took != nullptr) *took = absl::Now() - start;
  return s;
}

// A call past the limit fails at once with the limit's name.
void ExpectRefusedByName(
    const std::function<std::shared_ptr<grpc::Channel>()>& channel) {
  absl::Duration took;
  const grpc::Status s = NodeStatusOn(channel, absl::Seconds(5), &took);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(s);
  EXPECT_THAT(s.error_message(),
              HasSubstr("limits.max_grpc_connections_per_uid"));
  EXPECT_LT(took, absl::Seconds(2)) << Describe(s);
}

// Served again, once the daemon has seen connections close: tries new
// channels for up to 10 s.
grpc::Status ServedAgain(
    const std::function<std::shared_ptr<grpc::Channel>()>& channel) {
  grpc::Status again = grpc::Status(grpc::StatusCode::UNKNOWN, "not tried");
  for (int i = 0; i < 50 && !again.ok(); ++i) {
    again = NodeStatusOn(channel, absl::Seconds(2));
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  return again;
}

// Each gRPC connection costs the daemon memory and a descriptor: one user
// may hold only so many, and the next one gets a GOAWAY naming the limit.
constexpr int kMaxGrpcConnectionsPerUid = 8;

class HostileClientWithGrpcLimitTest : public HostileClientTest {
 protected:
  std::string ExtraLimits() const override {
    return absl::StrCat(" max_grpc_connections_per_uid: ",
                        kMaxGrpcConnectionsPerUid);
  }
};

TEST_F(HostileClientWithGrpcLimitTest,
       GrpcConnectionsOfOneUserAreBoundedAndNamed) {
  // Connections that speak HTTP/2 and make no call; this process's own
  // channel counts too.
  std::vector<common::UniqueFd> held;
  std::string refused_with;
  for (int i = 0; i <= kMaxGrpcConnectionsPerUid && refused_with.empty(); ++i) {
    auto fd = common::ConnectUnix(daemon_->socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    refused_with = GoawayWithin(fd->get(), absl::Milliseconds(300));
    if (refused_with.empty()) held.push_back(std::move(*fd));
  }
  EXPECT_THAT(refused_with, HasSubstr("limits.max_grpc_connections_per_uid"));
  EXPECT_LT(static_cast<int>(held.size()), kMaxGrpcConnectionsPerUid);
  // What a gRPC client sees, on a connection of its own: its call is
  // answered with the limit's name, at once (a GOAWAY alone would leave
  // it to reconnect until its deadline; a close, a broken pipe).
  auto unix_channel = [this] { return daemon_->NewChannel(); };
  ExpectRefusedByName(unix_channel);
  // One let go, another is served once the daemon has seen it closed.
  held.pop_back();
  const grpc::Status again = ServedAgain(unix_channel);
  EXPECT_TRUE(again.ok()) << Describe(again);
  ExpectServing("connections past the limit");
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, ::testing::ContainsRegex(
                           "deltad_refused_total\\{limit=\"max_grpc_"
                           "connections_per_uid\"\\} [1-9]"));
}

// The TCP port, when configured, is accepted as the Unix socket is: a
// client on this machine counts as its socket's owner.
class HostileClientWithGrpcLimitOverTcpTest
    : public HostileClientWithGrpcLimitTest {
 protected:
  std::string ExtraConfig() const override {
    return "tcp_address: \"127.0.0.1:0\"\n";
  }
  int TcpPort() const {
    const std::string out = daemon_->Output();
    const size_t at = out.find(" and 127.0.0.1:");
    return at == std::string::npos ? 0 : std::atoi(out.c_str() + at + 15);
  }
};

common::UniqueFd ConnectTcp(int port) {
  common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    return common::UniqueFd();
  }
  return fd;
}

TEST_F(HostileClientWithGrpcLimitOverTcpTest,
       TcpConnectionsCountForTheirUserAndAreRefusedByName) {
  const int port = TcpPort();
  ASSERT_GT(port, 0) << daemon_->Output();
  std::vector<common::UniqueFd> held;
  std::string refused_with;
  for (int i = 0; i <= kMaxGrpcConnectionsPerUid && refused_with.empty(); ++i) {
    common::UniqueFd fd = ConnectTcp(port);
    ASSERT_TRUE(fd.valid());
    refused_with = GoawayWithin(fd.get(), absl::Milliseconds(300));
    if (refused_with.empty()) held.push_back(std::move(fd));
  }
  // This process's Unix-socket channels count for the same user.
  EXPECT_THAT(refused_with, HasSubstr("limits.max_grpc_connections_per_uid"));
  EXPECT_THAT(refused_with, HasSubstr(absl::StrCat("uid ", ::getuid())));
  EXPECT_LT(static_cast<int>(held.size()), kMaxGrpcConnectionsPerUid);
  auto tcp_channel = [port] {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                               grpc::InsecureChannelCredentials());
  };
  ExpectRefusedByName(tcp_channel);
  held.clear();
  // Served over TCP again once the connections are gone.
  const grpc::Status again = ServedAgain(tcp_channel);
  EXPECT_TRUE(again.ok()) << Describe(again);
}

// gRPC answers a unary call for which no thread is free itself (RESOURCE_
// EXHAUSTED "Server Threadpool Exhausted"); the daemon still counts each
// and says so in its log. With one thread, gRPC's own poller's, every
// unary call is refused, so the count is exact: a daemon that is never
// "ready" (its NodeStatus refused too), waited for by its log line.
class GrpcThreadsTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonOptions options;
    options.config_text = "limits { grpc_max_threads: 1 }\n";
    options.flags = {"--drain_seconds=5"};
    options.wait_ready = false;
    auto daemon = DaemonProcess::Start(std::move(options));
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    stub_ = daemon_->NewStub();
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (MetricsPort(daemon_->Output()) == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_GT(MetricsPort(daemon_->Output()), 0) << daemon_->Output();
  }
};

TEST_F(GrpcThreadsTest, CallsRefusedForWantOfAThreadAreCountedAndLogged) {
  constexpr int kCalls = 5;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    v1::NodeStatusResponse response;
    const grpc::Status s =
        stub_->NodeStatus(&context, v1::NodeStatusRequest(), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << Describe(s);
    EXPECT_EQ(s.error_message(), "Server Threadpool Exhausted");
  }
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat(
                           "deltad_refused_total{limit=\"grpc_max_threads\"} ",
                           kCalls, "\n")));
  // Once per 10 s: the first refusal only.
  // The log line comes after the count.
  const std::string logged =
      "gRPC refused a call: no thread free (limits.grpc_max_threads = 1; 0 "
      "such lines";
  EXPECT_THAT(OnceItHolds([&] { return daemon_->Output(); }, logged),
              HasSubstr(logged));
}

// gRPC holds a connection to max_concurrent_streams only once its client
// has acknowledged the daemon's SETTINGS: the daemon hands a connection to
// gRPC only then, and refuses one that opens more calls before, or does
// not acknowledge them in time, naming the limit (daemon/http2_gate.h).
class HostileClientWithFewStreamsTest : public HostileClientTest {
 protected:
  std::string ExtraLimits() const override {
    return " max_concurrent_streams: 4 settings_ack_ms: 500";
  }
};

TEST_F(HostileClientWithFewStreamsTest,
       CallsOpenedBeforeTheSettingsAcknowledgementAreRefusedByName) {
  const std::string hello =
      std::string(kHttp2Preface) + Http2Frame(kSettingsFrame, "");
  std::string calls;
  for (uint32_t i = 0; i < 8; ++i) {
    calls += Http2Frame(kHeadersFrame, kEndHeaders, 1 + 2 * i, "headers");
  }
  auto eager = common::ConnectUnix(daemon_->socket_path());
  ASSERT_TRUE(eager.ok()) << eager.status();
  EXPECT_THAT(GoawayAfter(eager->get(), hello + calls, absl::Seconds(2)),
              HasSubstr("opened more than 4 calls before it acknowledged the "
                        "daemon's SETTINGS (limits.max_concurrent_streams)"));
  auto silent = common::ConnectUnix(daemon_->socket_path());
  ASSERT_TRUE(silent.ok()) << silent.status();
  const absl::Time start = absl::Now();
  EXPECT_THAT(GoawayAfter(silent->get(), hello, absl::Seconds(3)),
              HasSubstr("did not acknowledge the daemon's SETTINGS within "
                        "500ms (limits.settings_ack_ms)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // Up to the limit before the acknowledgement is what a client may do.
  auto honest_raw = common::ConnectUnix(daemon_->socket_path());
  ASSERT_TRUE(honest_raw.ok()) << honest_raw.status();
  EXPECT_EQ(GoawayAfter(honest_raw->get(),
                        hello + calls.substr(0, calls.size() / 2) +
                            Http2Frame(kSettingsFrame, kAckFlag, 0, ""),
                        absl::Milliseconds(700)),
            "");
  const std::string calls_counted =
      "deltad_refused_total{limit=\"max_concurrent_streams\"} 1\n";
  const std::string ack_counted =
      "deltad_refused_total{limit=\"settings_ack_ms\"} 1\n";
  const std::string metrics =
      MetricsOnceTheyHold(daemon_->Output(), {calls_counted, ack_counted});
  EXPECT_THAT(metrics, HasSubstr(calls_counted));
  EXPECT_THAT(metrics, HasSubstr(ack_counted));
  const std::string refused =
      "refused a gRPC connection: a connection opened more than 4 calls";
  EXPECT_THAT(OnceItHolds([&] { return daemon_->Output(); }, refused),
              HasSubstr(refused));
  ExpectServing("calls opened before the SETTINGS acknowledgement");
}

}  // namespace
}  // namespace deltad::testing_util
