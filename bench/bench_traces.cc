#include "bench/bench_traces.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/dtr_measured.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace_io.h"

namespace deltad::sim {
namespace {

// The traces of --trace_files, in their order. A file that does not parse,
// validate or compile is an error that names it.
absl::StatusOr<std::vector<BenchTrace>> LoadTraceFiles(
    const TraceSources& from) {
  std::vector<BenchTrace> traces;
  if (from.trace_files.empty()) return traces;
  auto device = FindDeviceProfile(from.model_device);
  if (!device.ok()) return device.status();
  for (const std::string& path : from.trace_files) {
    // Its message names the file (and the line, for a parse error).
    auto trace = ReadTraceFile(path);
    if (!trace.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--trace_files: ", trace.status().message()));
    }
    auto program = Compile(*trace);
    if (!program.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--trace_files: ", path, ": ", program.status().message()));
    }
    if (program->steps.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--trace_files: ", path, ": the trace has no ops"));
    }
    BenchTrace t;
    t.name = trace->name;
    t.source = "recorded";
    t.device = device->name;
    t.program = std::move(*program);
    traces.push_back(std::move(t));
  }
  return traces;
}

// The measured DTR logs and the model traces.
std::vector<BenchTrace> LoadBuiltInTraces(const TraceSources& from) {
  std::vector<BenchTrace> traces;
  std::string dir = from.dtr_dir;
  if (dir.empty()) dir = DefaultDtrTraceDir();
  const std::vector<std::string> logs = ListDtrLogs(dir);
  if (logs.empty()) {
    std::fprintf(stderr,
                 "policy_bench: no DTR logs in %s (set --traces or "
                 "DELTAD_DTR_TRACES): running the other traces only\n",
                 dir.c_str());
  } else {
    std::fprintf(stderr, "policy_bench: DTR logs from %s\n", dir.c_str());
  }
  for (const std::string& path : logs) {
    auto trace = ImportDtrLog(path);
    if (!trace.ok()) {
      std::fprintf(stderr, "policy_bench: skipping %s: %s\n", path.c_str(),
                   std::string(trace.status().message()).c_str());
      continue;
    }
    auto program = Compile(*trace);
    if (!program.ok()) continue;
    BenchTrace t;
    auto model = DtrModelFromLogName(path);
    t.name = model.ok() ? absl::StrCat(model->model, "-", model->batch)
                        : std::filesystem::path(path).stem().string();
    if (model.ok() && model->same_config_as_measured) {
      t.dtr_model = model->model;
      t.dtr_batch = model->batch;
    }
    t.source = "dtr-log";
    t.device = "titan-v";  // where the logs were measured
    t.cnn = absl::StrContains(t.name, "densenet") ||
            absl::StrContains(t.name, "resnet") ||
            absl::StrContains(t.name, "inception") ||
            absl::StrContains(t.name, "unet");
    t.program = std::move(*program);
    traces.push_back(std::move(t));
  }
  auto device = FindDeviceProfile(from.model_device);
  if (!device.ok()) {
    std::fprintf(stderr, "policy_bench: %s\n",
                 std::string(device.status().message()).c_str());
    return traces;
  }
  for (const std::string& m : from.models) {
    ModelOptions opt;
    opt.batch = from.model_batch;
    opt.optimizer = from.optimizer;
    if (m == "gpt") opt.batch = std::max(1, opt.batch / 4);
    auto trace = BuildModelTrace(m, opt, *device);
    if (!trace.ok()) {
      std::fprintf(stderr, "policy_bench: %s: %s\n", m.c_str(),
                   std::string(trace.status().message()).c_str());
      continue;
    }
    auto program = Compile(*trace);
    if (!program.ok()) continue;
    BenchTrace t;
    t.name = trace->name;
    t.source = "model";
    t.device = device->name;
    t.cnn = m != "gpt";
    t.program = std::move(*program);
    traces.push_back(std::move(t));
  }
  return traces;
}

}  // namespace

absl::StatusOr<std::vector<BenchTrace>> LoadTraces(const TraceSources& from) {
  // The recorded files first, so that a bad one fails before the rest loads.
  auto recorded = LoadTraceFiles(from);
  if (!recorded.ok()) return recorded.status();
  std::vector<BenchTrace> traces = LoadBuiltInTraces(from);
  // Rows are found by trace name: a recorded trace named like another one
  // gets a suffix.
  for (BenchTrace& t : *recorded) {
    const std::string base = t.name;
    for (int n = 2;
         std::any_of(traces.begin(), traces.end(),
                     [&](const BenchTrace& o) { return o.name == t.name; });
         ++n) {
      t.name = absl::StrCat(base, "-", n);
    }
    traces.push_back(std::move(t));
  }
  return traces;
}

}  // namespace deltad::sim
