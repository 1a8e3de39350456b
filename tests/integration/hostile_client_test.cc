// A hostile local client against the real deltad process, written from the
// proto alone: it sends what no library would (labels of any size or
// encoding, bytes that are no message, batches past every limit) and
// tries to wear the daemon down. Each case checks that the refusal is a
// clear status naming the field or limit, that nothing else changed, and
// that an honest session on the same GPU can still Release.
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

constexpr int kMaxLabelBytes = 64;
constexpr int kMaxBatchEvents = 16;
constexpr int kMaxStatusSessions = 3;
constexpr int kMaxQueuedOrderBytes = 64 * 1024;
// This process's own connection and the other processes the tests start
// (at most three) fit; the test of this limit opens more.
constexpr int kMaxSideConnectionsPerUid = 5;
// What a flood may add to the daemon's resident memory (the target
// for every flood).
constexpr int64_t kFloodRssBound = 64 * kMiB;

// What a flood of HTTP/2 PINGs may leave in the daemon's resident memory
// once it is over and the heap return's next trim has run. Each connection
// gets about 450 KB of them in before its GOAWAY, and gRPC holds a reply
// for each until the connection is gone. The flood's peak is not bounded by
// anything the daemon controls: measured +62 to +286 MiB, and twice over
// +500 MiB, in 28 runs here; it is printed, not failed on. Once over, with
// glibc's default arenas, +12 to +104 MiB stayed after the trim 10 s later
// (+2 to +7 MiB in most runs with limits.malloc_arenas at 2).
constexpr int64_t kPingFloodSettledRssBound = 192 * kMiB;

// A string field `number` holding `bytes` on the wire, which protobuf's
// own serializer would refuse to write when they are not UTF-8.
std::string RawStringField(int number, const std::string& bytes) {
  std::string wire;
  wire.push_back(static_cast<char>((number << 3) | 2));
  wire.push_back(static_cast<char>(bytes.size()));  // under 128 here
  return wire + bytes;
}

// The resident memory of process `pid` (VmRSS), in bytes; -1 if unknown.
int64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0)
      return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// HTTP/2 as the ping flood speaks it (RFC 9113): a gRPC client library
// would never send these PINGs, so the test writes the frames itself.
constexpr absl::string_view kHttp2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr uint8_t kSettingsFrame = 0x4;
constexpr uint8_t kPingFrame = 0x6;
constexpr uint8_t kGoawayFrame = 0x7;
constexpr uint32_t kEnhanceYourCalm = 0xb;
constexpr size_t kFrameHeaderBytes = 9;

// A frame on stream 0 with no flags.
std::string Http2Frame(uint8_t type, absl::string_view payload) {
  const size_t n = payload.size();
  std::string frame(kFrameHeaderBytes, '\0');
  frame[0] = static_cast<char>(n >> 16);
  frame[1] = static_cast<char>(n >> 8);
  frame[2] = static_cast<char>(n);
  frame[3] = static_cast<char>(type);
  return frame.append(payload.data(), payload.size());
}

uint32_t BigEndian32(absl::string_view bytes) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(bytes[i]);
  return v;
}

// What one flooding connection saw of the daemon.
struct PingFlood {
  int64_t bytes_sent = 0;
  bool goaway = false;
  uint32_t goaway_error = 0;
  std::string goaway_debug;
  bool closed = false;  // the daemon closed the connection
};

// Connects to the gRPC socket and sends PINGs until the daemon closes the
// connection, `max_bytes` are sent, or `timeout` passes. It reads only
// when the daemon's side is full, as a hostile client would, and keeps
// the first GOAWAY; SETTINGS, their ACKs and PING ACKs are skipped.
PingFlood FloodWithPings(const std::string& socket_path, int64_t max_bytes,
                         absl::Duration timeout) {
  PingFlood flood;
  auto fd = common::ConnectUnix(socket_path);
  if (!fd.ok()) return flood;
  std::string burst = std::string(kHttp2Preface) +
                      Http2Frame(kSettingsFrame, "") +
                      Http2Frame(kPingFrame, "flood-00");
  size_t unsent = burst.size();
  const std::string pings = [] {
    std::string many;
    for (int i = 0; i < 1024; ++i) many += Http2Frame(kPingFrame, "flood-01");
    return many;
  }();
  std::string received;
  const absl::Time deadline = absl::Now() + timeout;
  bool writable = true;
  bool eof = false;
  while (!eof && absl::Now() < deadline) {
    if (writable && !flood.closed && flood.bytes_sent < max_bytes) {
      if (unsent == 0) {
        burst = pings;
        unsent = burst.size();
      }
      const ssize_t n = ::send(fd->get(), burst.data() + burst.size() - unsent,
                               unsent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        flood.bytes_sent += n;
        unsent -= static_cast<size_t>(n);
        continue;
      }
      // EPIPE or ECONNRESET: the daemon closed it; what it sent before
      // is still there to read.
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        flood.closed = true;
      }
    }
    pollfd p = {fd->get(), POLLIN, 0};
    if (!flood.closed && flood.bytes_sent < max_bytes) p.events |= POLLOUT;
    const int ready = ::poll(&p, 1, 100);
    writable = ready > 0 && (p.revents & POLLOUT) != 0;
    if (ready <= 0 || (p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
      continue;
    }
    char buf[16384];
    const ssize_t n = ::recv(fd->get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      flood.closed = eof = true;
    }
    if (n > 0) received.append(buf, static_cast<size_t>(n));
  }
  // The frames: 24-bit length, type, flags, 31-bit stream id, payload.
  for (size_t at = 0; at + kFrameHeaderBytes <= received.size();) {
    const absl::string_view rest = absl::string_view(received).substr(at);
    const size_t length = BigEndian32(rest) >> 8;
    if (rest.size() < kFrameHeaderBytes + length) break;
    const absl::string_view payload = rest.substr(kFrameHeaderBytes, length);
    if (static_cast<uint8_t>(rest[3]) == kGoawayFrame && length >= 8 &&
        !flood.goaway) {
      flood.goaway = true;
      flood.goaway_error = BigEndian32(payload.substr(4));
      flood.goaway_debug = std::string(payload.substr(8));
    }
    at += kFrameHeaderBytes + length;
  }
  return flood;
}

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

class HostileClientTest : public DaemonTest {
 protected:
  void SetUp() override {
    StartDaemonWithLimits(absl::StrCat(
        "max_label_bytes: ", kMaxLabelBytes, " max_batch_events: ",
        kMaxBatchEvents, " max_status_sessions: ", kMaxStatusSessions,
        " max_queued_order_bytes: ", kMaxQueuedOrderBytes,
        " max_side_connections_per_uid: ", kMaxSideConnectionsPerUid));
    // The honest session: a tensor on GPU 0, on a stream that reads.
    honest_ = MustOpen(peer_->token(), 0);
    honest_stream_ =
        std::make_unique<SessionStream>(*stub_, honest_.session_token());
    ASSERT_TRUE(honest_stream_->Send(Created({1})));
    ASSERT_TRUE(WaitForTensors(honest_.session_id(), 1));
  }

  void TearDown() override {
    ExpectHonestSessionUnaffected();
    honest_stream_.reset();
    DaemonTest::TearDown();
  }

  // The honest session still has its tensor and its Release answers.
  void ExpectHonestSessionUnaffected() {
    EXPECT_EQ(SessionOf(honest_.session_id()).tensors(), 1u);
    v1::ReleaseRequest request;
    request.set_session_token(honest_.session_token());
    request.set_bytes(kMiB);
    const grpc::Status s = Release(request);
    EXPECT_TRUE(s.ok()) << "the honest session's Release: " << Describe(s);
  }

  // A unary call with `bytes` as its request, as they are.
  grpc::Status RawCall(const char* method, const std::string& bytes) {
    auto channel = daemon_->NewChannel();
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    grpc::ByteBuffer response;
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer,
                                             grpc::ByteBuffer>(
        channel.get(),
        grpc::internal::RpcMethod(method,
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &context, Bytes(bytes), &response);
  }

  // A Session stream whose first message is `bytes`, as they are; the
  // status it ends with.
  grpc::Status RawStream(const std::string& bytes) {
    auto channel = daemon_->NewChannel();
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    std::unique_ptr<
        grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
        stream(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer,
                                                         grpc::ByteBuffer>::
                   Create(channel.get(),
                          grpc::internal::RpcMethod(
                              "/deltad.v1.MemoryManager/Session",
                              grpc::internal::RpcMethod::BIDI_STREAMING),
                          &context));
    (void)stream->Write(Bytes(bytes));
    grpc::ByteBuffer ignored;
    while (stream->Read(&ignored)) {
    }
    return stream->Finish();
  }

  v1::OpenSessionResponse honest_;
  std::unique_ptr<SessionStream> honest_stream_;
};

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

// Every side-socket connection holds a thread: one user may hold only so
// many, and the next one is closed with the limit's name, not served.
TEST_F(HostileClientTest, SideConnectionsOfOneUserAreBoundedAndNamed) {
  std::vector<Peer> held;  // beside peer_, the fixture's own
  for (int i = 1; i < kMaxSideConnectionsPerUid; ++i) {
    auto p = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(p.ok()) << p.status();
    held.push_back(std::move(*p));
  }
  auto refused = Peer::Connect(daemon_->side_socket_path());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("limits.max_side_connections_per_uid"));
  // One let go, another is served (once the daemon has seen the close).
  held.pop_back();
  absl::StatusOr<Peer> again = absl::UnavailableError("not tried");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    again = Peer::Connect(daemon_->side_socket_path());
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(again.ok()) << again.status();
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, ::testing::ContainsRegex(
                           "deltad_refused_total\\{limit=\"max_side_"
                           "connections_per_uid\"\\} [1-9]"));
}

// The HTTP/2 attack: PINGs, which gRPC answers by itself without a call.
// Past limits.max_ping_strikes a connection gets GOAWAY ENHANCE_YOUR_CALM;
// connection after connection, the daemon goes on serving calls, what the
// flood took of its memory comes back once it is over, and the honest
// session keeps its stream (TearDown). gRPC then closes the connection, but
// not always at once: now and then one goes on taking PINGs to this
// client's byte cap (1 in 6 runs here), and on a loaded machine a GOAWAY
// took over 10 s to come. Those are counted and printed, not failed on: the
// bound on memory is what protects the node.
TEST_F(HostileClientTest, PingFloodsAreCutOffWithGoawayAndLeaveMemoryBounded) {
  constexpr int kConnections = 32;
  constexpr int64_t kMostBytesPerConnection = 4 * kMiB;
  const int64_t rss_before = RssBytes(daemon_->pid());
  int64_t sent = 0;
  int left_open = 0;
  int to_the_cap = 0;
  for (int c = 0; c < kConnections; ++c) {
    const PingFlood flood = FloodWithPings(
        daemon_->socket_path(), kMostBytesPerConnection, absl::Seconds(30));
    sent += flood.bytes_sent;
    ASSERT_TRUE(flood.goaway) << "connection " << c << ": no GOAWAY after "
                              << flood.bytes_sent << " bytes of PINGs";
    EXPECT_EQ(flood.goaway_error, kEnhanceYourCalm) << "connection " << c;
    EXPECT_EQ(flood.goaway_debug, "too_many_pings") << "connection " << c;
    if (!flood.closed) ++left_open;
    if (flood.bytes_sent >= kMostBytesPerConnection) ++to_the_cap;
    ExpectServing(absl::StrCat("ping flood ", c));
  }
  const int64_t rss_after = RssBytes(daemon_->pid());
  // The heap return trims what lies free every 10 s (25 s given here).
  int64_t rss_settled = rss_after;
  for (int i = 0;
       i < 250 && rss_settled - rss_before >= kPingFloodSettledRssBound; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    rss_settled = RssBytes(daemon_->pid());
  }
  std::printf(
      "ping flood: %d connections (%d not closed in time, %d took PINGs to "
      "the %lld-byte cap), %lld bytes of PINGs, RSS %lld -> %lld bytes "
      "(%+lld), settled at %lld (%+lld)\n",
      kConnections, left_open, to_the_cap,
      static_cast<long long>(kMostBytesPerConnection),
      static_cast<long long>(sent), static_cast<long long>(rss_before),
      static_cast<long long>(rss_after),
      static_cast<long long>(rss_after - rss_before),
      static_cast<long long>(rss_settled),
      static_cast<long long>(rss_settled - rss_before));
#ifndef __SANITIZE_ADDRESS__
  // As above: under AddressSanitizer resident memory says nothing.
  EXPECT_LT(rss_settled - rss_before, kPingFloodSettledRssBound);
#endif
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat(
                           "deltad_refused_total{limit=\"max_ping_strikes\"} ",
                           kConnections)));
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
