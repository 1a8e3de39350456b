#ifndef DELTAD_POLICIES_SIM_RANDOM_GRAPHS_H_
#define DELTAD_POLICIES_SIM_RANDOM_GRAPHS_H_

#include <cstdint>

#include "policies/sim/trace.h"

namespace deltad::sim {

// A random layered network's training iteration, the same for the same
// seed: 6 to 40 layers; each reads the previous layer's output and, one
// time in four, an earlier one's (a skip connection), and saves what it
// reads for backward; activations of 4 KiB to 48 MiB (log-uniform, so
// that both chunk rounding and small-block packing show); forward ops of
// 20 us to 2 ms, backward twice as long, some with a workspace; weights as
// constants updated by the backward op that reads them. Named
// "random-<seed>". Used to check that every planner fits at a budget of
// the trace's own peak under every allocator model.
Trace RandomLayerGraph(uint64_t seed);

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_RANDOM_GRAPHS_H_
