// Tests of how GpuPolicy accounts what sessions report: the daemon cannot
// check a reported size, so a session's claims beyond its share count
// against itself alone. A claim beyond the whole GPU is refused; claims
// within it, pinned or not, never fail another session's Release within
// its share nor cost that session its tensors.

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "daemon/gpu_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/gpu_policy_fixture.h"

namespace deltad::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

Flags Pinned() {
  Flags pinned;
  pinned.evict_pinned = pinned.offload_pinned = true;
  return pinned;
}

TEST_F(GpuPolicyTest, ABatchClaimingMoreThanTheGpuIsRefusedWhole) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kA, 1, 1, 400, Cost::kCheap, Pinned());
  const std::string before = AllUsage();
  v1::EventBatch batch;
  AddCreated(batch, 2, 350);
  AddCreated(batch, 3, 350);
  const absl::Status refused = Apply(kA, batch);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("session 1 would hold 1100 bytes"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("EventBatch.created"));
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("whole budget of 1000 bytes"));
  EXPECT_EQ(AllUsage(), before);
  // Counted as the batch leaves it: freeing 1 in the same batch fits.
  AddEvent(batch, kFreed, 1);
  EXPECT_TRUE(Apply(kA, batch).ok());
  EXPECT_EQ(U(kA).device_bytes, 700);
}

TEST_F(GpuPolicyTest, AReloadThatWouldClaimMoreThanTheGpuIsRefused) {
  Make(1000);
  AddSession(kA, 1000);
  Fill(kA, 1, 1, 600, Cost::kCostly);
  ASSERT_TRUE(Apply(kA, Events({{kOffloaded, 1}})).ok());
  Fill(kA, 2, 1, 500);
  const absl::Status refused = Apply(kA, Events({{kReloaded, 1}}));
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("would hold 1100"));
  EXPECT_EQ(U(kA).device_bytes, 500);
  // With room made first, it fits.
  ASSERT_TRUE(Apply(kA, Events({{kFreed, 2}})).ok());
  EXPECT_TRUE(Apply(kA, Events({{kReloaded, 1}})).ok());
}

// The attack of issue #17: sessions report pinned tensors they never
// allocated, more than the GPU holds in all, and an honest session within
// its share then asks for room.
TEST_F(GpuPolicyTest, ClaimsBeyondOthersSharesNeverFailAReleaseWithinShare) {
  Make(300);
  AddSession(kA, 100);
  AddSession(kB, 100);
  AddSession(kC, 100);
  Fill(kA, 1, 2, 100, Cost::kCheap, Pinned());
  Fill(kA, 3, 1, 100);  // the one tensor of the claims that can go
  Fill(kC, 1, 3, 100, Cost::kCheap, Pinned());
  Fill(kB, 1, 1, 10);
  ASSERT_EQ(policy_->device_bytes(), 610);
  const std::string b_before = UsageString(U(kB));
  // B will hold 60, within its share of 100: the GPU lacks 360, all of it
  // A's and C's excess. What of it can go goes; the rest is theirs.
  auto orders = MakeRoom(kB, 50);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kA));
  EXPECT_THAT(Ids((*orders)[kA]), ElementsAre(3));
  EXPECT_EQ(UsageString(U(kB)), b_before);
  // B allocates, and may go on up to its share without losing a tensor.
  v1::EventBatch allocated;
  AddCreated(allocated, 2, 50);
  ASSERT_TRUE(Apply(kB, allocated).ok());
  orders = MakeRoom(kB, 40);
  ASSERT_TRUE(orders.ok()) << orders.status();
  EXPECT_THAT(*orders, IsEmpty());
  EXPECT_EQ(U(kB).device_bytes, 60);
  EXPECT_EQ(U(kB).releases_ordered, 0u);
}

TEST_F(GpuPolicyTest, ASessionPastItsShareStillAnswersForItsOwnExcess) {
  Make(300);
  AddSession(kA, 150);
  AddSession(kB, 150);
  Fill(kA, 1, 3, 100, Cost::kCheap, Pinned());
  Fill(kB, 1, 1, 100, Cost::kCheap, Pinned());
  Fill(kB, 2, 1, 40);
  const std::string before = AllUsage();
  // B would hold 200, 50 above its share: A's claims are not its to
  // answer for, but its own excess is, and it can free only 40.
  auto orders = MakeRoom(kB, 60);
  ASSERT_FALSE(orders.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(orders.status())) << orders.status();
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("50 of them from the asking session"));
  EXPECT_THAT(std::string(orders.status().message()),
              HasSubstr("can free at most 40 bytes"));
  EXPECT_EQ(AllUsage(), before);
  // Within what it can free, it gets room from its own tensors only.
  orders = MakeRoom(kB, 50);
  ASSERT_TRUE(orders.ok()) << orders.status();
  ASSERT_THAT(Keys(*orders), ElementsAre(kB));
  EXPECT_THAT(Ids((*orders)[kB]), ElementsAre(2));
}

TEST_F(GpuPolicyTest, PlanOffloadsNoSessionAheadForAnothersClaims) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kB, 1, 2, 100, Cost::kCostly);  // would rather be offloaded
  Fill(kA, 1, 10, 100, Cost::kCostly, Pinned());
  // The GPU is past its high watermark only through A's excess, which it
  // cannot offload: B, within its share, keeps its tensors.
  EXPECT_THAT(Plan(kB), IsEmpty());
  EXPECT_EQ(U(kB).device_bytes, 200);
  // At its whole share B is past the mark on its own account (A counting
  // up to its share), and offloads ahead down to the low mark: 350 bytes.
  Fill(kB, 3, 3, 100, Cost::kCostly);
  std::map<SessionId, v1::Orders> orders = Plan(kB);
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_THAT(Ids(orders[kB]), ElementsAre(1, 2, 3, 4));
}

TEST_F(GpuPolicyTest, ClaimsBeyondAnothersShareNeverStopAPrefetch) {
  Make(1000);
  AddSession(kA, 500);
  AddSession(kB, 500);
  Fill(kB, 1, 2, 100);
  ASSERT_TRUE(Apply(kB, Events({{kOffloaded, 1}, {kOffloaded, 2}})).ok());
  // A claims 900 bytes, 400 past its share, so the GPU is past its high
  // watermark only through A's excess.
  Fill(kA, 1, 9, 100, Cost::kCostly, Pinned());
  // B holds nothing of its share: its offloaded tensors come back ahead of
  // use, newest first.
  EXPECT_THAT(Plan(kB)[kB].prefetch_tensor_ids(), ElementsAre(2, 1));
}

}  // namespace
}  // namespace deltad::daemon
