// The client with no daemon: the in-process policy keeps the process within
// its budget by offloading and evicting, with the bytes intact afterwards.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/sim_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::client {

// Reaches the release steps of an in-process plan and the set of tensors
// the daemon ordered released, which no public call times.
class ClientTestPeer {
 public:
  static void Order(Client& c, uint64_t id) {
    std::lock_guard<std::mutex> lock(c.mu_);
    c.ordered_.insert(id);
  }
  static void Unorder(Client& c, uint64_t id) {
    std::lock_guard<std::mutex> lock(c.mu_);
    c.UnorderLocked(id);
  }
  static absl::Status PlanEvicts(Client& c, uint64_t id) {
    return c.Evict(id, Client::Origin::kLocalPlan);
  }
  static absl::Status PlanOffloads(Client& c, uint64_t id) {
    return c.Offload(id, Client::Origin::kLocalPlan);
  }
};

namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<Client> LocalClient(int64_t budget) {
  ClientOptions o;
  o.use_daemon = false;
  o.fallback_budget_bytes = budget;
  o.fallback_host_bytes = int64_t{256} << 20;
  auto c =
      Client::Connect(o, std::make_unique<SimDevice>(int64_t{1} << 30, 0, 0));
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

void FillWith(void* p, int64_t bytes, unsigned char v) {
  std::memset(p, v, static_cast<size_t>(bytes));
}

bool AllBytesAre(const void* p, int64_t bytes, unsigned char v) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (int64_t i = 0; i < bytes; ++i) {
    if (b[i] != v) return false;
  }
  return true;
}

TensorInfo Info(uint64_t id, int64_t bytes, std::vector<uint64_t> parents = {},
                int64_t cost_ns = 0) {
  TensorInfo t;
  t.id = id;
  t.bytes = bytes;
  t.parents = std::move(parents);
  t.compute_cost_ns = cost_ns;
  return t;
}

// Tracks uncomputable 1 MiB tensors `first`..`last`, each filled with its
// id and unpinned.
void TrackFilled(Client& client, uint64_t first, uint64_t last) {
  for (uint64_t id = first; id <= last; ++id) {
    TensorInfo t = Info(id, kMiB);
    t.uncomputable = true;
    auto p = client.Track(t, nullptr);
    ASSERT_TRUE(p.ok()) << p.status();
    FillWith(*p, kMiB, static_cast<unsigned char>(id));
    client.Unpin(id);
  }
}

TEST(ClientLocal, StaysWithinTheBudgetAndKeepsEveryTensorsBytes) {
  auto client = LocalClient(8 * kMiB);
  // Uncomputable tensors can only be offloaded: their bytes must survive a
  // round trip through host memory.
  for (uint64_t id = 1; id <= 20; ++id) {
    TensorInfo t = Info(id, kMiB);
    t.uncomputable = true;
    auto p = client->Track(t, nullptr);
    ASSERT_TRUE(p.ok()) << p.status();
    FillWith(*p, kMiB, static_cast<unsigned char>(id));
    client->Unpin(id);
    EXPECT_LE(client->Stats().device_bytes, 8 * kMiB);
  }
  const ClientStats mid = client->Stats();
  EXPECT_GE(mid.offloads, 12);
  EXPECT_EQ(mid.evictions, 0);
  for (uint64_t id = 1; id <= 20; ++id) {
    bool restored = false;
    auto p = client->Pin(id, &restored);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(AllBytesAre(*p, kMiB, static_cast<unsigned char>(id)))
        << "tensor " << id;
    client->Unpin(id);
  }
  const ClientStats end = client->Stats();
  EXPECT_GT(end.reloads, 0);
  EXPECT_LE(end.peak_device_bytes, 8 * kMiB);
  EXPECT_FALSE(end.connected);
  EXPECT_GT(end.local_decisions, 0);
}

TEST(ClientLocal, EvictedTensorsAreRecomputedFromTheirParents) {
  auto client = LocalClient(4 * kMiB);
  TensorInfo input = Info(1, kMiB);
  input.uncomputable = true;
  auto in = client->Track(input, nullptr);
  ASSERT_TRUE(in.ok());
  FillWith(*in, kMiB, 7);
  client->Unpin(1);
  int recomputes = 0;
  // Cheap to recompute, so the Director evicts rather than offloads.
  auto make = [&](uint64_t id) -> RecomputeFn {
    return [&, id](uint64_t, void* out) -> absl::Status {
      ++recomputes;
      auto parent = client->Pin(1);
      if (!parent.ok()) return parent.status();
      FillWith(out, kMiB, static_cast<unsigned char>(id + 100));
      client->Unpin(1);
      return absl::OkStatus();
    };
  };
  for (uint64_t id = 2; id <= 10; ++id) {
    auto p = client->Track(Info(id, kMiB, {1}, 1), make(id));
    ASSERT_TRUE(p.ok()) << p.status();
    FillWith(*p, kMiB, static_cast<unsigned char>(id + 100));
    client->Unpin(id);
  }
  EXPECT_GT(client->Stats().evictions, 0);
  for (uint64_t id = 2; id <= 10; ++id) {
    auto p = client->Pin(id);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(AllBytesAre(*p, kMiB, static_cast<unsigned char>(id + 100)));
    client->Unpin(id);
  }
  EXPECT_GT(recomputes, 0);
  EXPECT_EQ(client->Stats().recomputes, recomputes);
}

TEST(ClientLocal, PinnedTensorsAreNeverReleasedAndTheRestIsExhausted) {
  auto client = LocalClient(4 * kMiB);
  for (uint64_t id = 1; id <= 4; ++id) {
    TensorInfo t = Info(id, kMiB);
    t.uncomputable = true;
    ASSERT_TRUE(client->Track(t, nullptr).ok());  // stays pinned
  }
  TensorInfo t = Info(5, kMiB);
  t.uncomputable = true;
  auto p = client->Track(t, nullptr);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("no room"));
  client->Unpin(2);
  ASSERT_TRUE(client->Track(t, nullptr).ok());  // 2 was offloaded for it
  EXPECT_EQ(client->Stats().offloads, 1);
}

TEST(ClientLocal, BadCallsAreRefusedWithAReason) {
  auto client = LocalClient(4 * kMiB);
  EXPECT_EQ(client->Track(Info(1, 0), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Track(Info(1, kMiB, {99}), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client->Track(Info(1, kMiB), nullptr).ok());
  EXPECT_EQ(client->Track(Info(1, kMiB), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Pin(42).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->Free(42).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(client->Free(1).ok());
  EXPECT_EQ(client->Free(1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->Stats().device_bytes, 0);
}

TEST(ClientLocal, AFreedParentIsRebuiltForAChildsRecomputeAndDroppedAgain) {
  auto client = LocalClient(3 * kMiB);
  TensorInfo input = Info(1, kMiB);
  input.uncomputable = true;
  ASSERT_TRUE(client->Track(input, nullptr).ok());
  client->Unpin(1);
  int parent_rebuilds = 0;
  auto parent_fn = [&](uint64_t, void* out) -> absl::Status {
    ++parent_rebuilds;
    FillWith(out, kMiB, 2);
    return absl::OkStatus();
  };
  auto p2 = client->Track(Info(2, kMiB, {1}, 1), parent_fn);
  ASSERT_TRUE(p2.ok());
  FillWith(*p2, kMiB, 2);
  client->Unpin(2);
  auto child_fn = [&](uint64_t, void* out) -> absl::Status {
    auto parent = client->Pin(2);
    if (!parent.ok()) return parent.status();
    const bool ok = AllBytesAre(*parent, kMiB, 2);
    client->Unpin(2);
    FillWith(out, kMiB, 3);
    return ok ? absl::OkStatus() : absl::DataLossError("parent bytes wrong");
  };
  auto p3 = client->Track(Info(3, kMiB, {2}, 1), child_fn);
  ASSERT_TRUE(p3.ok());
  FillWith(*p3, kMiB, 3);
  client->Unpin(3);
  ASSERT_TRUE(client->Free(2).ok());  // kept: 3 may need it
  // Fill the budget so that 3 is evicted.
  TrackFilled(*client, 10, 12);
  auto again = client->Pin(3);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(AllBytesAre(*again, kMiB, 3));
  client->Unpin(3);
  if (client->Stats().recomputes > 0) {
    EXPECT_EQ(parent_rebuilds, 1);
  }
  EXPECT_LE(client->Stats().peak_device_bytes, 3 * kMiB);
}

TEST(ClientLocal, APrefetchHintReloadsWithinTheBudgetAheadOfThePin) {
  auto client = LocalClient(8 * kMiB);
  TrackFilled(*client, 1, 16);
  ASSERT_GE(client->Stats().offloads, 8);
  // Make room for two, then hint all the offloaded ones, oldest first: only
  // what fits the budget comes back, and nothing resident is pushed out.
  for (uint64_t id = 16; id > 12; --id) ASSERT_TRUE(client->Free(id).ok());
  const ClientStats before = client->Stats();
  client->Prefetch({1, 2, 3, 4, 5, 6, 7, 8, 12, 999});
  ClientStats after;
  for (int i = 0; i < 500; ++i) {
    after = client->Stats();
    if (after.prefetches >= 4) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(after.prefetches - before.prefetches, 4);
  EXPECT_EQ(after.offloads, before.offloads) << "a hint pushed a tensor out";
  EXPECT_LE(after.peak_device_bytes, 8 * kMiB);
  for (uint64_t id = 1; id <= 4; ++id) {
    bool restored = true;
    auto p = client->Pin(id, &restored);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_FALSE(restored) << "tensor " << id << " was not prefetched";
    EXPECT_TRUE(AllBytesAre(*p, kMiB, static_cast<unsigned char>(id)));
    client->Unpin(id);
  }
}

// The race a soak run hit: an in-process plan chose a tensor, then the
// daemon's order to offload it arrived; the plan's eviction went first and
// the daemon refused the batch (EVICTED while it held the tensor as
// offloading), losing the session. The plan now leaves ordered tensors to
// their order.
TEST(ClientLocal, AnInProcessPlanLeavesATensorTheDaemonOrderedToItsOrder) {
  auto client = LocalClient(64 * kMiB);
  auto p = client->Track(Info(1, kMiB, {}, 1),
                         [](uint64_t, void*) { return absl::OkStatus(); });
  ASSERT_TRUE(p.ok()) << p.status();
  client->Unpin(1);
  ClientTestPeer::Order(*client, 1);
  EXPECT_EQ(ClientTestPeer::PlanEvicts(*client, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ClientTestPeer::PlanOffloads(*client, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->Stats().evictions, 0);
  EXPECT_EQ(client->Stats().offloads, 0);
  EXPECT_EQ(client->Stats().device_bytes, kMiB);
  ClientTestPeer::Unorder(*client, 1);
  EXPECT_TRUE(ClientTestPeer::PlanEvicts(*client, 1).ok());
  EXPECT_EQ(client->Stats().evictions, 1);
}

}  // namespace
}  // namespace deltad::client
