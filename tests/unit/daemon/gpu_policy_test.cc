// Tests of GpuPolicy: one GPU's policy engine shared by the sessions on it.
// Configuration and sessions, isolation between them, session removal,
// orders that cannot be delivered, and a randomized run of three sessions.
// Batches are in gpu_policy_batch_test.cc, releases and plans in
// gpu_policy_release_test.cc, claims in gpu_policy_claims_test.cc.

#include "daemon/gpu_policy.h"

#include <cstdint>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/gpu_policy_fixture.h"

namespace deltad::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// --- Configuration and sessions -------------------------------------------

TEST(GpuPolicyCreate, RejectsBadConfiguration) {
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(-1, 1000, Options()).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 0, Options()).status()));
  GpuPolicyOptions bad_marks = Options();
  bad_marks.low_watermark = 0.9;
  bad_marks.high_watermark = 0.5;
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 1000, bad_marks).status()));
  GpuPolicyOptions no_prefetch = Options();
  no_prefetch.max_prefetch_in_flight = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(
      GpuPolicy::Create(0, 1000, no_prefetch).status()));
  GpuPolicyOptions no_link = Options();
  no_link.link = {0, 1e9};
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPolicy::Create(0, 1000, no_link).status()));
}

TEST_F(GpuPolicyTest, SessionsAreAddedOnceAndUnknownOnesAreNotFound) {
  Make(1000);
  AddSession(kA, 500);
  EXPECT_TRUE(absl::IsAlreadyExists(policy_->AddSession(kA, 500, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(policy_->AddSession(kB, -1, 0)));
  EXPECT_TRUE(absl::IsNotFound(policy_->RemoveSession(kB)));
  EXPECT_TRUE(absl::IsNotFound(policy_->SetBudget(kB, 10)));
  EXPECT_TRUE(absl::IsNotFound(policy_->Usage(kB).status()));
  EXPECT_TRUE(absl::IsNotFound(Apply(kB, v1::EventBatch())));
  EXPECT_TRUE(absl::IsNotFound(MakeRoom(kB, 10).status()));
  EXPECT_THAT(Plan(kB), IsEmpty());
  EXPECT_TRUE(absl::IsInvalidArgument(policy_->SetBudget(kA, -1)));
  ASSERT_TRUE(policy_->SetBudget(kA, 700).ok());
  EXPECT_EQ(U(kA).budget_bytes, 700);
}

// --- Isolation -------------------------------------------------------------

TEST_F(GpuPolicyTest, ASessionNamingAnotherSessionsIdGetsNotFound) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 7, 1, 100);
  const std::string before = AllUsage();
  for (Kind kind : {kAccessed, kFreed, kOffloaded, kEvicted, kReleaseFailed}) {
    const absl::Status s = Apply(kB, Events({{kind, 7}}));
    EXPECT_TRUE(absl::IsNotFound(s)) << s;
  }
  v1::EventBatch child;
  AddCreated(child, 8, 100, Cost::kCheap, {7});
  const absl::Status s = Apply(kB, child);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("parent 7"));
  EXPECT_EQ(AllUsage(), before);
  // A's tensor is still A's to use.
  EXPECT_TRUE(Apply(kA, Events({{kOffloaded, 7}})).ok());
}

TEST_F(GpuPolicyTest, TwoSessionsUseTheSameIdsIndependently) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 2, 100);
  Fill(kB, 1, 2, 30);
  EXPECT_EQ(U(kA).device_bytes, 200);
  EXPECT_EQ(U(kB).device_bytes, 60);
  ASSERT_TRUE(Apply(kB, Events({{kFreed, 1}, {kOffloaded, 2}})).ok());
  EXPECT_EQ(U(kA).device_bytes, 200);
  EXPECT_EQ(U(kA).tensors, 2);
  EXPECT_EQ(U(kB).device_bytes, 0);
  EXPECT_EQ(U(kB).host_bytes, 30);
  EXPECT_EQ(U(kB).tensors, 1);
  // A's tensor 1 is untouched by B's free.
  EXPECT_TRUE(Apply(kA, Events({{kAccessed, 1}})).ok());
  // B may create its id 1 again; A's id 1 stays A's.
  v1::EventBatch again;
  AddCreated(again, 1, 40);
  ASSERT_TRUE(Apply(kB, again).ok());
  EXPECT_EQ(U(kB).device_bytes, 40);
  EXPECT_EQ(U(kA).device_bytes, 200);
}

// --- RemoveSession -----------------------------------------------------------

TEST_F(GpuPolicyTest, RemoveSessionFreesAllOfItsBytes) {
  Make(10000);
  AddSession(kA, 5000);
  AddSession(kB, 5000);
  Fill(kB, 1, 2, 100);
  v1::EventBatch batch;
  AddCreated(batch, 1, 100);
  AddCreated(batch, 2, 200, Cost::kCheap, {1});
  AddCreated(batch, 3, 300, Cost::kCheap, {2});
  AddCreated(batch, 4, 400);
  AddCreated(batch, 5, 500);
  AddEvent(batch, kFreed, 1);      // kept for 2
  AddEvent(batch, kEvicted, 2);    // needs 1 to be rebuilt
  AddEvent(batch, kOffloaded, 4);  // on the host
  ASSERT_TRUE(Apply(kA, batch).ok());
  auto orders = MakeRoom(kA, 9001);  // the GPU lacks 1 byte
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA));
  const std::string b_before = UsageString(U(kB));
  ASSERT_TRUE(policy_->RemoveSession(kA).ok());
  EXPECT_EQ(policy_->device_bytes(), 200);
  EXPECT_EQ(UsageString(U(kB)), b_before);
  EXPECT_TRUE(absl::IsNotFound(policy_->Usage(kA).status()));
  // The same session id starts afresh, ids and all.
  AddSession(kA, 5000);
  EXPECT_EQ(U(kA).device_bytes, 0);
  EXPECT_EQ(U(kA).host_bytes, 0);
  EXPECT_EQ(U(kA).tensors, 0);
  ASSERT_TRUE(Apply(kA, batch).ok());
}

// --- Randomized --------------------------------------------------------------

// Three sessions send random batches (mostly valid, some with an error at
// the end), ask for room and get plans, and carry out what they are told.
// A model of each session's tensors, kept from what the policy accepted,
// must match its Usage; orders must name tensors of the session they are
// keyed by (sizes tell the sessions apart: bytes % 3 == session - 1).
TEST(GpuPolicyRandomized, ManyBatchesKeepAccountsAndIsolation) {
  enum class M {
    kIsResident,
    kIsOffloading,
    kIsOffloaded,
    kIsReloading,
    kIsEvictedFromDevice,
    kIsEvicted,
  };
  struct MT {
    int64_t bytes;
    bool uncomputable;
    M state;
  };
  constexpr int kSessions = 3;
  constexpr int64_t kBudget = 1500;
  constexpr uint64_t kIds = 24;

  auto made = GpuPolicy::Create(0, kSessions * kBudget, Options());
  ASSERT_TRUE(made.ok()) << made.status();
  GpuPolicy& policy = **made;
  std::vector<std::map<uint64_t, MT>> model(kSessions + 1);
  for (SessionId s = 1; s <= kSessions; ++s) {
    ASSERT_TRUE(policy.AddSession(s, kBudget, 1500).ok());
  }
  std::mt19937_64 rng(12345);
  auto pick = [&](uint64_t n) { return rng() % n; };
  auto chance = [&](int percent) { return pick(100) < uint64_t(percent); };
  int64_t now = 0;
  int failed_batches = 0;
  int rooms = 0;
  int releases = 0;
  int prefetches = 0;

  auto usages = [&] {
    std::string out;
    for (SessionId s = 1; s <= kSessions; ++s) {
      auto u = policy.Usage(s);
      absl::StrAppend(&out, s, ": ", u.ok() ? UsageString(*u) : "none", "\n");
    }
    return out;
  };
  auto check = [&](int round) {
    int64_t sum = 0;
    for (SessionId s = 1; s <= kSessions; ++s) {
      auto u = policy.Usage(s);
      ASSERT_TRUE(u.ok()) << u.status();
      int64_t device = 0, host = 0;
      for (const auto& [id, t] : model[s]) {
        if (t.state == M::kIsResident || t.state == M::kIsReloading) {
          device += t.bytes;
        }
        if (t.state == M::kIsOffloading || t.state == M::kIsOffloaded ||
            t.state == M::kIsReloading) {
          host += t.bytes;
        }
      }
      EXPECT_EQ(u->device_bytes, device)
          << "session " << s << " round " << round;
      EXPECT_EQ(u->host_bytes, host) << "session " << s << " round " << round;
      EXPECT_EQ(u->tensors, static_cast<int64_t>(model[s].size()))
          << "session " << s << " round " << round;
      sum += u->device_bytes;
    }
    ASSERT_EQ(sum, policy.device_bytes()) << "round " << round;
  };
  // An order for `owner`: its own tensor, resident, with its size.
  auto take = [&](SessionId owner, const v1::ReleaseOrder& o) {
    auto it = model[owner].find(o.tensor_id());
    ASSERT_NE(it, model[owner].end())
        << "order for session " << owner << " names unknown tensor "
        << o.tensor_id();
    ASSERT_EQ(it->second.bytes, o.bytes()) << "another session's tensor";
    ASSERT_EQ(static_cast<SessionId>(o.bytes() % 3) + 1, owner);
    ASSERT_EQ(it->second.state, M::kIsResident);
    it->second.state = o.action() == v1::ReleaseOrder::OFFLOAD
                           ? M::kIsOffloading
                           : M::kIsEvictedFromDevice;
    ++releases;
  };

  for (int round = 0; round < 4000; ++round) {
    const SessionId s = 1 + pick(kSessions);
    std::map<uint64_t, MT> next = model[s];
    v1::EventBatch batch;
    // Creations: free ids only, parents among the session's tensors.
    std::vector<uint64_t> created;
    for (uint64_t n = pick(4); n > 0; --n) {
      const uint64_t id = 1 + pick(kIds);
      if (next.contains(id)) continue;
      std::vector<uint64_t> parents;
      for (const auto& [pid, t] : next) {
        if (chance(10)) parents.push_back(pid);
      }
      Flags flags;
      flags.uncomputable = chance(20);
      const int64_t bytes =
          3 * static_cast<int64_t>(10 + pick(60)) + static_cast<int64_t>(s - 1);
      AddCreated(batch, id, bytes, chance(50) ? Cost::kCheap : Cost::kCostly,
                 parents, flags);
      next[id] = MT{bytes, flags.uncomputable, M::kIsResident};
      created.push_back(id);
    }
    // Events the state allows, as a well-behaved process would send them.
    for (uint64_t n = pick(5); n > 0 && !next.empty(); --n) {
      auto it = next.begin();
      std::advance(it, static_cast<long>(pick(next.size())));
      MT& t = it->second;
      std::vector<std::pair<Kind, M>> moves;  // kind, state after
      switch (t.state) {
        case M::kIsResident:
          moves = {{kAccessed, M::kIsResident}, {kOffloaded, M::kIsOffloaded}};
          if (!t.uncomputable) moves.push_back({kEvicted, M::kIsEvicted});
          break;
        case M::kIsOffloading:
          moves = {{kAccessed, M::kIsOffloading},
                   {kOffloaded, M::kIsOffloaded},
                   {kReleaseFailed, M::kIsResident}};
          break;
        case M::kIsOffloaded:
          moves = {{kReloaded, M::kIsResident}};
          if (!t.uncomputable) {
            moves.push_back({kRecomputed, M::kIsResident});
            moves.push_back({kEvicted, M::kIsEvicted});
          }
          break;
        case M::kIsReloading:
          moves = {{kReloaded, M::kIsResident},
                   {kAccessed, M::kIsReloading},
                   {kReleaseFailed, M::kIsOffloaded},
                   {kOffloaded, M::kIsOffloaded}};
          break;
        case M::kIsEvictedFromDevice:
          moves = {{kEvicted, M::kIsEvictedFromDevice},
                   {kReleaseFailed, M::kIsResident},
                   {kRecomputed, M::kIsResident}};
          break;
        case M::kIsEvicted:
          moves = {{kRecomputed, M::kIsResident}};
          break;
      }
      if (chance(15)) {
        AddEvent(batch, kFreed, it->first);
        next.erase(it);
        continue;
      }
      const auto& [kind, after] = moves[pick(moves.size())];
      AddEvent(batch, kind, it->first);
      // Evicting an offloaded tensor drops its host copy: not cancellable.
      t.state = after;
    }
    // Sometimes a bad entry at the end: the whole batch must fail.
    const bool bad = chance(10);
    if (bad) {
      switch (pick(3)) {
        case 0:
          AddEvent(batch, kAccessed, kIds + 1 + pick(5));  // unknown id
          break;
        case 1:
          AddEvent(batch, v1::TensorEvent::KIND_UNSPECIFIED, 1);
          break;
        default:
          if (!next.empty()) {
            // Recomputing a resident tensor (or a freed one) is refused.
            bool found = false;
            for (const auto& [id, t] : next) {
              if (t.state == M::kIsResident) {
                AddEvent(batch, kRecomputed, id);
                found = true;
                break;
              }
            }
            if (!found) AddEvent(batch, kAccessed, kIds + 1);
          } else {
            AddEvent(batch, kAccessed, kIds + 1);
          }
      }
    }
    const std::string before = usages();
    const absl::Status applied = policy.Apply(s, batch, now += 10);
    if (bad) {
      ASSERT_FALSE(applied.ok()) << "round " << round;
      ASSERT_EQ(usages(), before) << "round " << round << ": " << applied;
      ++failed_batches;
    } else {
      ASSERT_TRUE(applied.ok()) << "round " << round << ": " << applied;
      model[s] = std::move(next);
    }
    check(round);

    if (chance(30)) {
      const SessionId r = 1 + pick(kSessions);
      std::vector<SessionUsage> was(kSessions + 1);
      for (SessionId x = 1; x <= kSessions; ++x) was[x] = *policy.Usage(x);
      const std::string room_before = usages();
      auto orders =
          policy.MakeRoom(r, static_cast<int64_t>(pick(2500)), now += 10);
      if (orders.ok()) {
        ++rooms;
        for (const auto& [owner, list] : *orders) {
          // Only sessions above their share, or the one asking, lose.
          if (owner != r) {
            EXPECT_GT(was[owner].device_bytes, was[owner].budget_bytes)
                << "round " << round;
          }
          for (const v1::ReleaseOrder& o : list) take(owner, o);
        }
      } else {
        ASSERT_TRUE(absl::IsResourceExhausted(orders.status()))
            << orders.status();
        ASSERT_EQ(usages(), room_before) << "round " << round;
      }
      check(round);
    }

    std::vector<SessionUsage> was(kSessions + 1);
    for (SessionId x = 1; x <= kSessions; ++x) was[x] = *policy.Usage(x);
    for (const auto& [owner, orders] : policy.Plan(s, now += 10)) {
      if (owner != s) {
        EXPECT_GT(was[owner].device_bytes, was[owner].budget_bytes)
            << "round " << round;
        EXPECT_EQ(orders.prefetch_tensor_ids_size(), 0);
      }
      for (const v1::ReleaseOrder& o : orders.release()) take(owner, o);
      for (uint64_t id : orders.prefetch_tensor_ids()) {
        auto it = model[owner].find(id);
        ASSERT_NE(it, model[owner].end());
        ASSERT_EQ(it->second.state, M::kIsOffloaded);
        it->second.state = M::kIsReloading;
        ++prefetches;
      }
    }
    check(round);

    if (chance(2)) {  // budgets move as sessions come and go
      ASSERT_TRUE(policy
                      .SetBudget(1 + pick(kSessions),
                                 static_cast<int64_t>(500 + pick(4000)))
                      .ok());
    }
    if (chance(1)) {  // a process ends and another takes its place
      const SessionId x = 1 + pick(kSessions);
      ASSERT_TRUE(policy.RemoveSession(x).ok());
      model[x].clear();
      ASSERT_TRUE(policy.AddSession(x, kBudget, 1500).ok());
      check(round);
    }
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure()) {
      FAIL() << "stopped at round " << round;
    }
  }
  std::cout << "failed batches " << failed_batches << ", rooms made " << rooms
            << ", releases " << releases << ", prefetches " << prefetches
            << "\n";
  // The run must have exercised what it claims to.
  EXPECT_GT(failed_batches, 100);
  EXPECT_GT(rooms, 100);
  EXPECT_GT(releases, 100);
  EXPECT_GT(prefetches, 20);
}

// Regression: orders for a session without a stream were dropped by the
// service while the policy already counted their tensors as released; the
// process never heard of them and every later event on them was refused.
TEST_F(GpuPolicyTest, UndeliverableOrdersAreUndone) {
  Make(1000);
  AddSession(1, 500);
  AddSession(2, 500);
  v1::EventBatch b;
  AddCreated(b, 1, 500);
  AddCreated(b, 2, 10);
  ASSERT_TRUE(Apply(2, b).ok());
  v1::EventBatch a;
  AddCreated(a, 1, 490);
  ASSERT_TRUE(Apply(1, a).ok());
  auto orders = policy_->MakeRoom(1, 10, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_TRUE(orders->contains(2));
  EXPECT_EQ(policy_->Usage(2)->device_bytes, 500);
  v1::Orders lost;
  for (const v1::ReleaseOrder& o : orders->at(2)) *lost.add_release() = o;
  policy_->Undeliverable(2, lost);
  EXPECT_EQ(policy_->Usage(2)->device_bytes, 510);
  // The tensor is the session's again: an access is accepted.
  v1::EventBatch touch;
  AddEvent(touch, v1::TensorEvent::ACCESSED, 2);
  EXPECT_TRUE(Apply(2, touch).ok());
}

TEST_F(GpuPolicyTest, ASessionWithoutAStreamIsNeverAVictimOfAnother) {
  Make(1000);
  AddSession(1, 500);
  AddSession(2, 500);
  v1::EventBatch b;
  AddCreated(b, 1, 510);
  ASSERT_TRUE(Apply(2, b).ok());                      // over its share, but
  ASSERT_TRUE(policy_->SetReachable(2, false).ok());  // its stream is gone
  v1::EventBatch a;
  AddCreated(a, 1, 490);
  ASSERT_TRUE(Apply(1, a).ok());
  // Within its share, 1 answers for none of 2's excess.
  auto orders = policy_->MakeRoom(1, 10, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(*orders, IsEmpty());
  // Past it, the requester pays itself.
  orders = policy_->MakeRoom(1, 20, now_);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_FALSE(orders->contains(2));
  EXPECT_TRUE(orders->contains(1));
  EXPECT_EQ(policy_->SetReachable(9, true).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace deltad::daemon
