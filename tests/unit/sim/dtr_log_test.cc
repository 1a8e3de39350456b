// What ImportDtrLog makes of each instruction of a DTR log: values, views,
// versions, phases, the iteration and when each value is released.

#include "policies/sim/dtr_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "policies/sim/trace.h"
#include "tests/unit/sim/dtr_log_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Kind = TraceValue::Kind;

// The value of the trace named `name`, created last under that name (a
// version repeats its base's name).
int32_t Find(const Trace& t, const std::string& name) {
  for (int32_t v = static_cast<int32_t>(t.values.size()) - 1; v >= 0; --v) {
    if (t.values[v].name == name) return v;
  }
  ADD_FAILURE() << "no value named " << name;
  return -1;
}

TEST(DtrLogTest, ImportsEveryInstructionKind) {
  const Trace t = MustImport(
      "every_kind.log",
      {kStart, Constant("w", 64), Constant("x", 32), Copy("w", "w2"),
       Release("w"),
       Call("matmul", {"x", "w2"}, {{"y", 128, -1}, {"yv", 64, 1}}, 1000),
       R"({"ARGS":["y","x"],"INSTRUCTION":"MUTATE","MUTATE":[0],"NAME":"add_","TIME":"50"})",
       kBackward, Call("grad", {"y"}, {{"g", 128, -1}}, 2000),
       CopyFrom("g", "y"), Release("x"), Release("never_defined")});
  EXPECT_EQ(t.name, "every_kind");
  ASSERT_EQ(t.ops.size(), 3u);
  const int32_t w = Find(t, "w"), x = Find(t, "x"), y = Find(t, "y"),
                yv = Find(t, "yv"), g = Find(t, "g");
  EXPECT_EQ(t.values[w].kind, Kind::kConstant);
  EXPECT_EQ(t.values[w].bytes, 64);
  EXPECT_EQ(t.values[x].kind, Kind::kConstant);

  EXPECT_EQ(t.ops[0].name, "matmul");
  EXPECT_EQ(t.ops[0].phase, Phase::kForward);
  EXPECT_EQ(t.ops[0].time_ns, 1000);
  EXPECT_THAT(t.ops[0].inputs, ElementsAre(x, w));  // w2 names w's value
  const int32_t y0 = t.ops[0].outputs[0];
  EXPECT_THAT(t.ops[0].outputs, ElementsAre(y0, yv));
  EXPECT_EQ(t.values[y0].kind, Kind::kOutput);
  EXPECT_EQ(t.values[y0].bytes, 128);
  EXPECT_EQ(t.values[yv].kind, Kind::kAlias);
  EXPECT_EQ(t.values[yv].base, w);  // ALIAS 1: a view of ARGS[1]

  EXPECT_EQ(t.ops[1].name, "add_");
  EXPECT_EQ(t.ops[1].time_ns, 50);
  EXPECT_THAT(t.ops[1].inputs, ElementsAre(y0, x));
  ASSERT_EQ(t.ops[1].outputs.size(), 1u);
  EXPECT_EQ(t.ops[1].outputs[0], y);  // the version is the last "y"
  EXPECT_EQ(t.values[y].kind, Kind::kVersion);
  EXPECT_EQ(t.values[y].base, y0);

  EXPECT_EQ(t.ops[2].phase, Phase::kBackward);
  EXPECT_THAT(t.ops[2].inputs, ElementsAre(y));  // reads the new version
  EXPECT_THAT(t.ops[2].outputs, ElementsAre(g));
  // COPY_FROM drops y's version (its only name); RELEASE x drops x; the
  // undefined name is skipped. w (named w2) and yv stay live.
  EXPECT_THAT(t.ops[2].releases, ElementsAre(y, x));
  EXPECT_THAT(t.initial_releases, IsEmpty());
}

TEST(DtrLogTest, ValueIsReleasedWithItsLastName) {
  const Trace t = MustImport(
      "refcount.log",
      {kStart, Constant("a", 8), Copy("a", "b"), Copy("b", "c"), Release("a"),
       Call("f", {"b"}, {{"d", 8, -1}}, 1), Release("b"),
       Call("g", {"c"}, {{"e", 8, -1}}, 1), Release("c"), Release("c")});
  const int32_t a = Find(t, "a");
  EXPECT_THAT(t.initial_releases, IsEmpty());
  EXPECT_THAT(t.ops[0].releases, IsEmpty());
  EXPECT_THAT(t.ops[0].inputs, ElementsAre(a));
  EXPECT_THAT(t.ops[1].inputs, ElementsAre(a));
  EXPECT_THAT(t.ops[1].releases, ElementsAre(a));  // the second c is skipped
}

TEST(DtrLogTest, ReleaseBeforeAnyOpGoesToInitialReleases) {
  const Trace t =
      MustImport("initial.log", {kStart, Constant("a", 8), Copy("a", "b"),
                                 Release("a"), Constant("c", 4), Release("c"),
                                 Call("f", {"b"}, {{"d", 8, -1}}, 1)});
  EXPECT_THAT(t.initial_releases, ElementsAre(Find(t, "c")));
}

TEST(DtrLogTest, CopyFromDropsTheOldReferenceOnly) {
  const Trace t = MustImport(
      "copy_from.log",
      {kStart, Constant("p", 16), Copy("p", "q"),
       Call("f", {"p"}, {{"x", 16, -1}}, 1),
       // q names p's value: p stays live through its name p.
       CopyFrom("x", "q"), Call("g", {"q"}, {{"y", 16, -1}}, 1),
       // Now p's last name goes, then x's two names (x, q) one by one.
       Release("p"), Call("h", {"x"}, {{"z", 16, -1}}, 1), Release("x"),
       Call("i", {"q"}, {{"u", 16, -1}}, 1), Release("q"),
       // A COPY_FROM onto a name of the same value keeps the value.
       Copy("u", "u2"), CopyFrom("u", "u2"),
       Call("j", {"u2"}, {{"v", 16, -1}}, 1)});
  const int32_t p = Find(t, "p"), x = Find(t, "x");
  EXPECT_THAT(t.ops[0].releases, IsEmpty());
  EXPECT_THAT(t.ops[1].inputs, ElementsAre(x));
  EXPECT_THAT(t.ops[1].releases, ElementsAre(p));
  EXPECT_THAT(t.ops[2].releases, IsEmpty());
  EXPECT_THAT(t.ops[3].releases, ElementsAre(x));
  EXPECT_THAT(t.ops[4].inputs, ElementsAre(Find(t, "u")));
}

TEST(DtrLogTest, CopyFromReleasesTheOldValueWhenItWasTheLastName) {
  const Trace t =
      MustImport("copy_from_last.log",
                 {kStart, Constant("a", 8), Call("f", {"a"}, {{"x", 8, -1}}, 1),
                  Call("g", {"a"}, {{"y", 8, -1}}, 1), CopyFrom("x", "y"),
                  Call("h", {"y"}, {{"z", 8, -1}}, 1)});
  EXPECT_THAT(t.ops[1].releases, ElementsAre(Find(t, "y")));
  EXPECT_THAT(t.ops[2].inputs, ElementsAre(Find(t, "x")));
}

TEST(DtrLogTest, AliasesViewTheArgumentNamedByTheirIndex) {
  const Trace t = MustImport(
      "alias.log",
      {kStart, Constant("a", 100), Constant("b", 200),
       Call("split", {"a", "b"}, {{"v0", 200, 1}, {"v1", 100, 0}}, 1),
       Call("view", {"v0"}, {{"vv", 200, 0}}, 1), Release("b"), Release("v0"),
       Call("f", {"vv"}, {{"o", 4, -1}}, 1)});
  const int32_t a = Find(t, "a"), b = Find(t, "b"), v0 = Find(t, "v0"),
                vv = Find(t, "vv");
  EXPECT_EQ(t.values[v0].kind, Kind::kAlias);
  EXPECT_EQ(t.values[v0].base, b);
  EXPECT_EQ(t.values[v0].bytes, 200);
  EXPECT_EQ(t.values[Find(t, "v1")].base, a);
  EXPECT_EQ(t.values[vv].base, v0);  // a view of a view
  // Releasing the base's name does not release the view.
  EXPECT_THAT(t.ops[1].releases, ElementsAre(b, v0));
  EXPECT_THAT(t.ops[2].inputs, ElementsAre(vv));
}

TEST(DtrLogTest, MutateMakesVersionsSeenThroughEveryName) {
  const Trace t = MustImport(
      "mutate.log",
      {kStart, Constant("p", 40), Constant("g", 40), Copy("p", "p2"),
       // addcmul_(p2, g, g): g twice, read once; p mutated through p2.
       R"({"ARGS":["p2","g","g"],"INSTRUCTION":"MUTATE","MUTATE":[0],"NAME":"addcmul_","TIME":7})",
       // Both names of one value mutated: one version.
       R"({"ARGS":["p","p2"],"INSTRUCTION":"MUTATE","MUTATE":[0,1],"NAME":"mul_","TIME":"3"})",
       Call("f", {"p"}, {{"o", 40, -1}}, 1), Release("p"), Release("p2")});
  const int32_t p = Find(t, "p"), g = Find(t, "g");
  ASSERT_EQ(t.ops.size(), 3u);
  EXPECT_EQ(t.ops[0].time_ns, 7);  // a JSON number is accepted too
  EXPECT_THAT(t.ops[0].inputs, ElementsAre(0, g));
  ASSERT_EQ(t.ops[0].outputs.size(), 1u);
  const int32_t v1 = t.ops[0].outputs[0];
  EXPECT_EQ(t.values[v1].kind, Kind::kVersion);
  EXPECT_EQ(t.values[v1].base, 0);
  EXPECT_EQ(t.values[v1].bytes, 40);
  EXPECT_THAT(t.ops[1].inputs, ElementsAre(v1));
  EXPECT_THAT(t.ops[1].outputs, ElementsAre(p));
  EXPECT_EQ(t.values[p].base, v1);
  EXPECT_THAT(t.ops[2].inputs, ElementsAre(p));
  EXPECT_THAT(t.ops[2].releases, ElementsAre(p));  // after both names go
}

TEST(DtrLogTest, OpsAfterBackwardAreBackward) {
  const Trace t =
      MustImport("phase.log",
                 {kStart, Constant("a", 8), Call("f", {"a"}, {{"b", 8, -1}}, 1),
                  kBackward, Call("f_backward", {"b"}, {{"c", 8, -1}}, 1),
                  R"({"ANNOTATION":"SOMETHING_ELSE","INSTRUCTION":"ANNOTATE"})",
                  Call("sum", {"c"}, {{"d", 8, -1}}, 1)});
  ASSERT_EQ(t.ops.size(), 3u);
  EXPECT_EQ(t.ops[0].phase, Phase::kForward);
  EXPECT_EQ(t.ops[1].phase, Phase::kBackward);
  EXPECT_EQ(t.ops[2].phase, Phase::kBackward);
}

TEST(DtrLogTest, IterationRunsFromStartToTheNextStart) {
  const Trace t = MustImport(
      "iteration.log",
      {Constant("warmup", 8), Call("w", {"warmup"}, {{"wo", 8, -1}}, 1), kStart,
       Constant("a", 8), Call("f", {"a"}, {{"b", 8, -1}}, 5), kStart,
       Call("g", {"b"}, {{"c", 8, -1}}, 1)});
  ASSERT_EQ(t.ops.size(), 1u);
  EXPECT_EQ(t.ops[0].name, "f");
  EXPECT_EQ(t.values.size(), 2u);
  EXPECT_EQ(t.ComputeNs(), 5);

  // Without START the whole file is the iteration.
  const Trace all = MustImport(
      "no_start.log", {Constant("a", 8), Call("f", {"a"}, {{"b", 8, -1}}, 1)});
  EXPECT_EQ(all.ops.size(), 1u);
}

TEST(DtrLogTest, ReleaseOfUndefinedNameIsSkipped) {
  const Trace t =
      MustImport("undefined_release.log",
                 {kStart, Release("ghost"), Constant("a", 8), Release("ghost"),
                  Call("f", {"a"}, {{"b", 8, -1}}, 1), Release("ghost2")});
  EXPECT_THAT(t.initial_releases, IsEmpty());
  EXPECT_THAT(t.ops[0].releases, IsEmpty());
}

}  // namespace
}  // namespace deltad::sim
