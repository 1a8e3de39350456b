// The DTR logs ImportDtrLog refuses, each with the file, the line and what
// it expected.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/trace.h"
#include "policies/sim/trace_io.h"
#include "tests/unit/sim/dtr_log_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::HasSubstr;

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

}  // namespace
}  // namespace deltad::sim
