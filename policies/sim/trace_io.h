#ifndef DELTAD_POLICIES_SIM_TRACE_IO_H_
#define DELTAD_POLICIES_SIM_TRACE_IO_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// The text form of a trace, one statement a line:
//
//   deltad-trace 1
//   name resnet50-b32
//   const <name> <bytes>                       exists before the iteration
//   op <operator> fwd|bwd <time_ns> [ws=<bytes>] [in=<name>,...]
//      [out=<name>:<bytes>,...] [alias=<name>:<base>,...] [mut=<name>,...]
//   release <name>[,<name>...]                 drops names after the last op
//
// `alias` makes a view of a live value's storage; `mut` updates a live value
// in place (its name then refers to the new version). `#` starts a comment.
// Names hold no whitespace, ',', ':' or '='. A release of a name never
// defined is skipped, as in the DTR logs; any other undefined name is an
// error that says file:line and what was expected.
absl::StatusOr<Trace> ParseTrace(absl::string_view text,
                                 absl::string_view source = "<trace>");
absl::StatusOr<Trace> ReadTraceFile(const std::string& path);

std::string FormatTrace(const Trace& trace);
absl::Status WriteTraceFile(const Trace& trace, const std::string& path);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_TRACE_IO_H_
