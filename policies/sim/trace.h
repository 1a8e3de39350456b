#ifndef DELTAD_POLICIES_SIM_TRACE_H_
#define DELTAD_POLICIES_SIM_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace deltad::sim {

enum class Phase : uint8_t { kForward, kBackward };

// One value a name refers to during the iteration.
struct TraceValue {
  enum class Kind : uint8_t {
    kConstant,  // exists before the iteration (input, parameter): own storage,
                // not recomputable
    kOutput,    // created by an op: own storage
    kAlias,     // created by an op as a view of `base`'s storage
    kVersion,   // `base` updated in place by an op: same storage, new content
  };
  std::string name;
  int64_t bytes = 0;  // of its storage (a view or version repeats its base's)
  Kind kind = Kind::kOutput;
  int32_t base = -1;  // value viewed or updated (kAlias, kVersion)
  int32_t op = -1;    // op that created it; -1 for constants
};

struct TraceOp {
  std::string name;  // operator, e.g. "conv2d"
  Phase phase = Phase::kForward;
  int64_t time_ns = 0;           // measured or modelled compute time
  int64_t workspace_bytes = 0;   // temporary memory while it runs
  std::vector<int32_t> inputs;   // values read
  std::vector<int32_t> outputs;  // values created (outputs, views, versions)
  // Values whose name the framework drops right after this op.
  std::vector<int32_t> releases;
};

// One training iteration as a sequence of ops over values: the project's own
// trace format (see trace_io.h for its text form). Built by the model
// generators, the DTR log importer and the text reader; validated by
// Validate(). Plain data; thread compatible.
struct Trace {
  std::string name;
  std::vector<TraceValue> values;
  std::vector<TraceOp> ops;
  // Names dropped before the first op (constants copied and let go).
  std::vector<int32_t> initial_releases;

  // Sum of op times: the makespan with unlimited memory.
  int64_t ComputeNs() const;
  // Checks indices, sizes, kinds and that every value is used only while
  // live. The message names the op and value at fault.
  absl::Status Validate() const;
};

// A builder that keeps names unique and links ops, for generators and tests.
class TraceBuilder {
 public:
  explicit TraceBuilder(std::string name) { trace_.name = std::move(name); }
  void set_name(std::string name) { trace_.name = std::move(name); }

  int32_t Constant(absl::string_view name, int64_t bytes);
  // Starts an op; Output/Alias/Version/Input attach to the last one started.
  TraceBuilder& Op(absl::string_view name, Phase phase, int64_t time_ns,
                   int64_t workspace_bytes = 0);
  TraceBuilder& Input(int32_t value);
  int32_t Output(absl::string_view name, int64_t bytes);
  int32_t Alias(absl::string_view name, int32_t base);
  int32_t Version(int32_t base);
  // Drops a name after the last op started (before any op: at the start).
  void Release(int32_t value);

  const Trace& trace() const { return trace_; }
  Trace Build() && { return std::move(trace_); }

 private:
  int32_t AddValue(TraceValue v);
  Trace trace_;
};

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_TRACE_H_
