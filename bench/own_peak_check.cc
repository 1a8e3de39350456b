#include "bench/own_peak_check.h"

#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/allocator_model.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/random_graphs.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

absl::StatusOr<std::string> OwnPeakSection(
    int graphs, const std::vector<std::string>& policies,
    const DeviceProfile& device) {
  const std::vector<AllocatorKind> allocators = {
      AllocatorKind::kExact, AllocatorKind::kBestFit, AllocatorKind::kVmChunks,
      AllocatorKind::kPyTorchCaching};
  // (allocator, policy) -> (runs that did not fit, of them fragmentation).
  std::map<std::pair<int, std::string>, std::pair<int, int>> misses;
  std::vector<std::string> examples;
  std::vector<int> ranged(allocators.size(), 0);  // fitted after FreeRangeFor
  int runs = 0;
  for (int seed = 1; seed <= graphs; ++seed) {
    auto program = Compile(RandomLayerGraph(seed));
    if (!program.ok()) return program.status();
    for (size_t a = 0; a < allocators.size(); ++a) {
      // The peak of a run of as many iterations as the policy's, by that
      // count: most policies share one.
      std::map<int, int64_t> peaks;
      for (const std::string& name : policies) {
        const int iterations = IterationsFor(name);
        if (!peaks.contains(iterations)) {
          auto peak =
              UnlimitedPeak(*program, device, allocators[a], iterations);
          if (!peak.ok()) return peak.status();
          peaks[iterations] = *peak;
        }
        auto policy = MakePolicy(name);
        if (!policy.ok()) return policy.status();
        SimOptions o;
        o.budget_bytes = peaks[iterations];
        o.host_bytes = int64_t{128} << 30;
        o.allocator = allocators[a];
        o.iterations = iterations;
        auto r = Simulate(*program, device, **policy, o);
        if (!r.ok()) {
          return absl::Status(r.status().code(),
                              absl::StrCat(program->name, ", ", name, ": ",
                                           r.status().message()));
        }
        ++runs;
        if (r->fits && r->range_releases > 0) ++ranged[a];
        if (r->fits) continue;
        auto& [count, fragmented] = misses[{static_cast<int>(a), name}];
        ++count;
        if (absl::StrContains(r->failure, "(fragmentation:")) {
          ++fragmented;
        } else if (examples.size() < 5) {
          examples.push_back(absl::StrCat(program->name, " ", name, " ",
                                          AllocatorKindName(allocators[a]),
                                          ": ", r->failure));
        }
      }
    }
  }
  std::ostringstream md;
  md << "### Every planner at its own peak (random layer graphs)\n\n"
     << graphs << " random layered networks (`RandomLayerGraph`, seeds 1.."
     << graphs
     << ": 6-40 layers, skip connections, activations of 4 KiB-48 MiB), "
        "each policy at a budget of the trace's peak under the allocator "
        "model (what `none` occupies there, rounding and holes included), "
        "on the "
     << device.name << " profile: " << runs
     << " runs; each policy's budget is the peak of a run of as many "
        "iterations as it runs (`delta-replay` 2, `delta-steady` 3; where "
        "an allocator model places blocks, the second iteration lays its "
        "tensors out around what the first left and can need more: one "
        "graph under `pytorch-caching`). Where the free bytes "
        "are enough but in pieces once the policy has released what it "
        "would, the simulator frees the blocks of the range that holds the "
        "allocation at the least cost (`Engine::FreeRangeFor`: evicting what "
        "can be rebuilt, offloading the rest), as a memory manager would "
        "under any policy; the blocks the step itself uses cannot move. "
        "Target: every run fits, or the run says why not.\n\n"
     << "| allocator model | runs that did not fit | of them fragmentation "
        "| policies | runs that fitted after freeing a range |\n"
        "|---|---:|---:|---|---:|\n";
  int total = 0;
  int total_fragmented = 0;
  for (size_t a = 0; a < allocators.size(); ++a) {
    int count = 0;
    int fragmented = 0;
    std::vector<std::string> who;
    for (const auto& [key, value] : misses) {
      if (key.first != static_cast<int>(a)) continue;
      count += value.first;
      fragmented += value.second;
      who.push_back(absl::StrCat(key.second, " ", value.first));
    }
    total += count;
    total_fragmented += fragmented;
    md << "| `" << AllocatorKindName(allocators[a]) << "` | " << count << " | "
       << fragmented << " | " << (who.empty() ? "-" : absl::StrJoin(who, ", "))
       << " | " << ranged[a] << " |\n";
  }
  md << "\nResult: **"
     << (total == 0 ? "met"
         : total == total_fragmented
             ? "missed where blocks cannot move: every run that did not fit "
               "ran out of one piece of memory with enough bytes free "
               "(fragmentation) where the blocks in use split every range "
               "that could hold it, and says so"
             : "MISSED")
     << "** (" << total << " of " << runs << " runs did not fit).\n";
  if (!examples.empty()) {
    md << "\nOther failures: " << absl::StrJoin(examples, "; ") << ".\n";
  }
  md << "\n";
  return md.str();
}

}  // namespace deltad::sim
