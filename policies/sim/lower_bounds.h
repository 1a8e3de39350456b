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
//
// mixed_ns: one iteration of any schedule, offloads and recomputes mixed,
// the first or a later one. At a step s, the storages it reads or makes
// (and its workspace) must be on the device, and so must the others that
// live across s and are read after it, but for E = (their bytes) - budget
// bytes at least. Each of those E bytes left the device before s began
// (offloaded: its copy out done, over the D2H link from the iteration's
// start, unless it outlives iterations and an earlier one left it on the
// host, which the bound takes to be so for every such byte; or evicted,
// for nothing) and comes back after s ends (reloaded over the
// H2D link; or recomputed, on the compute stream, which costs its
// producer's op time at least). Swapping x of them and recomputing the
// rest takes at least
//   max(C_before, x / d2h) + t_s + max(C_after + R(E - x), x / h2d),
// where R(y) is the least op time that rebuilds y bytes of them (whole
// producers, taken cheapest per byte first, the last one in part: a
// fractional knapsack, below any real choice) and x covers what cannot be
// rebuilt. mixed_ns is its minimum over x (convex and piecewise linear:
// taken at its breakpoints), the largest over the steps where most must
// live (the 64 with the most bytes live), and never below compute_ns. It
// leaves out what only adds time: copies' latency, the parents a rebuild
// needs, other copies on the links.
struct LowerBounds {
  int64_t compute_ns = 0;
  int64_t swap_only_ns = 0;
  int64_t mixed_ns = 0;
};

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_LOWER_BOUNDS_H_
