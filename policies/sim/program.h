#ifndef DELTAD_POLICIES_SIM_PROGRAM_H_
#define DELTAD_POLICIES_SIM_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

// A block of device memory behind one or more trace values (a value and its
// views share one storage). Storages are immutable: an in-place update makes
// a new storage that takes over the old one's memory (copy-on-write, as the
// DTR prototype does), so rebuilding any storage from its parents is valid.
struct Storage {
  int64_t bytes = 0;
  bool constant = false;  // exists before the iteration
  int32_t producer = -1;  // step that created it; -1 for constants
  // Whether it can always be rebuilt while it lives: it has a producer, and
  // every parent can be had (resident, restored, or rebuilt in turn) until
  // it is dropped.
  bool recomputable = false;
  int32_t freed_at = -1;         // step after which it is dropped; -1: never
  std::vector<int32_t> parents;  // storages its producer read
  std::string name;              // of the value that created it
};

// An in-place update: `created` replaces `old`, whose memory it reuses when
// `old` has no other name left after the step.
struct InPlace {
  int32_t created = 0;
  int32_t old = 0;
};

// A constant updated in place during an iteration (a weight, an optimizer
// state): `final` holds its value at the end, and the next iteration starts
// from it where `constant` was, on the device or the host.
struct Carry {
  int32_t final = 0;
  int32_t constant = 0;
};

struct Step {
  int32_t op = 0;  // index in the trace
  Phase phase = Phase::kForward;
  int64_t time_ns = 0;
  int64_t workspace_bytes = 0;
  bool conv = false;             // a convolution (for the vDNN baseline)
  std::vector<int32_t> reads;    // storages that must be on the device
  std::vector<int32_t> creates;  // new storages (in-place results included)
  std::vector<InPlace> in_place;
  std::vector<int32_t> frees;  // storages whose last name drops after it
  // What must be on the device during the step (its reads, its new
  // storages but those made in place of a storage it frees, its
  // workspace), and what is, with unlimited memory (the workspace too).
  int64_t need_bytes = 0;
  int64_t live_bytes = 0;
};

// A trace compiled to storages: what the simulator executes. Immutable
// after Compile(); thread safe to share.
struct Program {
  std::string name;
  std::vector<Storage> storages;
  std::vector<Step> steps;
  std::vector<int32_t> initial_frees;  // storages dropped before step 0
  std::vector<Carry> carries;

  int64_t compute_ns = 0;      // sum of step times: the ideal makespan
  int64_t constant_bytes = 0;  // storages present at the start
  // Most device memory in use at once with unlimited memory (workspace
  // included): the budget at which nothing has to be released.
  int64_t peak_bytes = 0;
  // Least memory any policy needs: the largest single step (its reads, its
  // new storages and its workspace). Below this nothing can run.
  int64_t min_budget_bytes = 0;
  int32_t min_budget_step = -1;

  bool Recomputable(int32_t storage) const {
    return storages[storage].recomputable;
  }
};

absl::StatusOr<Program> Compile(const Trace& trace);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_PROGRAM_H_
