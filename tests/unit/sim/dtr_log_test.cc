#include "policies/sim/dtr_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/dtr_measured.h"
#include "policies/sim/trace.h"
#include "policies/sim/trace_io.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Kind = TraceValue::Kind;

// Writes `lines` as a log file under the test's temporary folder.
std::string WriteFile(const std::string& name,
                      const std::vector<std::string>& lines) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name);
  std::ofstream out(path, std::ios::trunc);
  for (const std::string& line : lines) out << line << "\n";
  return path;
}

// The value of the trace named `name`, created last under that name (a
// version repeats its base's name).
int32_t Find(const Trace& t, const std::string& name) {
  for (int32_t v = static_cast<int32_t>(t.values.size()) - 1; v >= 0; --v) {
    if (t.values[v].name == name) return v;
  }
  ADD_FAILURE() << "no value named " << name;
  return -1;
}

std::string Constant(const std::string& name, int64_t bytes) {
  return absl::StrCat(R"({"INSTRUCTION":"CONSTANT","NAME":")", name, "\"}\n",
                      R"({"INSTRUCTION":"MEMORY","MEMORY":")", bytes,
                      R"(","NAME":")", name, "\"}");
}

// A CALL line and its per-result MEMORY and ALIAS lines; `results` pairs a
// name with (bytes, alias index).
struct Result {
  std::string name;
  int64_t bytes;
  int alias;
};
std::string Call(const std::string& op, const std::vector<std::string>& args,
                 const std::vector<Result>& results, int64_t time_ns) {
  std::vector<std::string> names;
  for (const Result& r : results)
    names.push_back(absl::StrCat("\"", r.name, "\""));
  std::string s =
      absl::StrCat(R"({"ARGS":[)",
                   absl::StrJoin(args, ",",
                                 [](std::string* o, const std::string& a) {
                                   absl::StrAppend(o, "\"", a, "\"");
                                 }),
                   R"(],"INSTRUCTION":"CALL","NAME":")", op, R"(","RESULT":[)",
                   absl::StrJoin(names, ","), R"(],"TIME":")", time_ns, "\"}");
  for (const Result& r : results) {
    absl::StrAppend(&s, "\n", R"({"INSTRUCTION":"MEMORY","MEMORY":")", r.bytes,
                    R"(","NAME":")", r.name, "\"}\n", R"({"ALIAS":")", r.alias,
                    R"(","INSTRUCTION":"ALIAS","NAME":")", r.name, "\"}");
  }
  return s;
}

std::string Release(const std::string& name) {
  return absl::StrCat(R"({"INSTRUCTION":"RELEASE","NAME":")", name, "\"}");
}
std::string Copy(const std::string& src, const std::string& dst) {
  return absl::StrCat(R"({"DST":")", dst, R"(","INSTRUCTION":"COPY","SRC":")",
                      src, "\"}");
}
std::string CopyFrom(const std::string& src, const std::string& dst) {
  return absl::StrCat(R"({"DST":")", dst,
                      R"(","INSTRUCTION":"COPY_FROM","SRC":")", src, "\"}");
}
const char kStart[] = R"({"ANNOTATION":"START","INSTRUCTION":"ANNOTATE"})";
const char kBackward[] =
    R"({"ANNOTATION":"BACKWARD","INSTRUCTION":"ANNOTATE"})";

Trace MustImport(const std::string& name,
                 const std::vector<std::string>& lines) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(name, lines));
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return Trace{};
  EXPECT_TRUE(t->Validate().ok()) << t->Validate();
  return *std::move(t);
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

TEST(DtrLogTest, AliasErrorsSayWhatWasExpected) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(
      "alias_index.log",
      {kStart, Constant("a", 8), Call("view", {"a"}, {{"v", 8, 1}}, 1)}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("alias_index.log:6: expected ALIAS -1 or an index "
                        "below the 1 ARGS of line 4, got 1"));

  t = ImportDtrLog(WriteFile(
      "alias_size.log",
      {kStart, Constant("a", 8), Call("view", {"a"}, {{"v", 16, 0}}, 1)}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("alias_size.log:5: expected the view 'v' to have the "
                        "storage size of its base 'a' (8 bytes), got 16"));
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

TEST(DtrLogTest, MutateIndexOutOfRangeIsAnError) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(
      "mutate_index.log",
      {kStart, Constant("p", 8),
       R"({"ARGS":["p"],"INSTRUCTION":"MUTATE","MUTATE":[2],"NAME":"relu_","TIME":"1"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("mutate_index.log:4: expected MUTATE indices below "
                        "the 1 ARGS, got 2"));
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

TEST(DtrLogTest, MalformedLineSaysPathAndLine) {
  const std::string path = WriteFile(
      "malformed.log", {kStart, Constant("a", 8), R"({"INSTRUCTION":"CALL",)"});
  absl::StatusOr<Trace> t = ImportDtrLog(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr(absl::StrCat(path, ":4: expected a JSON object")));

  t = ImportDtrLog(WriteFile("not_object.log", {kStart, "[1, 2]"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("not_object.log:2: expected a JSON object"));
}

TEST(DtrLogTest, MissingOrMistypedKeySaysWhichKey) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(
      "no_time.log",
      {kStart, Constant("a", 8),
       R"({"ARGS":["a"],"INSTRUCTION":"CALL","NAME":"f","RESULT":[]})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr("no_time.log:4: expected key \"TIME\""));

  t = ImportDtrLog(WriteFile(
      "bad_time.log",
      {kStart,
       R"({"ARGS":[],"INSTRUCTION":"CALL","NAME":"f","RESULT":[],"TIME":"soon"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("bad_time.log:2: expected \"TIME\" to be an integer"));

  t = ImportDtrLog(
      WriteFile("no_instruction.log", {kStart, R"({"NAME":"a"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("no_instruction.log:2: expected key \"INSTRUCTION\""));

  t = ImportDtrLog(
      WriteFile("unknown.log", {kStart, R"({"INSTRUCTION":"JUMP"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("unknown.log:2: expected an "
                                              "INSTRUCTION among"));
}

TEST(DtrLogTest, ResultsNeedTheirMemoryAndAliasLines) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(
      "no_memory.log",
      {kStart, Constant("a", 8),
       R"({"ARGS":["a"],"INSTRUCTION":"CALL","NAME":"f","RESULT":["b"],"TIME":"1"})",
       Release("a")}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("no_memory.log:5: expected MEMORY for 'b' (line 4 "
                        "needs it)"));

  t = ImportDtrLog(WriteFile(
      "eof.log", {kStart, R"({"INSTRUCTION":"CONSTANT","NAME":"a"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("eof.log:2: expected MEMORY for 'a' after this line, "
                        "got the end of the file"));

  t = ImportDtrLog(WriteFile(
      "stray.log",
      {kStart, R"({"INSTRUCTION":"MEMORY","MEMORY":"8","NAME":"a"})"}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("stray.log:2: expected MEMORY only right after"));
}

TEST(DtrLogTest, UndefinedNameSaysPathAndLine) {
  const std::string path = WriteFile(
      "undefined.log",
      {kStart, Constant("a", 8), Call("f", {"a", "ghost"}, {{"b", 8, -1}}, 1)});
  absl::StatusOr<Trace> t = ImportDtrLog(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr(absl::StrCat(path,
                                     ":4: expected argument 'ghost' to "
                                     "be a defined name")));

  t = ImportDtrLog(
      WriteFile("undefined_copy.log", {kStart, Copy("ghost", "b")}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("undefined_copy.log:2: expected SRC 'ghost'"));

  // Released names are undefined too.
  t = ImportDtrLog(
      WriteFile("released.log", {kStart, Constant("a", 8), Constant("b", 8),
                                 Release("a"), CopyFrom("b", "a")}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("released.log:7: expected DST 'a' to be a defined "
                        "name"));

  t = ImportDtrLog(
      WriteFile("live_twice.log",
                {kStart, Constant("a", 8), Constant("b", 8), Copy("b", "a")}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("live_twice.log:6: expected a new name, but 'a' is "
                        "still live"));
}

// Found by fuzz/trace_fuzzer: such names imported, and FormatTrace then
// wrote a trace that ParseTrace refused.
TEST(DtrLogTest, NamesTheTextFormCannotHoldAreRefused) {
  for (const std::string bad :
       {"x 1", "x\\t1", "x,1", "x:1", "x=1", "x#1", ""}) {
    absl::StatusOr<Trace> t = ImportDtrLog(
        WriteFile("bad_value_name.log", {kStart, Constant(bad, 8)}));
    ASSERT_FALSE(t.ok()) << "'" << bad << "'";
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(),
                HasSubstr("bad_value_name.log:2: expected value name"));
  }
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(
      "bad_op_name.log",
      {kStart, Constant("a", 8), Call("conv 2d", {"a"}, {{"b", 8, -1}}, 1)}));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("bad_op_name.log:4: expected op name 'conv 2d'"));
  // Separators of value lists are fine in an op's name, and what imports
  // reads back from its text form.
  const Trace ok = MustImport(
      "op_name_with_colons.log",
      {kStart, Constant("a", 8), Call("aten::add", {"a"}, {{"b", 8, -1}}, 1)});
  const std::string text = FormatTrace(ok);
  absl::StatusOr<Trace> again = ParseTrace(text);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(FormatTrace(*again), text);
}

TEST(DtrLogTest, MissingFileIsNotFound) {
  absl::StatusOr<Trace> t =
      ImportDtrLog(absl::StrCat(::testing::TempDir(), "/no_such_dtr_log.log"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
}

TEST(DtrLogTest, DefaultDirAndListing) {
  const char* saved = std::getenv("DELTAD_DTR_TRACES");
  const std::string saved_value = saved != nullptr ? saved : "";
  setenv("DELTAD_DTR_TRACES", "/some/where", 1);
  EXPECT_EQ(DefaultDtrTraceDir(), "/some/where");
  unsetenv("DELTAD_DTR_TRACES");
  EXPECT_EQ(DefaultDtrTraceDir(), "../shared/traces/dtr");
  if (saved != nullptr) setenv("DELTAD_DTR_TRACES", saved_value.c_str(), 1);

  const std::string dir = absl::StrCat(::testing::TempDir(), "/dtr_listing");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/sub.log");  // a folder: skipped
  for (const char* f : {"b.log", "a.log", "notes.txt", "c.log.gz"}) {
    std::ofstream(absl::StrCat(dir, "/", f)) << "\n";
  }
  EXPECT_THAT(ListDtrLogs(dir), ElementsAre(dir + "/a.log", dir + "/b.log"));
  EXPECT_THAT(ListDtrLogs(dir + "/missing"), IsEmpty());
}

TEST(DtrMeasuredTest, LoadsRunsAndSkipsMetadataFailuresAndTypos) {
  const std::string run = R"(
    {"specific_params": {"type": "baseline", "batch_size": 64},
     "summary": [{"time": {"mean": 10.5, "median": 10.0},
                  "total_mem": {"mean": 900.0, "median": 1000.0}}]},
    {"specific_params": {"type": "dtr", "batch_size": 64,
                         "memory_budget": 4000000000.0},
     "summary": [{"time": {"mean": 20.5, "median": 20.0},
                  "total_mem": {"mean": 400.0, "median": 401.0}}]},
    {"specific_params": {"type": "dtr", "batch_size": 64,
                         "memory_budget": 2000000000.0},
     "summary": "error"})";
  const std::string path = WriteFile(
      "measured.json",
      {absl::StrCat(R"({"timestamp": "03-06-2021-1702", "inceptionv4": [)", run,
                    R"(], "inceptiov4": [)", run, R"(], "unet": [)", run,
                    "]}")});
  absl::StatusOr<std::vector<DtrMeasurement>> m = LoadDtrMeasurements(path);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 4u);  // inceptiov4 is a copy; the failed runs skipped
  const DtrMeasurement& base = (*m)[0];
  EXPECT_EQ(base.model, "inceptionv4");
  EXPECT_EQ(base.type, "baseline");
  EXPECT_EQ(base.budget_bytes, 0);
  EXPECT_EQ(base.batch, 64);
  EXPECT_DOUBLE_EQ(base.median_ms, 10.0);
  EXPECT_DOUBLE_EQ(base.mean_ms, 10.5);
  EXPECT_DOUBLE_EQ(base.total_mem_mb, 1000.0);
  EXPECT_EQ((*m)[1].type, "dtr");
  EXPECT_EQ((*m)[1].budget_bytes, 4'000'000'000);
  EXPECT_EQ((*m)[3].model, "unet");
  EXPECT_EQ(FindDtrBaseline(*m, "unet", 64), &(*m)[2]);
  EXPECT_EQ(FindDtrBaseline(*m, "unet", 32), nullptr);

  // A misspelt key alone stands for its model.
  absl::StatusOr<std::vector<DtrMeasurement>> typo = LoadDtrMeasurements(
      WriteFile("typo.json", {absl::StrCat(R"({"inceptiov4": [)", run, "]}")}));
  ASSERT_TRUE(typo.ok()) << typo.status();
  ASSERT_EQ(typo->size(), 2u);
  EXPECT_EQ((*typo)[0].model, "inceptionv4");
}

TEST(DtrMeasuredTest, ErrorsNameTheRunAndTheKey) {
  absl::StatusOr<std::vector<DtrMeasurement>> m = LoadDtrMeasurements(WriteFile(
      "no_budget.json", {R"({"unet": [{"specific_params": {"type": "dtr",
                    "batch_size": 6}, "summary": "error"}]})"}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(),
              HasSubstr("no_budget.json: model 'unet' run 0: expected key "
                        "\"memory_budget\" in specific_params"));

  m = LoadDtrMeasurements(WriteFile(
      "no_median.json",
      {R"({"unet": [{"specific_params": {"type": "baseline", "batch_size": 6},
           "summary": [{"time": {"mean": 1.0}, "total_mem": {"median": 2}}]}]})"}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(),
              HasSubstr("run 0: expected key \"median\" in summary.time"));

  m = LoadDtrMeasurements(WriteFile("broken.json", {"{\"unet\": ["}));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("broken.json: expected a JSON"));

  EXPECT_EQ(LoadDtrMeasurements("/no/such/file.json").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(DtrMeasuredTest, LogNamesMapToModelKeys) {
  absl::StatusOr<DtrLogModel> m = DtrModelFromLogName(
      "/x/y/inceptionv4-64-10000000000.0-2020-10-1-10-55-0-default.log");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->model, "inceptionv4");
  EXPECT_EQ(m->batch, 64);
  EXPECT_TRUE(m->same_config_as_measured);
  m = DtrModelFromLogName("unroll_gan-512-10000000000.0-2020-default.log");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->model, "unroll_gan");
  EXPECT_EQ(m->batch, 512);
  EXPECT_FALSE(m->same_config_as_measured);
  m = DtrModelFromLogName("inceptiov4-64-1.0-default.log");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->model, "inceptionv4");
  EXPECT_FALSE(DtrModelFromLogName("model.log").ok());
  EXPECT_FALSE(DtrModelFromLogName("unet-six-8.0-default.log").ok());
}

// --- The measured logs, where present. ---

std::string TraceDir() {
  const char* env = std::getenv("DELTAD_DTR_TRACES");
  return env != nullptr && *env != '\0' ? env : DELTAD_DTR_TRACES;
}

// Peak bytes of storage live at once, walking the trace: a storage (of a
// constant or output) lives while any value on it (itself, its views, its
// versions) does. Constants are live from the start, as Validate() has it.
int64_t PeakLiveBytes(const Trace& t) {
  const size_t n = t.values.size();
  std::vector<int32_t> root(n);
  for (size_t v = 0; v < n; ++v) {
    const TraceValue& val = t.values[v];
    const bool shared = val.kind == Kind::kAlias || val.kind == Kind::kVersion;
    root[v] = shared ? root[val.base] : static_cast<int32_t>(v);
  }
  std::vector<int32_t> holders(n, 0);
  int64_t live = 0, peak = 0;
  auto add = [&](int32_t v) {
    if (holders[root[v]]++ == 0) live += t.values[root[v]].bytes;
  };
  auto drop = [&](int32_t v) {
    if (--holders[root[v]] == 0) live -= t.values[root[v]].bytes;
  };
  for (size_t v = 0; v < n; ++v) {
    if (t.values[v].kind == Kind::kConstant) add(static_cast<int32_t>(v));
  }
  peak = live;
  for (int32_t v : t.initial_releases) drop(v);
  for (const TraceOp& op : t.ops) {
    for (int32_t v : op.outputs) {
      add(v);
      if (t.values[v].kind == Kind::kVersion) drop(t.values[v].base);
    }
    peak = std::max(peak, live + op.workspace_bytes);
    for (int32_t v : op.releases) drop(v);
  }
  return peak;
}

bool FileHas(const std::string& path, const std::string& text) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str().find(text) != std::string::npos;
}

TEST(DtrRealLogsTest, EachLogImportsWithPlausibleTotals) {
  const std::string dir = TraceDir();
  const std::vector<std::string> logs = ListDtrLogs(dir);
  if (logs.empty()) {
    GTEST_SKIP() << "no DTR logs (*.log) in '" << dir
                 << "' (set DELTAD_DTR_TRACES or the CMake cache variable of "
                    "that name to their folder)";
  }
  absl::StatusOr<std::vector<DtrMeasurement>> measured =
      LoadDtrMeasurements(dir + "/measured-data-full.json");
  if (!measured.ok()) {
    std::printf("no measured data to compare with: %s\n",
                std::string(measured.status().message()).c_str());
  }
  std::printf("%-16s %6s %6s %5s %10s %10s | %s\n", "log", "ops", "values",
              "bwd", "sum ms", "peak MB", "measured baseline");
  for (const std::string& path : logs) {
    SCOPED_TRACE(path);
    absl::StatusOr<Trace> t = ImportDtrLog(path);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(t->Validate().ok()) << t->Validate();
    const auto backward = std::count_if(
        t->ops.begin(), t->ops.end(),
        [](const TraceOp& op) { return op.phase == Phase::kBackward; });
    const auto forward = static_cast<int64_t>(t->ops.size()) - backward;
    EXPECT_GT(forward, 0);
    // The unrolled GAN's log has no BACKWARD annotation: its backward passes
    // are interleaved with the unrolled steps, so all its ops stay forward.
    if (FileHas(path, "\"BACKWARD\"")) {
      EXPECT_GT(backward, 0);
    } else {
      EXPECT_EQ(backward, 0);
      std::printf("note: %s has no BACKWARD annotation; all ops are forward\n",
                  std::filesystem::path(path).filename().c_str());
    }
    const double sum_ms = static_cast<double>(t->ComputeNs()) / 1e6;
    const int64_t peak = PeakLiveBytes(*t);
    // Each was one iteration on a 12 GB Titan V: some work, within memory.
    EXPECT_GT(sum_ms, 1.0);
    EXPECT_LT(sum_ms, 60'000.0);
    EXPECT_GT(peak, 1'000'000);
    EXPECT_LT(peak, 12'884'901'888);
    std::string baseline = "none";
    absl::StatusOr<DtrLogModel> key = DtrModelFromLogName(path);
    ASSERT_TRUE(key.ok()) << key.status();
    const DtrMeasurement* b =
        measured.ok() ? FindDtrBaseline(*measured, key->model, key->batch)
                      : nullptr;
    if (b != nullptr && key->same_config_as_measured) {
      const double mem_ratio = peak / 1e6 / b->total_mem_mb;
      const double time_ratio = sum_ms / b->median_ms;
      baseline = absl::StrCat(b->model, " b", b->batch, ": ", b->median_ms,
                              " ms, ", b->total_mem_mb, " MB (peak/total ",
                              mem_ratio, ", sum/time ", time_ratio, ")");
      // The same iteration: the ops' times add up to about the measured
      // time, the trace's live storage to about the memory PyTorch held.
      EXPECT_GT(time_ratio, 0.5);
      EXPECT_LT(time_ratio, 1.5);
      EXPECT_GT(mem_ratio, 0.5);
      EXPECT_LT(mem_ratio, 1.1);
    } else if (b != nullptr) {
      baseline = absl::StrCat("another configuration (", b->median_ms, " ms, ",
                              b->total_mem_mb, " MB): not compared");
    } else if (measured.ok()) {
      baseline =
          absl::StrCat("none for ", key->model, " at batch ", key->batch);
    }
    std::printf("%-16s %6zu %6zu %5ld %10.1f %10.1f | %s\n", key->model.c_str(),
                t->ops.size(), t->values.size(), static_cast<long>(backward),
                sum_ms, peak / 1e6, baseline.c_str());
  }
}

TEST(DtrRealLogsTest, MeasuredResultsParse) {
  const std::string dir = TraceDir();
  for (const char* file :
       {"measured-data-full.json", "measured-large-input.json"}) {
    const std::string path = absl::StrCat(dir, "/", file);
    if (!std::filesystem::exists(path)) {
      GTEST_SKIP() << "no " << file << " in '" << dir
                   << "' (set DELTAD_DTR_TRACES to the DTR traces folder)";
    }
    SCOPED_TRACE(path);
    absl::StatusOr<std::vector<DtrMeasurement>> m = LoadDtrMeasurements(path);
    ASSERT_TRUE(m.ok()) << m.status();
    int baselines = 0, dtr = 0;
    for (const DtrMeasurement& r : *m) {
      EXPECT_NE(r.model, "inceptiov4");
      EXPECT_GT(r.median_ms, 0);
      EXPECT_GT(r.mean_ms, 0);
      EXPECT_GT(r.total_mem_mb, 0);
      EXPECT_GT(r.batch, 0);
      if (r.type == "baseline") {
        ++baselines;
        EXPECT_EQ(r.budget_bytes, 0);
      } else {
        EXPECT_EQ(r.type, "dtr");
        ++dtr;
        EXPECT_GE(r.budget_bytes, 1'000'000'000);
      }
    }
    EXPECT_GT(baselines, 0);
    EXPECT_GT(dtr, 0);
    std::printf("%s: %zu runs, %d baseline, %d dtr\n", file, m->size(),
                baselines, dtr);
  }
}

}  // namespace
}  // namespace deltad::sim
