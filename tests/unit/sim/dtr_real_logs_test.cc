// Finding the measured DTR logs, and importing those present.

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
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/dtr_measured.h"
#include "policies/sim/trace.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Kind = TraceValue::Kind;

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
