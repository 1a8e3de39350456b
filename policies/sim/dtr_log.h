#ifndef DELTAD_POLICIES_SIM_DTR_LOG_H_
#define DELTAD_POLICIES_SIM_DTR_LOG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// Imports one op-level log written by the DTR paper's instrumented PyTorch
// (uwsampl/dtr-prototype; the format is described in the README beside the
// logs) as a Trace of one training iteration, named after the file.
//
// The iteration starts after the first `ANNOTATE START` (the whole file when
// there is none) and ends at the next `START` or at the end of the file; ops
// after `ANNOTATE BACKWARD` are Phase::kBackward. Other annotations are
// ignored. The log speaks of names, the Trace of values:
//   CONSTANT + MEMORY     a constant value of that storage size
//   CALL + per result     an op reading the values of ARGS; each result is
//     MEMORY + ALIAS      an output (ALIAS -1) of MEMORY bytes, or a view of
//                         ARGS[k]'s value (ALIAS k)
//   MUTATE                an op reading ARGS that makes a new version of the
//                         value of each argument listed in MUTATE
//   COPY                  DST becomes another name of SRC's value
//   COPY_FROM             DST drops its value and becomes a name of SRC's
//   RELEASE               drops a name; a name never defined (or already
//                         dropped) is skipped, as the logs hold such lines
// A value is released in the Trace when its last name is dropped; values
// still named at the end stay live. Errors say "path:line: expected ...":
// a line that is not a JSON object, a missing or mistyped key, a CALL not
// followed by its MEMORY/ALIAS lines, a name used (other than by RELEASE)
// while undefined, or a name defined while live. The result passes
// Trace::Validate().
absl::StatusOr<Trace> ImportDtrLog(const std::string& path);

// Where the measured logs are: $DELTAD_DTR_TRACES if set, else the shared
// traces beside the checkout, "../shared/traces/dtr" relative to the
// current directory.
std::string DefaultDtrTraceDir();

// The paths of the *.log files in `dir`, sorted; empty when `dir` does not
// exist, since only some of the published logs may have been copied.
std::vector<std::string> ListDtrLogs(const std::string& dir);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_DTR_LOG_H_
