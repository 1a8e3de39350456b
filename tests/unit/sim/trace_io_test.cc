#include "policies/sim/trace_io.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/trace.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using Kind = TraceValue::Kind;

// Every statement and key, with comments and blank lines in between.
constexpr absl::string_view kEveryStatement = R"(# a hand-written trace
deltad-trace 1   # the magic line may carry a comment

name tiny-net
const x 1024
const w 256
const stale 64
release stale
op conv2d fwd 100 ws=512 in=x,w out=y:2048,z:128
# a comment between ops

op view fwd 5 in=y alias=yv:y
op relu_ bwd 7 in=yv mut=y
op add bwd 3 in=y,z out=g:2048 alias=gv:g mut=w
release yv,y,z
release gv,g
)";

void ExpectSameTrace(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.name, b.name);
  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t i = 0; i < a.values.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("value ", i));
    EXPECT_EQ(a.values[i].name, b.values[i].name);
    EXPECT_EQ(a.values[i].bytes, b.values[i].bytes);
    EXPECT_EQ(a.values[i].kind, b.values[i].kind);
    EXPECT_EQ(a.values[i].base, b.values[i].base);
    EXPECT_EQ(a.values[i].op, b.values[i].op);
  }
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (size_t i = 0; i < a.ops.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("op ", i));
    EXPECT_EQ(a.ops[i].name, b.ops[i].name);
    EXPECT_EQ(a.ops[i].phase, b.ops[i].phase);
    EXPECT_EQ(a.ops[i].time_ns, b.ops[i].time_ns);
    EXPECT_EQ(a.ops[i].workspace_bytes, b.ops[i].workspace_bytes);
    EXPECT_EQ(a.ops[i].inputs, b.ops[i].inputs);
    EXPECT_EQ(a.ops[i].outputs, b.ops[i].outputs);
    EXPECT_EQ(a.ops[i].releases, b.ops[i].releases);
  }
  EXPECT_EQ(a.initial_releases, b.initial_releases);
}

// The value named `name` that op `op` creates (or -1).
int32_t CreatedBy(const Trace& t, int32_t op, absl::string_view name) {
  for (int32_t v : t.ops[op].outputs) {
    if (t.values[v].name == name) return v;
  }
  return -1;
}

// Parses `text` under the source "t.trace" and expects an InvalidArgument
// error that starts with "t.trace:<line>:" and contains `what`.
void ExpectParseError(absl::string_view text, int line,
                      absl::string_view what) {
  SCOPED_TRACE(text);
  auto t = ParseTrace(text, "t.trace");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()),
              StartsWith(absl::StrCat("t.trace:", line, ":")));
  EXPECT_THAT(t.status().message(), HasSubstr(what));
}

std::string TempPath(absl::string_view stem) {
  return (std::filesystem::path(::testing::TempDir()) /
          absl::StrCat(stem, "-", getpid(), ".trace"))
      .string();
}

TEST(TraceIo, ParsesEveryStatementAndKey) {
  auto t = ParseTrace(kEveryStatement);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name, "tiny-net");
  ASSERT_EQ(t->ops.size(), 4u);
  // Constants x, w, stale; stale is dropped before the first op.
  ASSERT_GE(t->values.size(), 3u);
  EXPECT_EQ(t->values[0].name, "x");
  EXPECT_EQ(t->values[0].kind, Kind::kConstant);
  EXPECT_EQ(t->values[0].bytes, 1024);
  ASSERT_EQ(t->initial_releases.size(), 1u);
  EXPECT_EQ(t->values[t->initial_releases[0]].name, "stale");

  const TraceOp& conv = t->ops[0];
  EXPECT_EQ(conv.name, "conv2d");
  EXPECT_EQ(conv.phase, Phase::kForward);
  EXPECT_EQ(conv.time_ns, 100);
  EXPECT_EQ(conv.workspace_bytes, 512);
  EXPECT_EQ(conv.inputs, (std::vector<int32_t>{0, 1}));
  const int32_t y = CreatedBy(*t, 0, "y");
  ASSERT_GE(y, 0);
  EXPECT_EQ(t->values[y].kind, Kind::kOutput);
  EXPECT_EQ(t->values[y].bytes, 2048);

  const int32_t yv = CreatedBy(*t, 1, "yv");
  ASSERT_GE(yv, 0);
  EXPECT_EQ(t->values[yv].kind, Kind::kAlias);
  EXPECT_EQ(t->values[yv].base, y);
  EXPECT_EQ(t->values[yv].bytes, 2048);

  const TraceOp& relu = t->ops[2];
  EXPECT_EQ(relu.phase, Phase::kBackward);
  EXPECT_EQ(relu.workspace_bytes, 0);
  const int32_t y2 = CreatedBy(*t, 2, "y");
  ASSERT_GE(y2, 0);
  EXPECT_EQ(t->values[y2].kind, Kind::kVersion);
  EXPECT_EQ(t->values[y2].base, y);

  // After the update, `y` names the new version.
  const TraceOp& add = t->ops[3];
  EXPECT_EQ(add.inputs[0], y2);
  const int32_t gv = CreatedBy(*t, 3, "gv");
  ASSERT_GE(gv, 0);
  EXPECT_EQ(t->values[gv].base, CreatedBy(*t, 3, "g"));
  const int32_t w2 = CreatedBy(*t, 3, "w");
  ASSERT_GE(w2, 0);
  EXPECT_EQ(t->values[w2].kind, Kind::kVersion);
  EXPECT_EQ(t->values[w2].base, 1);
  // Both release lines after the last op go to it, in order.
  std::vector<std::string> released;
  for (int32_t v : add.releases) released.push_back(t->values[v].name);
  EXPECT_EQ(released, (std::vector<std::string>{"yv", "y", "z", "gv", "g"}));
  EXPECT_EQ(add.releases[1], y2);
}

TEST(TraceIo, FormatParsesBackToAnEqualTraceAndIsAFixedPoint) {
  auto first = ParseTrace(kEveryStatement);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string text = FormatTrace(*first);
  auto second = ParseTrace(text);
  ASSERT_TRUE(second.ok()) << second.status() << "\n" << text;
  ExpectSameTrace(*first, *second);
  EXPECT_EQ(FormatTrace(*second), text);
  // Every key survives formatting.
  EXPECT_THAT(text, StartsWith("deltad-trace 1\n"));
  for (absl::string_view piece :
       {"name tiny-net", "const x 1024", "release stale", " ws=512", " in=x,w",
        " out=y:2048,z:128", " alias=yv:y", " mut=y", " bwd ",
        "out=g:2048 alias=gv:g mut=w"}) {
    EXPECT_THAT(text, HasSubstr(piece));
  }
}

TEST(TraceIo, FormatsABuiltTraceThatParsesBackEqual) {
  TraceBuilder b("built");
  const int32_t x = b.Constant("x", 100);
  b.Op("matmul", Phase::kForward, 10, 64).Input(x);
  const int32_t y = b.Output("y", 200);
  b.Op("transpose", Phase::kForward, 1).Input(y);
  const int32_t yt = b.Alias("yt", y);
  b.Release(y);
  b.Op("scale_", Phase::kBackward, 2).Input(yt);
  const int32_t yt2 = b.Version(yt);
  b.Release(yt2);
  b.Release(x);
  const Trace built = std::move(b).Build();
  ASSERT_TRUE(built.Validate().ok());
  auto parsed = ParseTrace(FormatTrace(built));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameTrace(built, *parsed);
}

TEST(TraceIo, WriteThenReadThroughAFile) {
  auto t = ParseTrace(kEveryStatement);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::string path = TempPath("round-trip");
  ASSERT_TRUE(WriteTraceFile(*t, path).ok());
  auto read = ReadTraceFile(path);
  std::remove(path.c_str());
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameTrace(*t, *read);
}

TEST(TraceIo, WriteToAMissingDirectoryFails) {
  auto t = ParseTrace(kEveryStatement);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(WriteTraceFile(*t, "/nonexistent-dir/x/t.trace").ok());
}

TEST(TraceIo, ReadingAMissingFileIsNotFound) {
  auto t = ReadTraceFile("/nonexistent-dir/no-such.trace");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
}

TEST(TraceIo, ReadErrorsNameThePathAndLine) {
  const std::string path = TempPath("bad");
  {
    std::ofstream out(path);
    out << "deltad-trace 1\nconst x 4\nop f fwd 1 in=ghost\n";
  }
  auto t = ReadTraceFile(path);
  std::remove(path.c_str());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()),
              StartsWith(absl::StrCat(path, ":3:")));
  EXPECT_THAT(t.status().message(), HasSubstr("ghost"));
}

TEST(TraceIo, UsesTheDefaultSourceName) {
  auto t = ParseTrace("nonsense\n");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), StartsWith("<trace>:1:"));
}

TEST(TraceIo, RejectsAMissingMagicLine) {
  ExpectParseError("const x 4\n", 1, "deltad-trace 1");
  ExpectParseError("", 1, "deltad-trace 1");
  ExpectParseError("# only a comment\n\n", 3, "deltad-trace 1");
}

TEST(TraceIo, RejectsAWrongMagicLine) {
  ExpectParseError("deltad-trace 2\n", 1, "deltad-trace 1");
  ExpectParseError("# header\n\ndtr-trace 1\n", 3, "deltad-trace 1");
}

TEST(TraceIo, RejectsAnUnknownStatement) {
  ExpectParseError("deltad-trace 1\nconst x 4\n\ntensor y 8\n", 4, "'tensor'");
}

TEST(TraceIo, RejectsABadPhase) {
  ExpectParseError("deltad-trace 1\nop f forward 1\n", 2, "'forward'");
}

TEST(TraceIo, RejectsAShortOp) {
  ExpectParseError("deltad-trace 1\nop f fwd\n", 2, "op <operator>");
}

TEST(TraceIo, RejectsNonNumericOrNegativeTimes) {
  ExpectParseError("deltad-trace 1\nop f fwd soon\n", 2, "'soon'");
  ExpectParseError("deltad-trace 1\nop f fwd -5\n", 2, "'-5'");
}

TEST(TraceIo, RejectsNonNumericOrNegativeSizes) {
  ExpectParseError("deltad-trace 1\nconst x 4k\n", 2, "'4k'");
  ExpectParseError("deltad-trace 1\nconst x -4\n", 2, "'-4'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 out=y:big\n", 2, "'big'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 out=y:-1\n", 2, "'-1'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 ws=lots\n", 2, "'lots'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 ws=-8\n", 2, "'-8'");
}

TEST(TraceIo, RejectsAnUnknownKey) {
  ExpectParseError("deltad-trace 1\nop f fwd 1 grad=x\n", 2, "'grad'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 loose\n", 2, "'loose'");
}

TEST(TraceIo, RejectsAnOutputWithoutBytes) {
  ExpectParseError("deltad-trace 1\nop f fwd 1 out=y\n", 2, "<name>:<bytes>");
}

TEST(TraceIo, RejectsAnAliasWithoutBase) {
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 alias=v\n", 3,
                   "<name>:<base>");
}

TEST(TraceIo, RejectsUndefinedNamesWithLineAndName) {
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 in=x,ghost\n", 3,
                   "'ghost'");
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 alias=v:ghost\n", 3,
                   "'ghost'");
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 mut=ghost\n", 3,
                   "'ghost'");
}

TEST(TraceIo, RejectsANameUsedAfterItsRelease) {
  ExpectParseError(
      "deltad-trace 1\nconst x 4\nop f fwd 1 in=x out=y:4\nrelease x\n"
      "op g fwd 1 in=x\n",
      5, "'x'");
}

TEST(TraceIo, RejectsANameDefinedTwiceWhileLive) {
  ExpectParseError("deltad-trace 1\nconst x 4\nconst x 8\n", 3,
                   "'x' is already live");
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 in=x out=x:4\n", 3,
                   "'x' is already live");
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 alias=x:x\n", 3,
                   "'x' is already live");
  ExpectParseError("deltad-trace 1\nop f fwd 1 out=y:4,y:4\n", 2,
                   "'y' is already live");
}

TEST(TraceIo, AcceptsANameDefinedAgainAfterItsRelease) {
  auto t = ParseTrace(
      "deltad-trace 1\nconst x 4\nop f fwd 1 in=x out=y:8\nrelease y\n"
      "op g fwd 1 in=x out=y:16\nop h fwd 1 in=y\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->ops.size(), 3u);
  ASSERT_EQ(t->ops[2].inputs.size(), 1u);
  EXPECT_EQ(t->values[t->ops[2].inputs[0]].bytes, 16);
}

TEST(TraceIo, RejectsNamesWithForbiddenCharacters) {
  ExpectParseError("deltad-trace 1\nconst a:b 4\n", 2, "bad name 'a:b'");
  ExpectParseError("deltad-trace 1\nconst a,b 4\n", 2, "bad name 'a,b'");
  ExpectParseError("deltad-trace 1\nconst a=b 4\n", 2, "bad name 'a=b'");
  ExpectParseError("deltad-trace 1\nop f fwd 1 out=a=b:4\n", 2,
                   "bad name 'a=b'");
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 alias=v=w:x\n", 3,
                   "bad name 'v=w'");
}

TEST(TraceIo, RejectsAConstantAfterTheFirstOp) {
  ExpectParseError("deltad-trace 1\nconst x 4\nop f fwd 1 in=x\nconst y 4\n", 4,
                   "before the first op");
}

TEST(TraceIo, SkipsTheReleaseOfAnUndefinedName) {
  auto t = ParseTrace(
      "deltad-trace 1\nconst x 4\nrelease never\nop f fwd 1 in=x out=y:4\n"
      "release ghost,y,ghost2\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->initial_releases.empty());
  ASSERT_EQ(t->ops.size(), 1u);
  ASSERT_EQ(t->ops[0].releases.size(), 1u);
  EXPECT_EQ(t->values[t->ops[0].releases[0]].name, "y");
}

TEST(TraceIo, SkipsASecondReleaseOfTheSameName) {
  auto t = ParseTrace(
      "deltad-trace 1\nconst x 4\nop f fwd 1 in=x out=y:4\nrelease y,y\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->ops[0].releases.size(), 1u);
}

TEST(TraceIo, AnOpMayReadTheValueItUpdatesInPlace) {
  auto t = ParseTrace("deltad-trace 1\nconst w 4\nop sgd_ bwd 1 mut=w in=w\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->ops[0].inputs, (std::vector<int32_t>{0}));
  ASSERT_EQ(t->ops[0].outputs.size(), 1u);
  EXPECT_EQ(t->values[t->ops[0].outputs[0]].base, 0);
}

// Regression: a `name` statement once replaced the whole builder, dropping
// the constants and ops parsed before it while the table of live names still
// pointed at their old indices, so `in=a` read `b`.
TEST(TraceIo, ANameStatementAfterConstantsKeepsThem) {
  auto t = ParseTrace(
      "deltad-trace 1\nconst a 4\nname late\nconst b 8\n"
      "op f fwd 1 in=a out=y:4\n",
      "t.trace");
  if (!t.ok()) {
    EXPECT_THAT(std::string(t.status().message()), StartsWith("t.trace:3:"));
    return;
  }
  EXPECT_EQ(t->name, "late");
  ASSERT_EQ(t->ops.size(), 1u);
  ASSERT_EQ(t->ops[0].inputs.size(), 1u);
  EXPECT_EQ(t->values[t->ops[0].inputs[0]].name, "a");
}

// Regression: the writer once listed results as out=, alias=, mut= whatever
// their order, so `mut=y alias=v:y` (a view of the updated y) came back as
// a view of the old y.
TEST(TraceIo, FormatKeepsAViewOfAnUpdatedValueOnTheNewVersion) {
  auto first = ParseTrace(
      "deltad-trace 1\nconst x 4\nop f fwd 1 in=x out=y:8\n"
      "op g bwd 1 mut=y alias=v:y\n");
  ASSERT_TRUE(first.ok()) << first.status();
  const int32_t v = CreatedBy(*first, 1, "v");
  ASSERT_GE(v, 0);
  ASSERT_EQ(first->values[first->values[v].base].kind, Kind::kVersion);
  auto second = ParseTrace(FormatTrace(*first));
  ASSERT_TRUE(second.ok()) << second.status();
  const int32_t v2 = CreatedBy(*second, 1, "v");
  ASSERT_GE(v2, 0);
  EXPECT_EQ(second->values[second->values[v2].base].kind, Kind::kVersion);
}

}  // namespace
}  // namespace deltad::sim
