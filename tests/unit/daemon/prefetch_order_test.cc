#include "daemon/prefetch_order.h"

#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using Choice = PrefetchOrder::Choice;
constexpr int64_t kMs = 1000000;

// Reads keys 1..n, 100 bytes each, as one iteration does.
void ReadAll(PrefetchOrder& o, int n = 4) {
  for (int k = 1; k <= n; ++k) o.OnAccess(static_cast<uint64_t>(k), 100);
}

// Ends iterations of the given lengths, each after reading every key;
// returns the clock at the end.
int64_t Iterations(PrefetchOrder& o, std::initializer_list<int64_t> ms,
                   int64_t now = 0) {
  for (int64_t m : ms) {
    ReadAll(o);
    now += m * kMs;
    o.EndIteration(now);
  }
  return now;
}

TEST(PrefetchOrder, ReplaysTheSecondIterationQueuesTheThirdAndKeepsTheFaster) {
  PrefetchOrder o(/*max_accesses=*/1000, /*window_fraction=*/0.25);
  EXPECT_EQ(o.plan(), nullptr);  // the first iteration records
  ReadAll(o);
  EXPECT_FALSE(o.EndIteration(50 * kMs));
  ASSERT_NE(o.plan(), nullptr);  // the second replays the first's order
  EXPECT_TRUE(o.plan()->has_plan());
  ReadAll(o);
  EXPECT_FALSE(o.EndIteration(150 * kMs));  // 100 ms
  EXPECT_EQ(o.plan(), nullptr);             // the third uses the queue
  EXPECT_EQ(o.choice(), Choice::kUndecided);
  ReadAll(o);
  EXPECT_TRUE(o.EndIteration(270 * kMs));  // 120 ms: the replay was faster
  EXPECT_EQ(o.choice(), Choice::kReplay);
  EXPECT_EQ(o.replay_ns(), 100 * kMs);
  EXPECT_EQ(o.queue_ns(), 120 * kMs);
  EXPECT_NE(o.plan(), nullptr);
  Iterations(o, {500, 500}, 270 * kMs);  // kept, whatever later ones take
  EXPECT_NE(o.plan(), nullptr);
  EXPECT_EQ(o.choice(), Choice::kReplay);
}

TEST(PrefetchOrder, KeepsTheQueueWhenItsIterationWasFaster) {
  PrefetchOrder o(1000, 0.25);
  Iterations(o, {50, 100, 90});
  EXPECT_EQ(o.choice(), Choice::kQueue);
  EXPECT_EQ(o.plan(), nullptr);
  Iterations(o, {10, 10}, 1000 * kMs);
  EXPECT_EQ(o.plan(), nullptr);
}

TEST(PrefetchOrder, AWindowOfZeroNeverReplays) {
  PrefetchOrder o(1000, 0);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(o.plan(), nullptr) << i;
    Iterations(o, {10}, i * 10 * kMs);
  }
  EXPECT_EQ(o.choice(), Choice::kQueue);
  EXPECT_EQ(o.replay_ns(), -1);
}

TEST(PrefetchOrder, AnIterationPastTheAccessLimitLeavesNoPlanToReplay) {
  PrefetchOrder o(/*max_accesses=*/3, 0.25);
  ReadAll(o, 4);  // one access more than the record holds
  o.EndIteration(10 * kMs);
  EXPECT_EQ(o.plan(), nullptr);
  // Nothing replayed: the trial keeps the queue.
  Iterations(o, {5, 50}, 10 * kMs);
  EXPECT_EQ(o.choice(), Choice::kQueue);
}

TEST(PrefetchOrder, TensorsWithoutAStableKeyAreNotRecorded) {
  PrefetchOrder o(1000, 0.25);
  o.OnAccess(0, 100);
  o.EndIteration(kMs);
  EXPECT_EQ(o.plan(), nullptr);
}

TEST(PrefetchOrder, TheWindowIsTheFractionOfTheBudget) {
  EXPECT_EQ(PrefetchOrder(1000, 0.25).WindowBytes(1000), 250);
  EXPECT_EQ(PrefetchOrder(1000, 0).WindowBytes(1000), 0);
}

}  // namespace
}  // namespace deltad::daemon
