// Bringing released storages back: a prefetch that would land too late
// can give way to a rebuild, memory held by prefetches still copying in
// never fails an allocation, and an empty storage waits for no copy.

#include <functional>
#include <string>

#include "gtest/gtest.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "tests/unit/sim/simulator_test_helpers.h"

namespace deltad::sim {
namespace {

using testing_util::ChainTrace;
using testing_util::Compiled;
using testing_util::TestDevice;

using Chain = testing_util::ScriptedChain;
using testing_util::Scripted;

// a0 offloaded once the forward pass is done with it, and prefetched just
// before the step that reads it: the copy would end a whole step later.
void OffloadThenPrefetchLate(Scripted& policy, const Chain& run) {
  policy.after_step = [&run](SimContext& ctx, int32_t step) {
    if (step == 1) {
      ASSERT_TRUE(ctx.Offload(run.a0));
    }
    if (step == 6) {
      ASSERT_TRUE(ctx.Prefetch(run.a0));
    }
  };
}

TEST(Restore, APrefetchThatWouldLandLateGivesWayToACheaperRebuild) {
  Chain run;
  Scripted policy;
  OffloadThenPrefetchLate(policy, run);
  int64_t asked = -1;
  policy.restore = [&](int64_t reload_ns) {
    asked = reload_ns;
    return Restore::kRecompute;
  };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(asked, 1000);  // the copy's time still to run
  EXPECT_EQ(r.prefetches, 1);
  EXPECT_EQ(r.recomputes, 1);
  EXPECT_EQ(r.recompute_ns, 1000);
  EXPECT_EQ(r.stall_ns, 0);
}

TEST(Restore, APrefetchThatWouldLandLateIsWaitedForWhereTheReloadIsCheaper) {
  Chain run;
  Scripted policy;
  OffloadThenPrefetchLate(policy, run);
  policy.restore = [](int64_t) { return Restore::kReload; };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.recomputes, 0);
  EXPECT_EQ(r.stall_ns, 1000);
}

TEST(Restore, PrefetchesStillCopyingInNeverFailAnAllocation) {
  Chain run;
  Scripted policy;
  // a0 goes out after step 1 and comes back after step 4, while the room
  // its copy takes is what step 5's allocation lacks; a0 alone may be
  // released, and only once it has landed.
  policy.after_step = [&run](SimContext& ctx, int32_t step) {
    if (step == 1) {
      ASSERT_TRUE(ctx.Offload(run.a0));
    }
    if (step == 4) {
      ASSERT_TRUE(ctx.Prefetch(run.a0));
    }
  };
  int refused = 0;
  policy.make_room = [&](SimContext& ctx, int64_t) {
    if (ctx.state(run.a0) != StorageState::kResident) {
      ++refused;
      return false;
    }
    return ctx.Evict(run.a0);
  };
  // x, the weights, a1, a2 and g3 after step 4 (4256 bytes), the prefetch
  // of a0 (1000): step 5's gradient (1000) does not fit beside them.
  const SimResult r = run.Go(policy, 5256 + 999);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_GT(refused, 0);  // asked while a0 was still copying in
  EXPECT_EQ(r.prefetches, 1);
  EXPECT_EQ(r.evictions, 1);
  EXPECT_GT(r.stall_ns, 0);  // the wait for a0 to land
}

TEST(Restore, AnEmptyStorageWaitsForNoCopyQueuedOnTheLink) {
  TraceBuilder b("empty");
  const int32_t x = b.Constant("x", 1000);
  b.Op("make", Phase::kForward, 1000).Input(x);
  const int32_t e = b.Output("e", 0);
  const int32_t big = b.Output("big", 100000);
  b.Op("long_forward", Phase::kForward, 200000).Input(x);
  b.Output("w", 8);
  b.Op("use_e", Phase::kBackward, 1000).Input(e);
  b.Output("g", 8);
  b.Release(e);
  b.Op("long_backward", Phase::kBackward, 200000).Input(x);
  b.Output("h", 8);
  b.Op("use_big", Phase::kBackward, 1000).Input(big);
  b.Output("k", 8);
  b.Release(big);
  const Program program = Compiled(std::move(b).Build());
  const int32_t e_storage = program.steps[0].creates[0];
  const int32_t big_storage = program.steps[0].creates[1];
  Scripted policy;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    if (step == 0) {
      ASSERT_TRUE(ctx.Offload(e_storage));
      ASSERT_TRUE(ctx.Offload(big_storage));
    }
    // big comes back over the next 100 us, while e is read.
    if (step == 1) {
      ASSERT_TRUE(ctx.Prefetch(big_storage));
    }
  };
  SimOptions o;
  o.budget_bytes = int64_t{1} << 30;
  auto r = Simulate(program, TestDevice(), policy, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->fits) << r->failure;
  EXPECT_EQ(r->h2d_bytes, 100000);
  EXPECT_EQ(r->stall_ns, 0);
}

}  // namespace
}  // namespace deltad::sim
