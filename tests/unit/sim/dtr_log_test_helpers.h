#ifndef DELTAD_TESTS_UNIT_SIM_DTR_LOG_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_SIM_DTR_LOG_TEST_HELPERS_H_

// What the dtr_*_test.cc files share: writing DTR logs line by line and
// importing them.

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// Writes `lines` as a log file under the test's temporary folder.
inline std::string WriteFile(const std::string& name,
                             const std::vector<std::string>& lines) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name);
  std::ofstream out(path, std::ios::trunc);
  for (const std::string& line : lines) out << line << "\n";
  return path;
}

inline std::string Constant(const std::string& name, int64_t bytes) {
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
inline std::string Call(const std::string& op,
                        const std::vector<std::string>& args,
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

inline std::string Release(const std::string& name) {
  return absl::StrCat(R"({"INSTRUCTION":"RELEASE","NAME":")", name, "\"}");
}
inline std::string Copy(const std::string& src, const std::string& dst) {
  return absl::StrCat(R"({"DST":")", dst, R"(","INSTRUCTION":"COPY","SRC":")",
                      src, "\"}");
}
inline std::string CopyFrom(const std::string& src, const std::string& dst) {
  return absl::StrCat(R"({"DST":")", dst,
                      R"(","INSTRUCTION":"COPY_FROM","SRC":")", src, "\"}");
}
inline constexpr char kStart[] =
    R"({"ANNOTATION":"START","INSTRUCTION":"ANNOTATE"})";
inline constexpr char kBackward[] =
    R"({"ANNOTATION":"BACKWARD","INSTRUCTION":"ANNOTATE"})";

inline Trace MustImport(const std::string& name,
                        const std::vector<std::string>& lines) {
  absl::StatusOr<Trace> t = ImportDtrLog(WriteFile(name, lines));
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return Trace{};
  EXPECT_TRUE(t->Validate().ok()) << t->Validate();
  return *std::move(t);
}

}  // namespace deltad::sim

#endif  // DELTAD_TESTS_UNIT_SIM_DTR_LOG_TEST_HELPERS_H_
