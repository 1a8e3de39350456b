#ifndef DELTAD_BENCH_BENCH_TRACES_H_
#define DELTAD_BENCH_BENCH_TRACES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/policy_table.h"
#include "policies/sim/model_traces.h"

namespace deltad::sim {

// Where policy_bench's traces come from (its flags).
struct TraceSources {
  std::vector<std::string> trace_files;  // recorded, the project's format
  std::string dtr_dir;  // the measured DTR logs; empty: DefaultDtrTraceDir
  std::vector<std::string> models;  // model traces to build
  std::string model_device;         // their profile, and the recorded ones'
  int model_batch = 32;
  Optimizer optimizer = Optimizer::kAdam;
};

// The recorded files first (a file that does not parse, validate or
// compile is an error naming it), then the DTR logs (those that do not
// import are skipped, saying so) and the model traces. A recorded trace
// named like another gets a suffix: rows are found by trace name.
absl::StatusOr<std::vector<BenchTrace>> LoadTraces(const TraceSources& from);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_BENCH_TRACES_H_
