#include "daemon/memory_manager_service.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protocol_version.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/sim_node.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

// A real gRPC server on a Unix socket, in-process, in front of a Node with
// two simulated 10 GiB GPUs.
class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodeOptions options;
    options.default_host_quota_bytes = 128 * kMiB;
    auto sim = testing_util::MakeSimNode(512 * kMiB, options);
    ASSERT_TRUE(sim.ok()) << sim.status();
    backend_ = std::move(sim->backend);
    pool_ = std::move(sim->pool);
    metrics_ = std::move(sim->metrics);
    node_ = std::move(sim->node);
    // Room for far more than gRPC's windows hold: the tests here see the
    // writer blocked, not the queue's limit (see Mailboxes tests below).
    RequestLimits limits;
    limits.max_queued_order_bytes = int64_t{256} << 20;
    service_ = std::make_unique<MemoryManagerService>(*node_, limits);
    socket_ = ::testing::TempDir() + "/deltad_service_test." +
              std::to_string(getpid()) + ".sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_,
                             grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::MemoryManager::NewStub(grpc::CreateChannel(
        "unix:" + socket_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
    unlink(socket_.c_str());
  }

  std::string PeerToken(pid_t pid) {
    PeerIdentity p;
    p.pid = pid;
    return *node_->registry().RegisterPeer(p);
  }

  v1::OpenSessionResponse Open(pid_t pid, int gpu) {
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_gpu(gpu);
    req.set_peer_token(PeerToken(pid));
    v1::OpenSessionResponse resp;
    const grpc::Status s = stub_->OpenSession(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  v1::NodeStatusResponse Status() {
    grpc::ClientContext ctx;
    v1::NodeStatusResponse resp;
    EXPECT_TRUE(stub_->NodeStatus(&ctx, v1::NodeStatusRequest(), &resp).ok());
    return resp;
  }

  // Waits (bounded) until the node reports this many sessions.
  bool WaitForSessions(int n) {
    for (int i = 0; i < 200; ++i) {
      if (Status().sessions_size() == n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  // A stream's batches are applied only once its mailbox is open, so seeing
  // a batch's bytes in the status proves the stream is registered.
  bool WaitForUsed(int gpu, int64_t bytes) {
    for (int i = 0; i < 500; ++i) {
      if (Status().gpus(gpu).used_bytes() == bytes) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  static v1::SessionMessage Batch(const std::string& token, uint64_t id,
                                  int64_t bytes) {
    v1::SessionMessage m;
    m.set_session_token(token);
    v1::TensorCreated* c = m.mutable_batch()->add_created();
    c->set_tensor_id(id);
    c->set_bytes(bytes);
    c->set_compute_cost_ns(1000);
    return m;
  }

  std::unique_ptr<SimBackend> backend_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Node> node_;
  std::unique_ptr<MemoryManagerService> service_;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
};

TEST_F(ServiceTest, OpeningWithoutAPeerTokenIsUnauthenticated) {
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_peer_token("forged");
  v1::OpenSessionResponse resp;
  const grpc::Status s = stub_->OpenSession(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("side socket"));
}

TEST_F(ServiceTest, AClientOfAnotherProtocolIsRefusedNamingBothVersions) {
  grpc::ClientContext ctx;
  v1::OpenSessionRequest req;
  req.set_peer_token(PeerToken(100));
  req.set_client_version("9.0.0");
  req.set_protocol_version(common::kProtocolVersion + 1);
  v1::OpenSessionResponse resp;
  const grpc::Status s = stub_->OpenSession(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("the client library 9.0.0 speaks "
                                     "protocol ",
                                     common::kProtocolVersion + 1)));
  EXPECT_THAT(
      s.error_message(),
      HasSubstr(absl::StrCat("deltad ", DELTAD_VERSION, " speaks protocol ",
                             common::kProtocolVersion)));
  EXPECT_EQ(Status().sessions_size(), 0);  // nothing was opened
}

TEST_F(ServiceTest, ClientsOfThisProtocolOrBeforeTheFieldAreServed) {
  for (uint32_t protocol : {0u, common::kProtocolVersion}) {
    SCOPED_TRACE(protocol);
    grpc::ClientContext ctx;
    v1::OpenSessionRequest req;
    req.set_peer_token(PeerToken(100 + static_cast<int>(protocol)));
    req.set_protocol_version(protocol);
    v1::OpenSessionResponse resp;
    const grpc::Status s = stub_->OpenSession(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.protocol_version(), common::kProtocolVersion);
    EXPECT_EQ(resp.daemon_version(), DELTAD_VERSION);
  }
}

TEST_F(ServiceTest, AStreamCarriesBatchesInAndOrdersOut) {
  const v1::OpenSessionResponse a = Open(100, 0);
  grpc::ClientContext ctx;
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Batch(a.session_token(), 1, 256 * kMiB)));
  ASSERT_TRUE(WaitForUsed(0, 256 * kMiB));
  // A second process on the same GPU: the first is told its new budget on
  // its stream.
  const v1::OpenSessionResponse b = Open(101, 0);
  v1::Orders orders;
  ASSERT_TRUE(stream->Read(&orders));
  EXPECT_EQ(orders.new_budget_bytes(), b.granted_budget_bytes());
  // A bad batch is refused with the reason; the stream carries on.
  v1::SessionMessage bad = Batch(a.session_token(), 2, -5);
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Read(&orders));
  EXPECT_THAT(orders.rejected_batch(), HasSubstr("positive"));
  ASSERT_TRUE(stream->Write(Batch(a.session_token(), 3, kMiB)));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, TheEndOfAStreamReclaimsItsSession) {
  const v1::OpenSessionResponse a = Open(100, 1);
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Session(&ctx);
    ASSERT_TRUE(stream->Write(Batch(a.session_token(), 1, kGiB)));
    ASSERT_TRUE(WaitForUsed(1, kGiB));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  ASSERT_TRUE(WaitForSessions(0));
  EXPECT_EQ(Status().gpus(1).used_bytes(), 0);
  EXPECT_EQ(pool_->Stats().granted_bytes, 0);
  // The stream's mailbox went with it. (The path where a failed Write once
  // left the box behind needs a client that cancels mid-delivery, which this
  // test cannot arrange deterministically.)
  EXPECT_TRUE(service_->mailboxes().Open(a.session_id()));
}

// The threads of this process now (the server, its clients and the test).
int Threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST_F(ServiceTest, OpenStreamsHoldNoThreadsOfTheirOwn) {
  // Warm: gRPC starts its callback threads with the first stream.
  const v1::OpenSessionResponse first = Open(100, 0);
  grpc::ClientContext first_ctx;
  auto first_stream = stub_->Session(&first_ctx);
  ASSERT_TRUE(first_stream->Write(Batch(first.session_token(), 1, kMiB)));
  ASSERT_TRUE(WaitForUsed(0, kMiB));
  const int before = Threads();
  ASSERT_GT(before, 0);
  // As many as admission lets in on the two GPUs (floors of 1 GiB each).
  constexpr int kStreams = 16;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<
      std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::Orders>>>
      streams;
  for (int i = 0; i < kStreams; ++i) {
    const v1::OpenSessionResponse s = Open(200 + i, i % 2);
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stub_->Session(contexts.back().get()));
    ASSERT_TRUE(streams.back()->Write(Batch(s.session_token(), 1, kMiB)));
  }
  ASSERT_TRUE(WaitForUsed(0, (1 + kStreams / 2) * kMiB));
  ASSERT_TRUE(WaitForUsed(1, kStreams / 2 * kMiB));
  // A thread to read and one to write each stream would add 32.
  EXPECT_LT(Threads() - before, kStreams / 2)
      << before << " threads before the streams";
  // Each stream has budget orders to read (the sessions after it cut its
  // budget); the status comes after them.
  v1::Orders orders;
  for (int i = 0; i < kStreams; ++i) {
    streams[i]->WritesDone();
    while (streams[i]->Read(&orders)) {
    }
    EXPECT_TRUE(streams[i]->Finish().ok()) << i;
  }
  first_stream->WritesDone();
  while (first_stream->Read(&orders)) {
  }
  EXPECT_TRUE(first_stream->Finish().ok());
  EXPECT_TRUE(WaitForSessions(0));
}

TEST_F(ServiceTest, ASessionHasOneStreamAndATokenOpensNoOther) {
  const v1::OpenSessionResponse a = Open(100, 0);
  grpc::ClientContext first_ctx;
  auto first = stub_->Session(&first_ctx);
  ASSERT_TRUE(first->Write(Batch(a.session_token(), 1, kMiB)));
  ASSERT_TRUE(WaitForUsed(0, kMiB));
  v1::SessionMessage hello;
  hello.set_session_token(a.session_token());
  grpc::ClientContext second_ctx;
  auto second = stub_->Session(&second_ctx);
  ASSERT_TRUE(second->Write(hello));
  second->WritesDone();
  EXPECT_EQ(second->Finish().error_code(), grpc::StatusCode::ALREADY_EXISTS);
  grpc::ClientContext forged_ctx;
  auto forged = stub_->Session(&forged_ctx);
  v1::SessionMessage bad;
  bad.set_session_token("forged");
  ASSERT_TRUE(forged->Write(bad));
  forged->WritesDone();
  EXPECT_EQ(forged->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  first->WritesDone();
  EXPECT_TRUE(first->Finish().ok());
}

TEST_F(ServiceTest, ReleaseAnswersOverTheWireAndDrainReachesStreams) {
  const v1::OpenSessionResponse a = Open(100, 0);
  grpc::ClientContext stream_ctx;
  auto stream = stub_->Session(&stream_ctx);
  ASSERT_TRUE(stream->Write(Batch(a.session_token(), 1, kMiB)));
  ASSERT_TRUE(WaitForUsed(0, kMiB));
  {
    grpc::ClientContext ctx;
    v1::ReleaseRequest req;
    req.set_session_token(a.session_token());
    req.set_bytes(kMiB);
    v1::ReleaseResponse resp;
    ASSERT_TRUE(stub_->Release(&ctx, req, &resp).ok());
    EXPECT_TRUE(resp.room_available());
    EXPECT_EQ(resp.release_size(), 0);
  }
  {
    grpc::ClientContext ctx;
    v1::ReleaseRequest req;
    req.set_session_token("forged");
    req.set_bytes(kMiB);
    v1::ReleaseResponse resp;
    EXPECT_EQ(stub_->Release(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  service_->Drain();
  v1::Orders orders;
  ASSERT_TRUE(stream->Read(&orders));
  EXPECT_TRUE(orders.draining());
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, ReleaseWaitsForTheStreamBatchesItFollows) {
  const v1::OpenSessionResponse a = Open(100, 0);
  grpc::ClientContext stream_ctx;
  auto stream = stub_->Session(&stream_ctx);
  // Written, then at once a Release naming tensor 1 in its own batch: the
  // daemon must apply the stream's batch first, or tensor 1 is unknown.
  ASSERT_TRUE(stream->Write(Batch(a.session_token(), 1, kMiB)));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(20));
    v1::ReleaseRequest req;
    req.set_session_token(a.session_token());
    req.set_bytes(kMiB);
    req.set_stream_batches_sent(1);
    v1::TensorEvent* e = req.mutable_batch()->add_events();
    e->set_kind(v1::TensorEvent::ACCESSED);
    e->set_tensor_id(1);
    v1::ReleaseResponse resp;
    const grpc::Status s = stub_->Release(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  {
    // A batch that never comes: the wait ends with the call's deadline.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(300));
    v1::ReleaseRequest req;
    req.set_session_token(a.session_token());
    req.set_bytes(kMiB);
    req.set_stream_batches_sent(2);
    v1::ReleaseResponse resp;
    EXPECT_EQ(stub_->Release(&ctx, req, &resp).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, AClientThatStopsReadingIsCancelledAndReclaimed) {
  const v1::OpenSessionResponse a = Open(100, 0);
  grpc::ClientContext stream_ctx;
  auto stream = stub_->Session(&stream_ctx);
  ASSERT_TRUE(stream->Write(Batch(a.session_token(), 1, kMiB)));
  ASSERT_TRUE(WaitForUsed(0, kMiB));
  // Far more than gRPC's flow-control windows and the socket buffers hold,
  // and never read: the daemon's writer blocks in Write.
  v1::Orders big;
  big.set_rejected_batch(std::string(1 << 20, 'x'));
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(service_->mailboxes().Post(a.session_id(), big));
  }
  stream->WritesDone();  // the stream ends on the daemon's side
  // The writer gets its grace (2 s), then the call is cancelled and the
  // session reclaimed, though the client never read a byte.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (Status().sessions_size() != 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Status().sessions_size(), 0);
  stream_ctx.TryCancel();
  (void)stream->Finish();
}

TEST_F(ServiceTest, ListTensorsAnswersOverTheWire) {
  const v1::OpenSessionResponse a = Open(100, 0);
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Session(&ctx);
    ASSERT_TRUE(stream->Write(Batch(a.session_token(), 7, 3 * kMiB)));
    ASSERT_TRUE(WaitForUsed(0, 3 * kMiB));
    grpc::ClientContext list_ctx;
    v1::ListTensorsRequest req;
    req.set_session_id(a.session_id());
    req.set_peer_token(PeerToken(200));
    v1::ListTensorsResponse resp;
    const grpc::Status s = stub_->ListTensors(&list_ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.tensors_size(), 1);
    EXPECT_EQ(resp.tensors(0).tensor_id(), 7u);
    EXPECT_EQ(resp.tensors(0).bytes(), 3 * kMiB);
    EXPECT_EQ(resp.tensors(0).state(), "resident");
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  grpc::ClientContext ctx;
  v1::ListTensorsRequest req;
  req.set_session_id(a.session_id() + 1000);
  req.set_peer_token(PeerToken(200));
  v1::ListTensorsResponse resp;
  const grpc::Status s = stub_->ListTensors(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("no session"));
}

v1::Orders OrdersOfBytes(size_t n) {
  v1::Orders o;
  o.set_rejected_batch(std::string(n, 'x'));
  return o;
}

TEST(Mailboxes, APostPastTheLimitClosesTheBoxAndCallsOnOverflowOnce) {
  Mailboxes boxes(1000);
  int overflows = 0;
  ASSERT_TRUE(boxes.Open(7, [&] { ++overflows; }));
  EXPECT_TRUE(boxes.Post(7, OrdersOfBytes(600)));
  EXPECT_FALSE(boxes.Post(7, OrdersOfBytes(600)));
  EXPECT_EQ(overflows, 1);
  // Closed and emptied: nothing more goes in or comes out.
  EXPECT_FALSE(boxes.Post(7, OrdersOfBytes(1)));
  EXPECT_EQ(overflows, 1);
  v1::Orders out;
  EXPECT_EQ(boxes.Take(7, &out), Mailboxes::Taken::kClosed);
}

TEST(Mailboxes, TakingOrdersMakesRoomAgain) {
  Mailboxes boxes(1000);
  int overflows = 0;
  ASSERT_TRUE(boxes.Open(7, [&] { ++overflows; }));
  v1::Orders out;
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(boxes.Post(7, OrdersOfBytes(600))) << i;
    ASSERT_EQ(boxes.Take(7, &out), Mailboxes::Taken::kOrders);
  }
  EXPECT_EQ(overflows, 0);
}

TEST(Mailboxes, AListenerHearsOfEachPostAndTheCloseAndMayTakeAtOnce) {
  Mailboxes boxes(1000);
  // Takes what it hears of, from inside the call: the boxes' lock is not
  // held then.
  struct Taker : MailboxListener {
    Mailboxes* boxes = nullptr;
    int taken = 0;
    bool closed = false;
    void Ready() override {
      v1::Orders out;
      for (;;) {
        const Mailboxes::Taken t = boxes->Take(7, &out);
        if (t == Mailboxes::Taken::kOrders) {
          ++taken;
          continue;
        }
        closed = closed || t == Mailboxes::Taken::kClosed;
        return;
      }
    }
  };
  auto taker = std::make_shared<Taker>();
  taker->boxes = &boxes;
  ASSERT_TRUE(boxes.Open(7, nullptr, taker));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(boxes.Post(7, OrdersOfBytes(600)));
  v1::Orders draining;
  draining.set_draining(true);
  boxes.Broadcast(draining);
  EXPECT_EQ(taker->taken, 6);
  EXPECT_FALSE(taker->closed);
  boxes.Close(7);
  EXPECT_TRUE(taker->closed);
  // Closed and taken empty: the box is gone.
  EXPECT_FALSE(boxes.Post(7, OrdersOfBytes(1)));
  EXPECT_TRUE(boxes.Open(7));
}

}  // namespace
}  // namespace deltad::daemon
