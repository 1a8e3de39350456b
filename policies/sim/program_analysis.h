#ifndef DELTAD_POLICIES_SIM_PROGRAM_ANALYSIS_H_
#define DELTAD_POLICIES_SIM_PROGRAM_ANALYSIS_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "policies/sim/program.h"

namespace deltad::sim {

// What every static plan needs to know about the program.
struct ProgramAnalysis {
  static constexpr int32_t kNever = std::numeric_limits<int32_t>::max();

  std::vector<std::vector<int32_t>> reads;  // steps reading each storage
  // Last forward step that creates or reads it; -1 unless the forward pass
  // created it.
  std::vector<int32_t> last_forward_use;
  std::vector<int32_t> saved;  // SavedActivations(), in creation order
  // Bytes read or created by the steps before j: the window paper's
  // variable sequence measured in bytes.
  std::vector<int64_t> access_prefix;

  int32_t NextUse(int32_t s, int32_t from) const {
    const std::vector<int32_t>& r = reads[s];
    auto it = std::lower_bound(r.begin(), r.end(), from);
    return it == r.end() ? kNever : *it;
  }
};

ProgramAnalysis AnalyzeProgram(const Program& program);

// Storages created in the forward pass and read again in a backward step,
// in creation order: what the static baselines release.
std::vector<int32_t> SavedActivations(const Program& program);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_PROGRAM_ANALYSIS_H_
