// Tests of the Director (DELTA Algorithm 3 and eq. 4) and of its choice
// between reload and recompute for an offloaded tensor (DELTA §5.5).

#include "policies/director.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/cost_model.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {
namespace {

using ::testing::HasSubstr;

// With 1 GB/s both ways, copying b bytes takes b ns each way, so a tensor of
// b bytes has c_s = 2b ns.
constexpr double kOneGBps = 1e9;
constexpr int64_t kPlenty = int64_t{1} << 40;  // host bytes

TensorFlags Flags(bool evict_pinned, bool offload_pinned, bool uncomputable) {
  TensorFlags f;
  f.evict_pinned = evict_pinned;
  f.offload_pinned = offload_pinned;
  f.uncomputable = uncomputable;
  return f;
}

TensorSpec Spec(TensorId id, int64_t bytes, int64_t compute_cost_ns,
                std::vector<TensorId> parents = {}, TensorFlags flags = {}) {
  TensorSpec s;
  s.id = id;
  s.session = 1;
  s.gpu = 0;
  s.bytes = bytes;
  s.compute_cost_ns = compute_cost_ns;
  s.parents = std::move(parents);
  s.flags = flags;
  return s;
}

class DirectorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(costs_.SetBandwidth(0, {kOneGBps, kOneGBps}).ok());
  }

  void Add(const TensorSpec& spec) {
    const absl::Status s = table_.Add(spec, 0);
    ASSERT_TRUE(s.ok()) << s;
  }
  void Evict(TensorId id) {
    const absl::Status s = table_.SetState(id, TensorState::kEvicted);
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::StatusOr<ReleaseAction> Decide(TensorId id,
                                       int64_t host = kPlenty) const {
    return director_.Decide(table_, table_.SlotOf(id), host);
  }
  double F(TensorId id) const {
    return director_.DecisionScore(table_, table_.SlotOf(id));
  }
  RestoreAction Restore(TensorId id) const {
    return director_.ChooseRestore(table_, table_.SlotOf(id));
  }

  CostModel costs_;
  Director director_{costs_};
  TensorTable table_;
};

// A 1000-byte tensor: c_s = 2000 ns.
constexpr int64_t kBytes = 1000;
constexpr int64_t kSwapNs = 2000;

TEST_F(DirectorTest, CheapRecomputeIsEvicted) {
  Add(Spec(1, kBytes, 1500));  // F = 0.75
  EXPECT_DOUBLE_EQ(F(1), 0.75);
  absl::StatusOr<ReleaseAction> a = Decide(1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, ReleaseAction::kEvict);
}

TEST_F(DirectorTest, RecomputeCostEqualToSwapCostIsEvicted) {
  Add(Spec(1, kBytes, kSwapNs));  // F = 1: "if s_d <= 1 then Evict"
  EXPECT_DOUBLE_EQ(F(1), 1.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
}

TEST_F(DirectorTest, ExpensiveRecomputeIsOffloaded) {
  Add(Spec(1, kBytes, kSwapNs + 1));  // F just above 1
  EXPECT_GT(F(1), 1.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
}

TEST_F(DirectorTest, SwapCostCountsBothDirections) {
  // Reload at half speed: c_s = 1000 + 2000 = 3000 ns, so a recompute cost
  // of 2500 ns (F = 0.83) is worth evicting; with the symmetric link
  // (c_s = 2000, F = 1.25) it is not.
  Add(Spec(1, kBytes, 2500));
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
  ASSERT_TRUE(costs_.SetBandwidth(0, {kOneGBps, kOneGBps / 2}).ok());
  EXPECT_DOUBLE_EQ(F(1), 2500.0 / 3000.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
}

TEST_F(DirectorTest, EvictPinnedIsOffloadedEvenWhenRecomputeIsCheap) {
  Add(Spec(1, kBytes, 0, {}, Flags(true, false, false)));
  ASSERT_LE(F(1), 1.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
}

TEST_F(DirectorTest, OffloadPinnedIsEvictedEvenWhenRecomputeIsExpensive) {
  Add(Spec(1, kBytes, 100 * kSwapNs, {}, Flags(false, true, false)));
  ASSERT_GT(F(1), 1.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
  EXPECT_EQ(*Decide(1, /*host=*/0), ReleaseAction::kEvict);
}

TEST_F(DirectorTest, UncomputableIsOffloadedEvenWhenRecomputeLooksCheap) {
  Add(Spec(1, kBytes, 0, {}, Flags(false, false, true)));
  ASSERT_LE(F(1), 1.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
}

TEST_F(DirectorTest, HostPoolShortOfTheTensorFallsBackToEvict) {
  Add(Spec(1, kBytes, 10 * kSwapNs));  // F = 10: offload preferred
  EXPECT_EQ(*Decide(1, kBytes), ReleaseAction::kOffload);  // exactly fits
  EXPECT_EQ(*Decide(1, kBytes - 1), ReleaseAction::kEvict);
  EXPECT_EQ(*Decide(1, 0), ReleaseAction::kEvict);
}

TEST_F(DirectorTest, ATensorCopiedAheadIsPricedAtItsReloadAlone) {
  // c_r = 1500 ns against a swap of 2000 (F = 0.75): evicted. Once its
  // bytes are on the host, a swap costs the reload alone (1000: F = 1.5).
  Add(Spec(1, kBytes, 1500));
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
  ASSERT_TRUE(table_.SetHostCopy(1, true).ok());
  EXPECT_DOUBLE_EQ(F(1), 1.5);
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
  // Its copy's room is part of what the host has free (copies give way to
  // offloads): with none free, the copy is not there to take.
  EXPECT_EQ(*Decide(1, /*host=*/0), ReleaseAction::kEvict);
}

TEST_F(DirectorTest, ALandedCopyIsOffloadedWhereARestoreMayRebuildIt) {
  // c_r = 100 ns against a reload of 1000 (F = 0.1): F evicts it. Where
  // its restore may still rebuild it, offloading frees as much at once
  // and can cost no more later.
  Add(Spec(1, kBytes, 100));
  ASSERT_TRUE(table_.SetHostCopy(1, true).ok());
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
  const Director rebuilding(costs_, {.restore_may_recompute = true});
  EXPECT_EQ(*rebuilding.Decide(table_, table_.SlotOf(1), kPlenty),
            ReleaseAction::kOffload);
  // Without a copy on the host, or without host room, F decides.
  Add(Spec(2, kBytes, 100));
  EXPECT_EQ(*rebuilding.Decide(table_, table_.SlotOf(2), kPlenty),
            ReleaseAction::kEvict);
  EXPECT_EQ(*rebuilding.Decide(table_, table_.SlotOf(1), /*host=*/0),
            ReleaseAction::kEvict);
}

TEST_F(DirectorTest, BothPinnedCannotBeReleased) {
  Add(Spec(7, kBytes, 0, {}, Flags(true, true, false)));
  absl::StatusOr<ReleaseAction> a = Decide(7);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << a.status();
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("tensor 7"));
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("both"));
}

TEST_F(DirectorTest, UncomputableWithoutHostRoomCannotBeReleased) {
  Add(Spec(7, kBytes, 0, {}, Flags(false, false, true)));
  absl::StatusOr<ReleaseAction> a = Decide(7, kBytes - 1);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << a.status();
  // The message says what is short.
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("999"));
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("1000"));
}

TEST_F(DirectorTest, EvictPinnedWithoutHostRoomCannotBeReleased) {
  Add(Spec(7, kBytes, 0, {}, Flags(true, false, false)));
  absl::StatusOr<ReleaseAction> a = Decide(7, 0);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << a.status();
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("host"));
}

TEST_F(DirectorTest, OffloadPinnedAndUncomputableCannotBeReleased) {
  Add(Spec(7, kBytes, 0, {}, Flags(false, true, true)));
  absl::StatusOr<ReleaseAction> a = Decide(7);
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(a.status())) << a.status();
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("offload-pinned"));
}

TEST_F(DirectorTest, CanReleaseAgreesWithDecideForEveryFlagCombination) {
  TensorId id = 1;
  for (int bits = 0; bits < 8; ++bits) {
    const TensorFlags flags = Flags(bits & 1, bits & 2, bits & 4);
    for (int64_t cost : {int64_t{0}, 10 * kSwapNs}) {
      Add(Spec(id, kBytes, cost, {}, flags));
      const Tensor& t = *table_.Find(id);
      for (int64_t host : {int64_t{0}, kBytes - 1, kBytes, kPlenty}) {
        absl::StatusOr<ReleaseAction> a = Decide(id, host);
        EXPECT_EQ(director_.CanRelease(t, host), a.ok())
            << "flags " << bits << " cost " << cost << " host " << host;
        if (!a.ok()) continue;
        // Whatever is decided must be allowed by the flags and the pool.
        if (*a == ReleaseAction::kEvict) {
          EXPECT_FALSE(flags.evict_pinned || flags.uncomputable) << bits;
        } else {
          EXPECT_FALSE(flags.offload_pinned) << bits;
          EXPECT_GE(host, kBytes) << bits;
        }
      }
      ++id;
    }
  }
}

TEST_F(DirectorTest, RecomputeCostCountsEvictedAncestorComponents) {
  // G -> P -> T; T is 1000 bytes (c_s = 2000) with its own cost 500.
  Add(Spec(1, 600, 1000));         // G
  Add(Spec(2, 600, 1000, {1}));    // P
  Add(Spec(3, kBytes, 500, {2}));  // T
  Add(Spec(4, 10, 1000000, {3}));  // C, a child of T
  EXPECT_DOUBLE_EQ(F(3), 500.0 / kSwapNs);
  EXPECT_EQ(*Decide(3), ReleaseAction::kEvict);

  Evict(2);  // c_r = 500 + 1000
  EXPECT_DOUBLE_EQ(F(3), 1500.0 / kSwapNs);
  EXPECT_EQ(*Decide(3), ReleaseAction::kEvict);

  Evict(1);  // G joins P's component: c_r = 500 + 2000
  EXPECT_DOUBLE_EQ(F(3), 2500.0 / kSwapNs);
  EXPECT_EQ(*Decide(3), ReleaseAction::kOffload);

  // An evicted child is not needed to rebuild T.
  Evict(4);
  EXPECT_DOUBLE_EQ(F(3), 2500.0 / kSwapNs);

  // Rebuilding P leaves G evicted but no longer adjacent to T.
  ASSERT_TRUE(table_.MarkRecomputed(2, 0).ok());
  EXPECT_DOUBLE_EQ(F(3), 500.0 / kSwapNs);
}

TEST_F(DirectorTest, RecomputeCostCountsASharedComponentOnce) {
  // G -> P1 -> T and G -> P2 -> T: P1, P2 and G form one component.
  Add(Spec(1, 10, 100));             // G
  Add(Spec(2, 10, 200, {1}));        // P1
  Add(Spec(3, 10, 400, {1}));        // P2
  Add(Spec(4, kBytes, 50, {2, 3}));  // T
  for (TensorId id : {1, 2, 3}) Evict(id);
  EXPECT_DOUBLE_EQ(F(4), (50.0 + 100 + 200 + 400) / kSwapNs);
}

TEST_F(DirectorTest, FreedParentStillNeededCountsInRecomputeCost) {
  Add(Spec(1, 10, 3000));
  Add(Spec(2, kBytes, 100, {1}));
  // The framework drops the parent; the child may still need it rebuilt.
  ASSERT_TRUE(table_.Free(1).ok());
  EXPECT_DOUBLE_EQ(F(2), 3100.0 / kSwapNs);
  EXPECT_EQ(*Decide(2), ReleaseAction::kOffload);
}

TEST_F(DirectorTest, OffloadedOrResidentParentsAreNotRecomputeCost) {
  Add(Spec(1, 10, 3000));
  Add(Spec(2, kBytes, 100, {1}));
  ASSERT_TRUE(table_.SetState(1, TensorState::kOffloading).ok());
  ASSERT_TRUE(table_.SetState(1, TensorState::kOffloaded).ok());
  EXPECT_DOUBLE_EQ(F(2), 100.0 / kSwapNs);
}

TEST_F(DirectorTest, UncomputableOffloadedTensorIsReloaded) {
  Add(Spec(1, kBytes, 0, {}, Flags(false, false, true)));
  EXPECT_EQ(Restore(1), RestoreAction::kReload);
}

TEST_F(DirectorTest, CheapRecomputeIsPreferredToReload) {
  // Reload of 1000 bytes takes 1000 ns.
  Add(Spec(1, kBytes, 999));
  EXPECT_EQ(Restore(1), RestoreAction::kRecompute);
}

TEST_F(DirectorTest, ExpensiveRecomputeIsReloaded) {
  Add(Spec(1, kBytes, 1000));  // a tie is not cheaper
  Add(Spec(2, kBytes, 5000));
  EXPECT_EQ(Restore(1), RestoreAction::kReload);
  EXPECT_EQ(Restore(2), RestoreAction::kReload);
}

TEST_F(DirectorTest, RestoreCountsEvictedAncestorsInRecomputeCost) {
  Add(Spec(1, 10, 800));
  Add(Spec(2, kBytes, 100, {1}));
  EXPECT_EQ(Restore(2), RestoreAction::kRecompute);
  Evict(1);  // 100 + 800 ns: still under 1000
  EXPECT_EQ(Restore(2), RestoreAction::kRecompute);
  Add(Spec(3, 10, 200));
  Add(Spec(4, kBytes, 100, {1, 3}));
  Evict(3);  // 100 + 800 + 200 > 1000
  EXPECT_EQ(Restore(4), RestoreAction::kReload);
}

TEST_F(DirectorTest, RestoreComparesWithReloadOnlyNotTheRoundTrip) {
  // 1500 ns to recompute; reload 1000 ns; a round trip would be 2000 ns.
  Add(Spec(1, kBytes, 1500));
  EXPECT_EQ(Restore(1), RestoreAction::kReload);
  // A slower reload link makes recomputing worth it.
  ASSERT_TRUE(costs_.SetBandwidth(0, {kOneGBps, kOneGBps / 2}).ok());
  EXPECT_EQ(Restore(1), RestoreAction::kRecompute);
}

TEST_F(DirectorTest, RestoreComparesWithAReloadAlreadyUnderWay) {
  // 1500 ns to recompute, 1000 to reload: a reload. A prefetch already
  // copying it in that ends in 2000 ns: rebuilding is sooner; in 500 ns:
  // waiting is.
  Add(Spec(1, kBytes, 1500));
  const uint32_t slot = table_.SlotOf(1);
  EXPECT_EQ(Restore(1), RestoreAction::kReload);
  EXPECT_EQ(director_.ChooseRestore(table_, slot, 2000),
            RestoreAction::kRecompute);
  EXPECT_EQ(director_.ChooseRestore(table_, slot, 500), RestoreAction::kReload);
}

TEST_F(DirectorTest, ACopysLatencyIsPartOfItsPrice) {
  // 1000 bytes at 1 GB/s and 500 ns a copy: 1500 ns each way.
  ASSERT_TRUE(costs_.SetBandwidth(0, {kOneGBps, kOneGBps, 500}).ok());
  Add(Spec(1, kBytes, 2900));
  EXPECT_DOUBLE_EQ(F(1), 2900.0 / 3000.0);
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
  EXPECT_EQ(Restore(1), RestoreAction::kReload);  // 2900 against 1500
}

TEST_F(DirectorTest, RestoreReloadsEvictPinnedEvenWhenRecomputeIsCheaper) {
  // 10 ns to recompute against 1000 ns to reload, but evict_pinned forbids
  // rebuilding the bytes.
  Add(Spec(1, kBytes, 10, {}, Flags(true, false, false)));
  EXPECT_EQ(Restore(1), RestoreAction::kReload);
  Add(Spec(2, kBytes, 10));
  EXPECT_EQ(Restore(2), RestoreAction::kRecompute);
}

TEST(DirectorNamesTest, ActionsHaveNames) {
  EXPECT_EQ(ReleaseActionName(ReleaseAction::kOffload), "offload");
  EXPECT_EQ(ReleaseActionName(ReleaseAction::kEvict), "evict");
  EXPECT_EQ(RestoreActionName(RestoreAction::kReload), "reload");
  EXPECT_EQ(RestoreActionName(RestoreAction::kRecompute), "recompute");
}

TEST_F(DirectorTest, OffloadBacklogTurnsAnOffloadIntoAnEviction) {
  // c_r = 3000 ns against c_s = 2000 ns: offloaded on an idle link.
  Add(Spec(1, kBytes, 3000));
  EXPECT_EQ(*Decide(1), ReleaseAction::kOffload);
  // 1500 bytes already queued: the memory is free only after 2500 ns, and
  // the round trip prices at 3500 ns, dearer than recomputing.
  costs_.SetOffloadBacklog(0, 1500);
  EXPECT_EQ(*Decide(1), ReleaseAction::kEvict);
  // The same through bytes the caller is about to queue itself.
  costs_.SetOffloadBacklog(0, 0);
  EXPECT_EQ(*director_.Decide(table_, table_.SlotOf(1), kPlenty, 1500),
            ReleaseAction::kEvict);
}

}  // namespace
}  // namespace deltad::policy
