#include "bench/steady_state_section.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/simulator.h"
#include "policies/sim/steady_state_policy.h"

namespace deltad::sim {
namespace {

constexpr char kSteady[] = "delta-steady";
constexpr double kPlanningShare = 0.05;  // of the iteration planned
constexpr double kTie = 1.005;           // within 0.5% counts as equal

}  // namespace

absl::StatusOr<std::string> SteadyStateSection(
    const std::vector<SteadyStateTrace>& traces,
    const std::vector<std::string>& policies, const std::vector<double>& ratios,
    int iterations, AllocatorKind allocator, int64_t host_bytes) {
  std::ostringstream md;
  md << "### Steady state: " << iterations << " iterations, the first "
     << "included\n\n"
     << "Each policy trains " << iterations
     << " iterations back to back; each cell is their total time against "
     << iterations
     << " ideal iterations (`-`: does not fit). `delta-steady` runs `delta` "
        "in the first iteration while it records the accesses, then "
        "replays the recording three times under `delta` and each candidate "
        "plan and follows the one whose third replayed iteration is fastest "
        "(policies/sim/steady_state_policy.h); `planning` is those "
        "replays' wall time on this machine against the simulated "
        "iteration it plans (the target's measure), and their CPU time: "
        "they run on "
     << SteadyStatePolicy::DefaultPlannerThreads()
     << " threads at once, one per core, each taking the next replay "
        "(`0.0 ms`: every iteration ran in its ideal time, nothing to "
        "plan).\n\n";
  int cells = 0;
  int cells_met = 0;
  int plans = 0;
  int plans_met = 0;
  double worst_share = 0;
  std::vector<std::string> misses;
  for (const SteadyStateTrace& trace : traces) {
    auto peak = UnlimitedPeak(*trace.program, trace.device, allocator);
    if (!peak.ok()) return peak.status();
    md << "**" << trace.name << "**\n\n| budget | "
       << absl::StrJoin(policies, " | ") << " | planning |\n|---:|";
    for (size_t i = 0; i <= policies.size(); ++i) md << "---:|";
    md << "\n";
    for (double ratio : ratios) {
      SimOptions o;
      o.budget_bytes = static_cast<int64_t>(ratio * static_cast<double>(*peak));
      o.host_bytes = host_bytes;
      o.allocator = allocator;
      o.iterations = iterations;
      std::map<std::string, SimResult> results;
      md << "| " << absl::StrFormat("%.1f", ratio);
      for (const std::string& name : policies) {
        auto policy = MakePolicy(name);
        if (!policy.ok()) return policy.status();
        auto r = Simulate(*trace.program, trace.device, **policy, o);
        if (!r.ok() &&
            r.status().code() != absl::StatusCode::kFailedPrecondition) {
          return absl::Status(
              r.status().code(),
              absl::StrCat(trace.name, ", ", name, ": ", r.status().message()));
        }
        if (r.ok()) results[name] = *r;
        md << " | "
           << (r.ok() && r->fits ? absl::StrFormat("%.3f", r->total_slowdown())
                                 : std::string("-"));
      }
      std::string planning = "-";
      auto steady = results.find(kSteady);
      if (steady != results.end() && steady->second.fits) {
        const double share = static_cast<double>(steady->second.planning_ns) /
                             static_cast<double>(steady->second.makespan_ns);
        planning = absl::StrFormat(
            "%.1f ms (%.1f%%), CPU %.1f ms", steady->second.planning_ns / 1e6,
            100 * share, steady->second.planning_cpu_ns / 1e6);
        ++plans;
        plans_met += share <= kPlanningShare ? 1 : 0;
        worst_share = std::max(worst_share, share);
        bool best = true;
        for (const auto& [name, r] : results) {
          if (name == kSteady || !r.fits) continue;
          if (steady->second.total_slowdown() > r.total_slowdown() * kTie) {
            best = false;
            misses.push_back(absl::StrFormat(
                "%s at %.1f: %s %.3f vs %s %.3f", trace.name, ratio, kSteady,
                steady->second.total_slowdown(), name, r.total_slowdown()));
          }
        }
        ++cells;
        cells_met += best ? 1 : 0;
      } else {
        bool any = false;
        for (const auto& [name, r] : results) any = any || r.fits;
        if (any) {
          ++cells;
          misses.push_back(absl::StrFormat("%s at %.1f: %s does not fit",
                                           trace.name, ratio, kSteady));
        }
      }
      md << " | " << planning << " |\n";
    }
    md << "\n";
  }
  md << "| target | measured | result |\n|---|---|---|\n"
     << "| `delta-steady` no slower in total than any other policy where "
        "anything fits (ties within 0.5%) | "
     << cells_met << " of " << cells << " cells | **"
     << (cells > 0 && cells_met == cells ? "met" : "MISSED") << "** |\n"
     << "| planning at most 5% of the iteration it plans | " << plans_met
     << " of " << plans << " (worst "
     << absl::StrFormat("%.1f%%", 100 * worst_share) << ") | **"
     << (plans > 0 && plans_met == plans ? "met" : "MISSED") << "** |\n\n";
  if (!misses.empty()) {
    md << "Where `delta-steady` is slower: " << absl::StrJoin(misses, "; ")
       << ".\n\n";
  }
  return md.str();
}

}  // namespace deltad::sim
