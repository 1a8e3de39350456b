#include "policies/sim/program.h"

#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/trace.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

Program Compiled(const Trace& t) {
  auto p = Compile(t);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : Program{};
}

TEST(Program, ConstantsComeFirstAndCountAsConstantBytes) {
  TraceBuilder b("t");
  b.Constant("x", 100);
  b.Constant("w", 20);
  const Program p = Compiled(std::move(b).Build());
  ASSERT_EQ(p.storages.size(), 2u);
  EXPECT_TRUE(p.storages[0].constant);
  EXPECT_EQ(p.storages[0].producer, -1);
  EXPECT_EQ(p.storages[1].name, "w");
  EXPECT_EQ(p.constant_bytes, 120);
  EXPECT_EQ(p.peak_bytes, 120);
  EXPECT_TRUE(p.steps.empty());
}

TEST(Program, ViewsShareAStorageAndReadsAreDeduplicated) {
  TraceBuilder b("views");
  const int32_t x = b.Constant("x", 100);  // storage 0
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 200);  // storage 1
  const int32_t yv = b.Alias("yv", y);   // also storage 1
  b.Op("g", Phase::kForward, 1).Input(y).Input(yv).Input(x).Input(yv);
  b.Output("z", 10);  // storage 2
  const Program p = Compiled(std::move(b).Build());
  ASSERT_EQ(p.storages.size(), 3u);
  ASSERT_EQ(p.steps.size(), 2u);
  // A view creates no storage.
  EXPECT_THAT(p.steps[0].creates, ElementsAre(1));
  EXPECT_EQ(p.storages[1].name, "y");
  EXPECT_THAT(p.steps[1].reads, ElementsAre(1, 0));
  EXPECT_THAT(p.steps[1].creates, ElementsAre(2));
  EXPECT_THAT(p.storages[2].parents, ElementsAre(1, 0));
  // The view is not counted twice.
  EXPECT_EQ(p.peak_bytes, 100 + 200 + 10);
}

TEST(Program, InPlaceUpdateMakesANewStorageThatReusesTheOldMemory) {
  TraceBuilder b("inplace");
  const int32_t x = b.Constant("x", 100);  // storage 0
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 1000);  // storage 1
  b.Op("relu_", Phase::kForward, 1).Input(y);
  b.Version(y);  // storage 2
  b.Op("g", Phase::kForward, 1).Input(x);
  b.Output("z", 50);  // storage 3
  const Program p = Compiled(std::move(b).Build());
  ASSERT_EQ(p.storages.size(), 4u);
  const Step& up = p.steps[1];
  EXPECT_THAT(up.creates, ElementsAre(2));
  ASSERT_EQ(up.in_place.size(), 1u);
  EXPECT_EQ(up.in_place[0].created, 2);
  EXPECT_EQ(up.in_place[0].old, 1);
  // The old storage is read once, and lost its only name here.
  EXPECT_THAT(up.reads, ElementsAre(1));
  EXPECT_THAT(up.frees, ElementsAre(1));
  EXPECT_EQ(p.storages[1].freed_at, 1);
  EXPECT_THAT(p.storages[2].parents, ElementsAre(1));
  EXPECT_EQ(p.storages[2].producer, 1);
  EXPECT_EQ(p.storages[2].bytes, 1000);
  // Never 100 + 1000 + 1000: the new storage takes over the old memory, and
  // afterwards it is counted once (100 + 1000 + 50).
  EXPECT_EQ(p.peak_bytes, 1150);
  // The update step needs only what it reads.
  EXPECT_EQ(p.min_budget_bytes, 1100);
  EXPECT_EQ(p.min_budget_step, 0);
}

TEST(Program, InPlaceUpdateOfAViewedValueCountsBothStorages) {
  TraceBuilder b("inplace-view");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 1000);
  const int32_t yv = b.Alias("yv", y);
  b.Op("relu_", Phase::kForward, 1).Input(y);
  b.Version(y);
  b.Op("g", Phase::kForward, 1).Input(yv);
  b.Release(yv);
  const Program p = Compiled(std::move(b).Build());
  const Step& up = p.steps[1];
  ASSERT_EQ(up.in_place.size(), 1u);
  EXPECT_EQ(up.in_place[0].old, 1);
  // `yv` still names the old storage: it stays, and both are in memory.
  EXPECT_THAT(up.frees, IsEmpty());
  EXPECT_EQ(p.peak_bytes, 100 + 1000 + 1000);
  EXPECT_EQ(p.min_budget_bytes, 1000 + 1000);
  EXPECT_EQ(p.min_budget_step, 1);
  EXPECT_THAT(p.steps[2].frees, ElementsAre(1));
}

TEST(Program, InPlaceUpdateReusesMemoryWhenTheLastViewIsReleasedThere) {
  TraceBuilder b("inplace-release");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 1000);
  const int32_t yv = b.Alias("yv", y);
  b.Op("relu_", Phase::kForward, 1).Input(yv);
  b.Version(y);
  b.Release(yv);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_THAT(p.steps[1].frees, ElementsAre(1));
  EXPECT_EQ(p.peak_bytes, 1100);
}

TEST(Program, ReleasingTheLastNameFreesTheStorageAfterThatStep) {
  TraceBuilder b("frees");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 200);  // storage 1
  b.Op("g", Phase::kForward, 1).Input(y);
  const int32_t z = b.Output("z", 300);  // storage 2
  b.Release(y);
  b.Op("h", Phase::kForward, 1).Input(z);
  b.Release(z);
  b.Release(x);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_THAT(p.steps[0].frees, IsEmpty());
  EXPECT_THAT(p.steps[1].frees, ElementsAre(1));
  EXPECT_THAT(p.steps[2].frees, ElementsAre(2, 0));
  EXPECT_EQ(p.storages[1].freed_at, 1);
  EXPECT_EQ(p.storages[2].freed_at, 2);
  EXPECT_EQ(p.storages[0].freed_at, 2);
  EXPECT_EQ(p.peak_bytes, 600);
}

TEST(Program, AViewKeepsItsStorageUntilTheViewIsReleased) {
  TraceBuilder b("view-frees");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 200);  // storage 1
  b.Op("view", Phase::kForward, 1).Input(y);
  const int32_t yv = b.Alias("yv", y);
  b.Release(y);
  b.Op("g", Phase::kForward, 1).Input(yv);
  b.Output("z", 10);
  b.Release(yv);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_THAT(p.steps[1].frees, IsEmpty());
  EXPECT_THAT(p.steps[2].frees, ElementsAre(1));
  EXPECT_EQ(p.storages[1].freed_at, 2);
  EXPECT_EQ(p.storages[0].freed_at, -1);
  EXPECT_EQ(p.peak_bytes, 310);
}

TEST(Program, InitialReleasesFreeBeforeTheFirstStep) {
  TraceBuilder b("initial");
  const int32_t a = b.Constant("a", 10);
  const int32_t c = b.Constant("c", 20);
  b.Release(a);
  b.Op("f", Phase::kForward, 1).Input(c);
  b.Output("y", 5);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_THAT(p.initial_frees, ElementsAre(0));
  EXPECT_EQ(p.constant_bytes, 30);
  // `a` is gone before anything runs.
  EXPECT_EQ(p.peak_bytes, 25);
  EXPECT_THAT(p.steps[0].frees, IsEmpty());
}

// const w 100
// op0 fwd 10 ws=300 in=w out=a:1000      needs 1400, live 1100, peak 1400
// op1 fwd 20 in=a out=b:500 release a    needs 1500, live 1600
// op2 bwd 30 ws=2000 in=b out=g:200      needs 2700, live 800 + 2000 ws
//     release b,g
// op3 bwd 40 in=w mut=w                  needs 100, reuses w's memory
Trace WorkspaceTrace() {
  TraceBuilder b("ws");
  const int32_t w = b.Constant("w", 100);
  b.Op("f0", Phase::kForward, 10, 300).Input(w);
  const int32_t a = b.Output("a", 1000);
  b.Op("f1", Phase::kForward, 20).Input(a);
  const int32_t bb = b.Output("b", 500);
  b.Release(a);
  b.Op("b0", Phase::kBackward, 30, 2000).Input(bb);
  const int32_t g = b.Output("g", 200);
  b.Release(bb);
  b.Release(g);
  b.Op("sgd_", Phase::kBackward, 40).Input(w);
  b.Version(w);
  return std::move(b).Build();
}

TEST(Program, PeakAndMinBudgetIncludeWorkspace) {
  const Program p = Compiled(WorkspaceTrace());
  EXPECT_EQ(p.peak_bytes, 2800);
  EXPECT_EQ(p.min_budget_bytes, 2700);
  EXPECT_EQ(p.min_budget_step, 2);
  ASSERT_EQ(p.steps.size(), 4u);
  EXPECT_EQ(p.steps[0].workspace_bytes, 300);
  EXPECT_EQ(p.steps[2].workspace_bytes, 2000);
  EXPECT_EQ(p.steps[2].phase, Phase::kBackward);
  EXPECT_EQ(p.steps[3].op, 3);
}

TEST(Program, ComputeNsIsTheSumOfOpTimes) {
  const Trace t = WorkspaceTrace();
  const Program p = Compiled(t);
  EXPECT_EQ(p.compute_ns, 10 + 20 + 30 + 40);
  EXPECT_EQ(p.compute_ns, t.ComputeNs());
  EXPECT_EQ(p.steps[1].time_ns, 20);
}

TEST(Program, MinBudgetIsTheLargestSingleStepNotThePeak) {
  // Activations pile up: the peak is their sum, but each step alone needs
  // only its input and output.
  TraceBuilder b("pile");
  const int32_t x = b.Constant("x", 10);
  b.Op("l1", Phase::kForward, 1).Input(x);
  const int32_t a1 = b.Output("a1", 100);
  b.Op("l2", Phase::kForward, 1).Input(a1);
  const int32_t a2 = b.Output("a2", 100);
  b.Op("l3", Phase::kForward, 1).Input(a2);
  const int32_t a3 = b.Output("a3", 100);
  b.Op("loss", Phase::kForward, 1).Input(a3);
  b.Output("l", 1);
  b.Release(a1);
  b.Release(a2);
  b.Release(a3);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_EQ(p.peak_bytes, 10 + 300 + 1);
  EXPECT_EQ(p.min_budget_bytes, 200);
  EXPECT_EQ(p.min_budget_step, 1);  // the first step that needs 200
}

TEST(Program, MarksForwardConvolutions) {
  TraceBuilder b("conv");
  const int32_t x = b.Constant("x", 10);
  b.Op("conv2d", Phase::kForward, 1).Input(x);
  b.Output("y", 10);
  b.Op("conv2d_backward", Phase::kBackward, 1).Input(x);
  b.Output("g", 10);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_TRUE(p.steps[0].conv);
  EXPECT_FALSE(p.steps[1].conv);
}

TEST(Program, ConstantsAreNotRecomputable) {
  TraceBuilder b("t");
  b.Constant("x", 100);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_FALSE(p.storages[0].recomputable);
  EXPECT_FALSE(p.Recomputable(0));
}

TEST(Program, AnOutputOfALiveConstantIsRecomputable) {
  TraceBuilder b("t");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  const int32_t y = b.Output("y", 200);  // storage 1
  b.Op("g", Phase::kForward, 1).Input(y);
  const int32_t z = b.Output("z", 200);  // storage 2
  b.Release(y);
  b.Op("h", Phase::kForward, 1).Input(z);
  b.Release(z);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_TRUE(p.Recomputable(1));
  // Its parent is freed first, but can itself be rebuilt.
  EXPECT_TRUE(p.Recomputable(2));
}

TEST(Program, AnOutputOfAFreedConstantIsNotRecomputable) {
  TraceBuilder b("t");
  const int32_t k = b.Constant("k", 100);  // storage 0
  b.Op("f", Phase::kForward, 1).Input(k);
  const int32_t y = b.Output("y", 200);  // storage 1, lives to the end
  b.Release(k);
  b.Op("g", Phase::kForward, 1).Input(y);
  const int32_t z = b.Output("z", 10);  // storage 2, freed at step 2
  b.Op("h", Phase::kForward, 1).Input(z);
  b.Release(z);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_EQ(p.storages[0].freed_at, 0);
  EXPECT_FALSE(p.Recomputable(1));
  // `y` cannot be rebuilt, but it outlives `z`: `z` can always be.
  EXPECT_TRUE(p.Recomputable(2));
}

// `z` reads `y`, which can be rebuilt only while `k` is there: both are
// dropped at step 2, while `z` lives to the end. Rebuilding `z` later would
// need `y`, dead and beyond rebuilding by then: `z` is not recomputable. (A
// gradient made in backward from activations long freed was taken as
// recomputable, and a policy that evicted it at the optimizer step failed
// to rebuild it.)
TEST(Program, AParentRebuiltOnlyWhileItsOwnParentsLiveDoesNotMakeItsChildSo) {
  TraceBuilder b("t");
  const int32_t k = b.Constant("k", 100);  // storage 0
  b.Op("f", Phase::kForward, 1).Input(k);
  const int32_t y = b.Output("y", 200);  // storage 1
  b.Op("g", Phase::kForward, 1).Input(y);
  const int32_t z = b.Output("z", 10);  // storage 2, lives to the end
  b.Op("h", Phase::kForward, 1).Input(k).Input(y);
  b.Release(k);
  b.Release(y);
  b.Op("i", Phase::kForward, 1).Input(z);
  const Program p = Compiled(std::move(b).Build());
  ASSERT_EQ(p.storages.size(), 3u);
  EXPECT_EQ(p.storages[0].freed_at, 2);
  EXPECT_EQ(p.storages[1].freed_at, 2);
  EXPECT_EQ(p.storages[2].freed_at, -1);
  // `y` can be rebuilt while it lives: `k` lives as long.
  EXPECT_TRUE(p.Recomputable(1));
  EXPECT_FALSE(p.Recomputable(2));
}

TEST(Program, AParentFreedInTheSameStepAsItsChildOutlivesIt) {
  TraceBuilder b("t");
  const int32_t k = b.Constant("k", 100);  // storage 0
  b.Op("f", Phase::kForward, 1).Input(k);
  const int32_t y = b.Output("y", 200);  // storage 1
  b.Op("g", Phase::kForward, 1).Input(k).Input(y);
  b.Release(k);
  b.Release(y);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_EQ(p.storages[0].freed_at, 1);
  EXPECT_EQ(p.storages[1].freed_at, 1);
  EXPECT_TRUE(p.Recomputable(1));
}

TEST(Program, AnInPlaceResultOfAConstantIsNotRecomputable) {
  // The old storage is freed as the new one takes it over.
  TraceBuilder b("t");
  const int32_t w = b.Constant("w", 100);
  b.Op("sgd_", Phase::kBackward, 1).Input(w);
  b.Version(w);
  const Program p = Compiled(std::move(b).Build());
  ASSERT_EQ(p.storages.size(), 2u);
  EXPECT_EQ(p.storages[0].freed_at, 0);
  EXPECT_FALSE(p.Recomputable(1));
}

TEST(Program, ChildrenOfNonRecomputableParentsFreedFirstAreNot) {
  TraceBuilder b("t");
  const int32_t k = b.Constant("k", 100);
  b.Op("f", Phase::kForward, 1).Input(k);
  const int32_t y = b.Output("y", 200);  // storage 1: not recomputable
  b.Release(k);
  b.Op("g", Phase::kForward, 1).Input(y);
  const int32_t z = b.Output("z", 10);  // storage 2: outlives y
  b.Release(y);
  b.Op("h", Phase::kForward, 1).Input(z);
  const Program p = Compiled(std::move(b).Build());
  EXPECT_FALSE(p.Recomputable(1));
  EXPECT_FALSE(p.Recomputable(2));
}

TEST(Program, RejectsAnInvalidTrace) {
  TraceBuilder b("bad");
  const int32_t x = b.Constant("x", 100);
  b.Release(x);
  b.Op("f", Phase::kForward, 1).Input(x);
  const Trace t = std::move(b).Build();
  ASSERT_FALSE(t.Validate().ok());
  auto p = Compile(t);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Program, RejectsAViewOfADifferentSize) {
  TraceBuilder b("bad");
  const int32_t x = b.Constant("x", 100);
  b.Op("f", Phase::kForward, 1).Input(x);
  b.Alias("v", x);
  Trace t = std::move(b).Build();
  t.values.back().bytes = 50;
  EXPECT_EQ(Compile(t).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deltad::sim
