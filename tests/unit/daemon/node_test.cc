#include "daemon/node.h"

#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "daemon/node_events.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/sim_node.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

// Two simulated GPUs of 10 GiB (9 GiB of budget each), a 1 GiB host pool in
// 64 MiB slabs, metrics recorded.
class NodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodeOptions options;
    options.min_session_bytes = kGiB;
    options.default_host_quota_bytes = 256 * kMiB;
    options.side_socket_path = "/run/deltad/deltad.sock.fds";
    auto sim = testing_util::MakeSimNode(kGiB, options);
    ASSERT_TRUE(sim.ok()) << sim.status();
    backend_ = std::move(sim->backend);
    pool_ = std::move(sim->pool);
    metrics_ = std::move(sim->metrics);
    node_ = std::move(sim->node);
  }

  std::string Peer(pid_t pid, uid_t uid = 1000) {
    PeerIdentity p;
    p.pid = pid;
    p.uid = uid;
    auto t = node_->registry().RegisterPeer(p);
    EXPECT_TRUE(t.ok());
    return *t;
  }

  Node::Opened Open(const std::string& peer, int gpu, int64_t host = 0) {
    v1::OpenSessionRequest r;
    r.set_gpu(gpu);
    r.set_requested_host_bytes(host);
    auto opened = node_->OpenSession(peer, r);
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? std::move(*opened) : Node::Opened{};
  }

  static v1::EventBatch Create(uint64_t id, int64_t bytes) {
    v1::EventBatch b;
    v1::TensorCreated* c = b.add_created();
    c->set_tensor_id(id);
    c->set_bytes(bytes);
    c->set_compute_cost_ns(1000);
    return b;
  }

  std::unique_ptr<SimBackend> backend_;
  std::unique_ptr<HostPool> pool_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Node> node_;
};

TEST_F(NodeTest, OpeningGrantsABudgetHostSlabsAndTheLinkFigures) {
  const Node::Opened o = Open(Peer(100), 1);
  EXPECT_EQ(o.response.granted_budget_bytes(),
            static_cast<int64_t>(0.9 * 10 * kGiB));
  EXPECT_EQ(o.response.host_quota_bytes(), 256 * kMiB);
  EXPECT_EQ(o.slabs.size(), 4u);
  EXPECT_EQ(o.response.host_slabs_size(), 4);
  EXPECT_EQ(o.response.side_socket_path(), "/run/deltad/deltad.sock.fds");
  EXPECT_GT(o.response.d2h_bytes_per_second(), 0);
  EXPECT_TRUE(o.others.empty());
}

TEST_F(NodeTest, ASecondSessionSplitsTheGpuAndTheFirstIsTold) {
  const Node::Opened a = Open(Peer(100), 0);
  const Node::Opened b = Open(Peer(101), 0);
  const int64_t half = static_cast<int64_t>(0.9 * 10 * kGiB) / 2;
  EXPECT_EQ(b.response.granted_budget_bytes(), half);
  ASSERT_TRUE(b.others.contains(a.response.session_id()));
  EXPECT_EQ(b.others.at(a.response.session_id()).new_budget_bytes(), half);
}

TEST_F(NodeTest, BadOpenRequestsAreRefusedWithTheReason) {
  v1::OpenSessionRequest r;
  r.set_gpu(7);
  auto bad_gpu = node_->OpenSession(Peer(1), r);
  EXPECT_EQ(bad_gpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_gpu.status().message(), HasSubstr("this node has 2"));
  r.set_gpu(0);
  EXPECT_EQ(node_->OpenSession("forged", r).status().code(),
            absl::StatusCode::kUnauthenticated);
  r.set_requested_budget_bytes(-1);
  EXPECT_EQ(node_->OpenSession(Peer(2), r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NodeTest, BatchesShowInTheStatusAndStayWithTheirSession) {
  const Node::Opened a = Open(Peer(100), 0);
  const Node::Opened b = Open(Peer(101), 0);
  ASSERT_TRUE(
      node_->Apply(a.response.session_token(), Create(1, 100 * kMiB)).ok());
  // B names A's tensor id: for B it does not exist.
  v1::EventBatch touch;
  v1::TensorEvent* e = touch.add_events();
  e->set_kind(v1::TensorEvent::ACCESSED);
  e->set_tensor_id(1);
  EXPECT_EQ(node_->Apply(b.response.session_token(), touch).status().code(),
            absl::StatusCode::kNotFound);
  const v1::NodeStatusResponse status = node_->Status();
  EXPECT_EQ(status.backend(), "sim");
  ASSERT_EQ(status.gpus_size(), 2);
  EXPECT_EQ(status.gpus(0).used_bytes(), 100 * kMiB);
  EXPECT_EQ(status.gpus(0).sessions(), 2u);
  ASSERT_EQ(status.sessions_size(), 2);
  EXPECT_EQ(status.sessions(0).pid(), 100);
  EXPECT_EQ(status.sessions(0).device_bytes(), 100 * kMiB);
  EXPECT_EQ(status.sessions(1).device_bytes(), 0);
  EXPECT_EQ(node_->Apply("forged", touch).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(NodeTest, ReleaseOrdersWhatTheGpuLacksForTheAllocation) {
  const Node::Opened a = Open(Peer(100), 0);
  // 8 GiB held of the GPU's 9 GiB budget.
  v1::EventBatch batch;
  for (uint64_t id = 1; id <= 16; ++id) {
    v1::TensorCreated* c = batch.add_created();
    c->set_tensor_id(id);
    c->set_bytes(512 * kMiB);
    c->set_compute_cost_ns(1000);
  }
  ASSERT_TRUE(node_->Apply(a.response.session_token(), batch).ok());
  v1::ReleaseRequest r;
  r.set_session_token(a.response.session_token());
  // 512 MiB fits in what is left: allocate now, nothing to release.
  r.set_bytes(512 * kMiB);
  auto fits = node_->Release(r);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_TRUE(fits->response.room_available());
  EXPECT_EQ(fits->response.release_size(), 0);
  // 2 GiB does not: the GPU lacks about 1 GiB, released from this session.
  r.set_bytes(2 * kGiB);
  auto released = node_->Release(r);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(released->response.room_available());
  const int64_t budget = static_cast<int64_t>(0.9 * 10 * kGiB);
  EXPECT_GE(released->response.bytes(), 8 * kGiB + 2 * kGiB - budget);
  EXPECT_LT(released->response.bytes(), 2 * kGiB);
  // More than the whole GPU can never fit.
  r.set_bytes(100 * kGiB);
  EXPECT_EQ(node_->Release(r).status().code(),
            absl::StatusCode::kResourceExhausted);
  r.set_bytes(0);
  EXPECT_EQ(node_->Release(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NodeTest, AProcessThatDiesIsReclaimedAndTheOthersGrow) {
  const std::string dying = Peer(100);
  const Node::Opened a = Open(dying, 0);
  const Node::Opened b = Open(Peer(101), 0);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), Create(1, kGiB)).ok());
  const int64_t granted_before = pool_->Stats().granted_bytes;
  const OrdersBySession others = node_->PeerGone(dying);
  ASSERT_TRUE(others.contains(b.response.session_id()));
  EXPECT_EQ(others.at(b.response.session_id()).new_budget_bytes(),
            static_cast<int64_t>(0.9 * 10 * kGiB));
  EXPECT_EQ(pool_->Stats().granted_bytes, granted_before - 256 * kMiB);
  const v1::NodeStatusResponse status = node_->Status();
  EXPECT_EQ(status.gpus(0).sessions(), 1u);
  EXPECT_EQ(status.gpus(0).used_bytes(), 0);
  EXPECT_EQ(
      node_->Apply(a.response.session_token(), Create(2, 1)).status().code(),
      absl::StatusCode::kUnauthenticated);
}

TEST_F(NodeTest, TheHostPoolIsInTheMetricsBeforeAnySession) {
  const std::string scrape = metrics_->Scrape();
  EXPECT_THAT(scrape, HasSubstr("deltad_host_pool_bytes{state=\"free\"} " +
                                std::to_string(kGiB)));
}

TEST_F(NodeTest, MetricsFollowSessionsAndUse) {
  const Node::Opened a = Open(Peer(100), 1);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), Create(1, kMiB)).ok());
  const std::string scrape = metrics_->Scrape();
  EXPECT_THAT(scrape, HasSubstr("deltad_sessions{gpu=\"1\""));
  EXPECT_THAT(scrape, HasSubstr("deltad_gpu_used_bytes{gpu=\"1\""));
  ASSERT_TRUE(node_->CloseSession(a.response.session_token()).ok());
  EXPECT_EQ(node_->CloseSession(a.response.session_token()).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(NodeTest, ReportedTransfersReachTheMetrics) {
  const Node::Opened a = Open(Peer(100), 1);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), Create(1, kMiB)).ok());
  v1::EventBatch offloaded;
  v1::TensorEvent* e = offloaded.add_events();
  e->set_kind(v1::TensorEvent::OFFLOADED);
  e->set_tensor_id(1);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), offloaded).ok());
  // The d2h series of GPU 1 holds the tensor's bytes.
  const std::string scrape = metrics_->Scrape();
  bool found = false;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (absl::StartsWith(line, "deltad_transferred_bytes_total{") &&
        absl::StrContains(line, "direction=\"d2h\"") &&
        absl::StrContains(line, "gpu=\"1\"")) {
      double value = 0;
      ASSERT_TRUE(absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value))
          << line;
      EXPECT_EQ(value, static_cast<double>(kMiB));
      found = true;
    }
  }
  EXPECT_TRUE(found) << scrape;
}

TEST_F(NodeTest, ListTensorsGivesASessionsLargestFirst) {
  const Node::Opened a = Open(Peer(100), 0);
  const Node::Opened b = Open(Peer(101), 0);
  v1::EventBatch batch;
  const int64_t sizes[] = {3, 1, 4, 1, 5, 9, 2, 6};
  for (uint64_t id = 1; id <= 8; ++id) {
    v1::TensorCreated* c = batch.add_created();
    c->set_tensor_id(id);
    c->set_bytes(sizes[id - 1] * kMiB);
    c->set_compute_cost_ns(1000);
  }
  ASSERT_TRUE(node_->Apply(a.response.session_token(), batch).ok());
  // B's tensor is larger than all of A's and must not show in A's list.
  ASSERT_TRUE(
      node_->Apply(b.response.session_token(), Create(1, 100 * kMiB)).ok());
  // Released tensors still count: they are the session's.
  v1::EventBatch evict;
  v1::TensorEvent* e = evict.add_events();
  e->set_kind(v1::TensorEvent::EVICTED);
  e->set_tensor_id(6);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), evict).ok());

  v1::ListTensorsRequest r;
  r.set_session_id(a.response.session_id());
  r.set_peer_token(Peer(200));
  auto all = node_->ListTensors(r);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->tensors_size(), 8);
  // Ties (ids 2 and 4, 1 MiB each) in id order.
  const uint64_t order[] = {6, 8, 5, 3, 1, 7, 2, 4};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(all->tensors(i).tensor_id(), order[i]) << i;
  }
  EXPECT_EQ(all->tensors(0).bytes(), 9 * kMiB);
  EXPECT_EQ(all->tensors(0).state(), "evicted");
  EXPECT_EQ(all->tensors(1).state(), "resident");
  EXPECT_EQ(all->tensors(0).recomputes(), 0u);
  EXPECT_GE(all->tensors(0).idle_ns(), 0);

  r.set_limit(3);
  auto top = node_->ListTensors(r);
  ASSERT_TRUE(top.ok()) << top.status();
  ASSERT_EQ(top->tensors_size(), 3);
  EXPECT_EQ(top->tensors(2).tensor_id(), 5u);
  r.set_limit(Node::kMaxListTensors + 1);
  EXPECT_EQ(node_->ListTensors(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NodeTest, ListTensorsGivesTwentyWhenNoLimitIsSet) {
  const Node::Opened a = Open(Peer(100), 1);
  v1::EventBatch batch;
  for (uint64_t id = 1; id <= 30; ++id) {
    v1::TensorCreated* c = batch.add_created();
    c->set_tensor_id(id);
    c->set_bytes(static_cast<int64_t>(id) * kMiB);
  }
  ASSERT_TRUE(node_->Apply(a.response.session_token(), batch).ok());
  v1::ListTensorsRequest r;
  r.set_session_id(a.response.session_id());
  r.set_peer_token(Peer(200));
  auto listed = node_->ListTensors(r);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->tensors_size(),
            static_cast<int>(Node::kDefaultListTensors));
  EXPECT_EQ(listed->tensors(0).tensor_id(), 30u);
  EXPECT_EQ(listed->tensors(19).tensor_id(), 11u);
}

// A pool short of a session's quota grants what it has left, in whole
// slabs, rather than nothing: a session with a smaller quota still offloads.
TEST_F(NodeTest, AHostPoolShortOfTheQuotaGrantsWhatItHasLeft) {
  const Node::Opened a = Open(Peer(100), 0, 768 * kMiB);
  EXPECT_EQ(a.response.host_quota_bytes(), 768 * kMiB);
  const Node::Opened b = Open(Peer(101), 0, 512 * kMiB);
  EXPECT_EQ(b.response.host_quota_bytes(), 256 * kMiB);
  EXPECT_EQ(b.slabs.size(), 4u);
  // Exhausted: nothing, and the session still opens.
  const Node::Opened c = Open(Peer(102), 1);
  EXPECT_EQ(c.response.host_quota_bytes(), 0);
  EXPECT_TRUE(c.slabs.empty());
  EXPECT_EQ(node_->Status().host_pool_granted_bytes(), kGiB);
}

TEST_F(NodeTest, AHostQuotaAboveTheLimitIsResourceExhausted) {
  NodeOptions options;
  options.max_host_quota_bytes = 128 * kMiB;
  auto sim = testing_util::MakeSimNode(kGiB, options);
  ASSERT_TRUE(sim.ok()) << sim.status();
  PeerIdentity p;
  p.pid = 100;
  auto peer = sim->node->registry().RegisterPeer(p);
  ASSERT_TRUE(peer.ok());
  v1::OpenSessionRequest r;
  r.set_requested_host_bytes(128 * kMiB + 1);
  auto refused = sim->node->OpenSession(*peer, r);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("limits.max_host_quota_bytes"));
  EXPECT_EQ(sim->node->Status().sessions_size(), 0);
  // Exactly the limit opens, with that quota.
  r.set_requested_host_bytes(128 * kMiB);
  auto opened = sim->node->OpenSession(*peer, r);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->response.host_quota_bytes(), 128 * kMiB);
}

TEST_F(NodeTest, ListTensorsIsForTheOwnersUserRootOrDeltadsUserOnly) {
  // Uids that are neither root nor the user running this test.
  uid_t owner = 4242, stranger = 4343;
  while (owner == ::geteuid() || stranger == ::geteuid()) {
    owner += 2;
    stranger += 2;
  }
  const Node::Opened a = Open(Peer(100, owner), 0);
  ASSERT_TRUE(node_->Apply(a.response.session_token(), Create(1, kMiB)).ok());
  v1::ListTensorsRequest r;
  r.set_session_id(a.response.session_id());
  EXPECT_EQ(node_->ListTensors(r).status().code(),
            absl::StatusCode::kUnauthenticated);
  r.set_peer_token("not a peer token");
  EXPECT_EQ(node_->ListTensors(r).status().code(),
            absl::StatusCode::kUnauthenticated);
  r.set_peer_token(Peer(300, stranger));
  auto denied = node_->ListTensors(r);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(denied.status().message(), HasSubstr("belongs to uid"));
  // Another process of the owner's user, root, and deltad's own user.
  for (uid_t allowed : {owner, uid_t{0}, ::geteuid()}) {
    r.set_peer_token(Peer(301, allowed));
    auto listed = node_->ListTensors(r);
    ASSERT_TRUE(listed.ok()) << allowed << ": " << listed.status();
    EXPECT_EQ(listed->tensors_size(), 1);
  }
}

TEST_F(NodeTest, ListTensorsOfAnUnknownSessionIsNotFound) {
  const Node::Opened a = Open(Peer(100), 0);
  v1::ListTensorsRequest r;
  r.set_session_id(a.response.session_id() + 1000);
  r.set_peer_token(Peer(200));
  auto listed = node_->ListTensors(r);
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(listed.status().message(), HasSubstr("no session"));
  // A closed session is gone too; a fresh one lists nothing.
  r.set_session_id(a.response.session_id());
  auto empty = node_->ListTensors(r);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->tensors_size(), 0);
  ASSERT_TRUE(node_->CloseSession(a.response.session_token()).ok());
  EXPECT_EQ(node_->ListTensors(r).status().code(), absl::StatusCode::kNotFound);
}

// What a Node reports, kept as it came: the node seen without Prometheus.
class RecordedEvents : public NodeEvents {
 public:
  struct Decision {
    int gpu = 0;
    SessionId session = 0;
  };
  struct Ordering {
    int gpu = 0;
    SessionId session = 0;
    v1::Orders orders;
  };

  void GpuBudget(int gpu, int64_t budget_bytes) override {
    budgets.push_back({gpu, budget_bytes});
  }
  void GpuChanged(int gpu, const GpuState& state) override {
    if (gpu == 0) gpu0_used = state.used_bytes;
  }
  void Decided(int gpu, SessionId session,
               std::chrono::nanoseconds took) override {
    EXPECT_GE(took.count(), 0);
    decisions.push_back({gpu, session});
  }
  void Ordered(int gpu, SessionId session, const v1::Orders& orders) override {
    ordered.push_back({gpu, session, orders});
  }

  std::vector<std::pair<int, int64_t>> budgets;
  int64_t gpu0_used = -1;
  std::vector<Decision> decisions;
  std::vector<Ordering> ordered;
};

TEST(NodeEventsTest, AReleaseReportsItsDecisionAndTheOrdersItGave) {
  SimBackendOptions sim;
  sim.gpus = 2;
  sim.memory_bytes = 10 * kGiB;
  auto backend = SimBackend::Create(sim);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto pool = HostPool::Create(kGiB, 64 * kMiB);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto recorded = std::make_unique<RecordedEvents>();
  const RecordedEvents& seen = *recorded;
  NodeOptions options;
  options.min_session_bytes = kGiB;
  options.default_host_quota_bytes = 256 * kMiB;
  auto node = Node::Create(**backend, **pool, std::move(recorded), options);
  ASSERT_TRUE(node.ok()) << node.status();
  const int64_t budget = static_cast<int64_t>(0.9 * 10 * kGiB);
  EXPECT_EQ(seen.budgets,
            (std::vector<std::pair<int, int64_t>>{{0, budget}, {1, budget}}));

  PeerIdentity peer;
  peer.pid = 100;
  peer.uid = 1000;
  auto peer_token = (*node)->registry().RegisterPeer(peer);
  ASSERT_TRUE(peer_token.ok()) << peer_token.status();
  v1::OpenSessionRequest open;
  open.set_gpu(0);
  auto opened = (*node)->OpenSession(*peer_token, open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SessionId id = opened->response.session_id();
  // 8 GiB held of the GPU's 9 GiB budget.
  v1::EventBatch batch;
  for (uint64_t t = 1; t <= 16; ++t) {
    v1::TensorCreated* c = batch.add_created();
    c->set_tensor_id(t);
    c->set_bytes(512 * kMiB);
    c->set_compute_cost_ns(1000);
  }
  ASSERT_TRUE((*node)->Apply(opened->response.session_token(), batch).ok());
  const size_t decisions_before = seen.decisions.size();
  const size_t ordered_before = seen.ordered.size();

  v1::ReleaseRequest r;
  r.set_session_token(opened->response.session_token());
  r.set_bytes(2 * kGiB);
  auto released = (*node)->Release(r);
  ASSERT_TRUE(released.ok()) << released.status();
  ASSERT_GT(released->response.release_size(), 0);

  // One decision, for the session that asked, on its GPU.
  ASSERT_EQ(seen.decisions.size(), decisions_before + 1);
  EXPECT_EQ(seen.decisions.back().gpu, 0);
  EXPECT_EQ(seen.decisions.back().session, id);
  // Its orders as the reply carries them, reported as the session's.
  ASSERT_EQ(seen.ordered.size(), ordered_before + 1);
  const RecordedEvents::Ordering& own = seen.ordered.back();
  EXPECT_EQ(own.gpu, 0);
  EXPECT_EQ(own.session, id);
  v1::Orders replied;
  *replied.mutable_release() = released->response.release();
  EXPECT_EQ(own.orders.DebugString(), replied.DebugString());
  // And the GPU as it stands after them.
  EXPECT_EQ(seen.gpu0_used, (*node)->Status().gpus(0).used_bytes());
}

}  // namespace
}  // namespace deltad::daemon
