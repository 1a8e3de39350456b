#ifndef DELTAD_BENCH_OWN_PEAK_CHECK_H_
#define DELTAD_BENCH_OWN_PEAK_CHECK_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/sim/device_profile.h"

namespace deltad::sim {

// policy_bench's check that every planner fits at a budget of the trace's
// own peak under each allocator model (what `none` occupies there; see
// UnlimitedPeak), on `graphs` random layer graphs (RandomLayerGraph, seeds
// 1..graphs). Returns a Markdown section with the runs that did not fit
// per allocator model and policy, and why; an error when a run failed.
absl::StatusOr<std::string> OwnPeakSection(
    int graphs, const std::vector<std::string>& policies,
    const DeviceProfile& device);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_OWN_PEAK_CHECK_H_
