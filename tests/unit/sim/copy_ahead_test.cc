// Copies made ahead of need (SimContext::CopyAhead): the engine keeps the
// storage on the device with a host copy, an offload of a landed copy frees
// its memory at once, and `delta` uses them to stop waiting for releases.

#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "tests/unit/sim/simulator_test_helpers.h"

namespace deltad::sim {
namespace {

using testing_util::ChainTrace;
using testing_util::Compiled;
using testing_util::RunPolicy;
using testing_util::TestDevice;

using Chain = testing_util::ScriptedChain;
using testing_util::Scripted;

TEST(CopyAhead, ALandedCopyIsOffloadedAtOnceWithoutAnotherCopy) {
  Chain run;
  Scripted policy;
  int64_t d2h_before_offload = -1;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    const int32_t a0 = run.a0;
    if (step == 0) {
      EXPECT_TRUE(ctx.CopyAhead(a0));
      EXPECT_FALSE(ctx.CopyAhead(a0));  // one copy at a time
      EXPECT_EQ(ctx.host_copy(a0), HostCopy::kCopying);
      EXPECT_EQ(ctx.state(a0), StorageState::kResident);
    } else if (step == 1) {  // a step later: landed, still on the device
      EXPECT_EQ(ctx.host_copy(a0), HostCopy::kLanded);
      EXPECT_EQ(ctx.state(a0), StorageState::kResident);
      const int64_t used = ctx.device_used();
      d2h_before_offload = ctx.d2h_free_at();
      EXPECT_TRUE(ctx.Offload(a0));
      EXPECT_EQ(ctx.state(a0), StorageState::kOffloaded);
      EXPECT_EQ(ctx.device_used(), used - 1000);
      EXPECT_EQ(ctx.releasing_bytes(), 0);
      EXPECT_EQ(ctx.d2h_free_at(), d2h_before_offload);  // no copy queued
      EXPECT_EQ(ctx.host_copy(a0), HostCopy::kNone);
    }
  };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.copies_ahead, 1);
  EXPECT_EQ(r.offloads, 1);
  EXPECT_EQ(r.offloads_from_copies, 1);
  EXPECT_EQ(r.d2h_bytes, 1000);  // the copy ahead, once
  EXPECT_EQ(r.h2d_bytes, 1000);  // a0 read back in backward
}

TEST(CopyAhead, AnOffloadDuringTheCopyEndsWithIt) {
  Chain run;
  Scripted policy;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    if (step != 0) return;
    ASSERT_TRUE(ctx.CopyAhead(run.a0));
    const int64_t lands = ctx.d2h_free_at();
    EXPECT_TRUE(ctx.Offload(run.a0));
    EXPECT_EQ(ctx.state(run.a0), StorageState::kOffloading);
    EXPECT_EQ(ctx.releasing_bytes(), 1000);
    EXPECT_EQ(ctx.d2h_free_at(), lands);  // the copy in flight serves it
  };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.d2h_bytes, 1000);
  EXPECT_EQ(r.offloads, 1);
  EXPECT_EQ(r.offloads_from_copies, 0);
}

TEST(CopyAhead, EvictingACopiedStorageDropsItsCopy) {
  Chain run;
  Scripted policy;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    if (step == 0) {
      ASSERT_TRUE(ctx.CopyAhead(run.a0));
    } else if (step == 1) {
      ASSERT_EQ(ctx.host_copy(run.a0), HostCopy::kLanded);
      ASSERT_TRUE(ctx.Evict(run.a0));
      EXPECT_EQ(ctx.host_copy(run.a0), HostCopy::kNone);
    }
  };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.recomputes, 1);  // a0 rebuilt for the backward
  EXPECT_EQ(r.h2d_bytes, 0);
  EXPECT_EQ(r.offloads, 0);
}

TEST(CopyAhead, CopiesMadeAheadGiveWayToAnOffloadThatNeedsTheHostRoom) {
  // A pool of two tensors: a0's and a1's copies fill it, and offloading
  // a2 drops the copy made last (a1's) while a0's stays.
  Chain run;
  Scripted policy;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    const int32_t a1 = ctx.program().steps[1].creates[0];
    if (step == 1) {
      ASSERT_TRUE(ctx.CopyAhead(run.a0));
      ASSERT_TRUE(ctx.CopyAhead(a1));
      // Nothing left for a third copy ahead, but the copies count as room
      // for an offload.
      const int32_t x = ctx.program().steps[0].reads[0];
      EXPECT_FALSE(ctx.CopyAhead(x));
      EXPECT_EQ(ctx.host_free(), 2000);
    } else if (step == 2) {
      const int32_t a2 = ctx.program().steps[2].creates[0];
      ASSERT_TRUE(ctx.Offload(a2));
      EXPECT_EQ(ctx.host_copy(a1), HostCopy::kNone);
      // The policy hears of it: releasing a1 needs a copy again.
      EXPECT_EQ(policy.copies_dropped, std::vector<int32_t>{a1});
      EXPECT_NE(ctx.host_copy(run.a0), HostCopy::kNone);
      EXPECT_EQ(ctx.host_free(), 1000);  // a0's copy
    }
  };
  const SimResult r =
      run.Go(policy, /*budget=*/int64_t{1} << 30, /*host_bytes=*/2000);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.copies_ahead, 2);
  EXPECT_EQ(r.offloads, 1);
}

TEST(CopyAhead, ACopiedStorageFreedByTheProgramLeavesNoHostBytes) {
  // A pool of one tensor: a0's copy fills it; once the backward pass has
  // dropped a0, the input's copy finds the room again.
  Chain run;
  Scripted policy;
  bool copied_input = false;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    const int32_t x = ctx.program().steps[0].reads[0];
    if (step == 0) {
      ASSERT_TRUE(ctx.CopyAhead(run.a0));
      EXPECT_FALSE(ctx.CopyAhead(x));
    } else if (step + 1 == static_cast<int32_t>(ctx.program().steps.size())) {
      ASSERT_EQ(ctx.state(run.a0), StorageState::kDead);
      copied_input = ctx.CopyAhead(x);
    }
  };
  const SimResult r =
      run.Go(policy, /*budget=*/int64_t{1} << 30, /*host_bytes=*/1000);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_TRUE(copied_input);
  EXPECT_EQ(r.copies_ahead, 2);
}

TEST(CopyAhead, AReleaseWaitsForOnePieceOfACopyMadeAheadAndDropsTheRest) {
  // 8 MiB tensors: a copy takes 8 MiB of ns, a piece of it 2 MiB of ns.
  constexpr int64_t kBytes = int64_t{8} << 20;
  constexpr int64_t kPiece = int64_t{2} << 20;
  Chain run(kBytes);
  Scripted policy;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    const int32_t x = ctx.program().steps[0].reads[0];
    if (step == 0) {
      ASSERT_TRUE(ctx.CopyAhead(run.a0));  // under way from now on
      ASSERT_TRUE(ctx.CopyAhead(x));       // queued behind it
    } else if (step == 1) {
      const int32_t a1 = ctx.program().steps[1].creates[0];
      const int64_t now = ctx.now_ns();
      ASSERT_TRUE(ctx.Offload(a1));
      // a0's copy gives up after the piece under way, x's never starts;
      // the release's copy follows at once.
      EXPECT_EQ(ctx.d2h_free_at(), now + kPiece + kBytes);
      EXPECT_EQ(ctx.host_copy(run.a0), HostCopy::kNone);
      EXPECT_EQ(ctx.host_copy(x), HostCopy::kNone);
    }
  };
  const SimResult r = run.Go(policy);
  ASSERT_TRUE(r.fits) << r.failure;
  EXPECT_EQ(r.copies_ahead, 2);
  EXPECT_EQ(r.d2h_bytes, 2 * kBytes);  // a0's (begun) and a1's; not x's
}

// a0 offloaded once the forward pass is done with it, prefetched once the
// copy has landed, and offloaded again once back: with the reload's host
// bytes kept, the second offload takes no copy.
SimResult OffloadPrefetchOffload(bool keep, HostCopy* after_reload) {
  Chain run;
  Scripted policy;
  enum { kStart, kOffloaded, kPrefetched, kAgain } stage = kStart;
  policy.after_step = [&](SimContext& ctx, int32_t step) {
    const StorageState state = ctx.state(run.a0);
    if (stage == kStart && step == 1) {  // a1 made from it
      EXPECT_TRUE(ctx.Offload(run.a0));
      stage = kOffloaded;
    } else if (stage == kOffloaded && state == StorageState::kOffloaded) {
      EXPECT_TRUE(ctx.Prefetch(run.a0));
      stage = kPrefetched;
    } else if (stage == kPrefetched && state == StorageState::kResident) {
      *after_reload = ctx.host_copy(run.a0);
      const int64_t link = ctx.d2h_free_at();
      EXPECT_TRUE(ctx.Offload(run.a0));
      if (keep) {
        EXPECT_EQ(ctx.state(run.a0), StorageState::kOffloaded);
        EXPECT_EQ(ctx.d2h_free_at(), link);  // no copy queued
      }
      stage = kAgain;
    }
  };
  SimOptions o;
  o.budget_bytes = int64_t{1} << 30;
  o.keep_reloaded_copies = keep;
  auto r = Simulate(run.program, TestDevice(), policy, o);
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(stage, kAgain);
  return r.ok() ? *r : SimResult{};
}

TEST(CopyAhead, AReloadKeepsItsHostBytesAndTheNextOffloadTakesNoCopy) {
  HostCopy after_reload = HostCopy::kNone;
  const SimResult kept = OffloadPrefetchOffload(true, &after_reload);
  ASSERT_TRUE(kept.fits) << kept.failure;
  EXPECT_EQ(after_reload, HostCopy::kLanded);
  EXPECT_EQ(kept.offloads, 2);
  EXPECT_EQ(kept.offloads_from_copies, 1);
  EXPECT_EQ(kept.d2h_bytes, 1000);  // the first offload's copy alone
  EXPECT_EQ(kept.prefetches, 1);

  const SimResult dropped = OffloadPrefetchOffload(false, &after_reload);
  ASSERT_TRUE(dropped.fits) << dropped.failure;
  EXPECT_EQ(after_reload, HostCopy::kNone);
  EXPECT_EQ(dropped.offloads_from_copies, 0);
  EXPECT_EQ(dropped.d2h_bytes, 2000);
}

TEST(CopyAhead, DeltaCopiesAheadAndWaitsLessThanWithout) {
  // Recompute dearer than a copy: delta offloads. With copies made while
  // the link idles, its releases find the bytes on the host already.
  const Program p = Compiled(ChainTrace(12, 1000, 1000, /*heavy=*/true));
  const SimResult with = RunPolicy(p, "delta", p.peak_bytes / 2);
  const SimResult without = RunPolicy(p, "delta-nocopy", p.peak_bytes / 2);
  ASSERT_TRUE(with.fits) << with.failure;
  ASSERT_TRUE(without.fits) << without.failure;
  EXPECT_GT(with.copies_ahead, 0);
  EXPECT_GT(with.offloads_from_copies, 0);
  EXPECT_EQ(without.copies_ahead, 0);
  EXPECT_LT(with.stall_ns, without.stall_ns);
  EXPECT_LT(with.makespan_ns, without.makespan_ns);
}

}  // namespace
}  // namespace deltad::sim
