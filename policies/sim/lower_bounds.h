#ifndef DELTAD_POLICIES_SIM_LOWER_BOUNDS_H_
#define DELTAD_POLICIES_SIM_LOWER_BOUNDS_H_

#include <cstdint>

#include "policies/sim/device_profile.h"
#include "policies/sim/program.h"

namespace deltad::sim {

// Makespan lower bounds for a budget. compute_ns: every op must run.
// swap_only_ns: the offloading paper's LB (Proposition 3),
// max(compute, 2 (peak - budget) / beta): at least peak - budget bytes must
// leave the device before the peak step and come back after it. Each way is
// charged at its own rate (excess / d2h + excess / h2d), which is the
// paper's bound for a symmetric link and still a bound for an asymmetric
// one. It assumes what is offloaded is read again (true of saved
// activations).
struct LowerBounds {
  int64_t compute_ns = 0;
  int64_t swap_only_ns = 0;
};

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_LOWER_BOUNDS_H_
