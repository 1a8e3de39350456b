#include "policies/sim/program_analysis.h"

namespace deltad::sim {

ProgramAnalysis AnalyzeProgram(const Program& program) {
  ProgramAnalysis a;
  const size_t n = program.storages.size();
  const auto steps = static_cast<int32_t>(program.steps.size());
  a.reads.resize(n);
  a.last_forward_use.assign(n, -1);
  a.access_prefix.assign(program.steps.size() + 1, 0);
  for (int32_t t = 0; t < steps; ++t) {
    const Step& step = program.steps[t];
    const bool forward = step.phase == Phase::kForward;
    int64_t bytes = 0;
    for (int32_t s : step.reads) {
      a.reads[s].push_back(t);
      bytes += program.storages[s].bytes;
      if (forward && a.last_forward_use[s] >= 0) a.last_forward_use[s] = t;
    }
    for (int32_t s : step.creates) {
      bytes += program.storages[s].bytes;
      if (forward) a.last_forward_use[s] = t;
    }
    a.access_prefix[t + 1] = a.access_prefix[t] + bytes;
  }
  // Storage indices follow creation order.
  for (size_t s = 0; s < n; ++s) {
    const int32_t last_forward = a.last_forward_use[s];
    if (last_forward < 0) continue;
    for (int32_t t : a.reads[s]) {
      if (t > last_forward && program.steps[t].phase == Phase::kBackward) {
        a.saved.push_back(static_cast<int32_t>(s));
        break;
      }
    }
  }
  return a;
}

std::vector<int32_t> SavedActivations(const Program& program) {
  return AnalyzeProgram(program).saved;
}

}  // namespace deltad::sim
