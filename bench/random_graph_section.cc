#include "bench/random_graph_section.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "policies/sim/random_graphs.h"

namespace deltad::sim {

namespace {

constexpr double kTie = 1.005;  // within 0.5% counts as equal
constexpr double kNoFit = std::numeric_limits<double>::infinity();

// One (graph, budget) cell: each policy's slowdown, kNoFit where it did
// not fit.
struct Cell {
  int seed = 0;
  double ratio = 0;
  std::map<std::string, double> slowdown;
};

// A ratio of slowdowns as the tables print it.
std::string Ratio(double r) {
  return r == kNoFit ? "no fit" : absl::StrFormat("%.3f", r);
}

// How one policy fared against the best of the others, over some cells.
struct Standing {
  int cells = 0;  // where some other policy fits
  int at_or_below = 0;
  std::vector<double> gaps;       // its slowdown over the best other's
  std::map<std::string, int> by;  // who was ahead, and how often
  // The cell where it was furthest behind (gap 0: nowhere).
  struct Worst {
    double gap = 0;
    int seed = 0;
    double ratio = 0;
    double own = 0;
    std::string best_name;
    double best = 0;
  } worst;

  void Add(const Cell& cell, const std::string& policy) {
    double best = kNoFit;
    std::string best_name;
    for (const auto& [name, s] : cell.slowdown) {
      if (name != policy && s < best) {
        best = s;
        best_name = name;
      }
    }
    if (best == kNoFit) return;  // nothing else fits: no comparison
    ++cells;
    const double own = cell.slowdown.at(policy);
    const double gap = own / best;
    gaps.push_back(gap);
    if (own <= best * kTie) {
      ++at_or_below;
      return;
    }
    ++by[best_name];
    if (gap > worst.gap) {
      worst = {gap, cell.seed, cell.ratio, own, best_name, best};
    }
  }

  std::string Median() const {
    if (gaps.empty()) return "-";
    std::vector<double> g = gaps;
    std::sort(g.begin(), g.end());
    return Ratio(g[g.size() / 2]);
  }

  // The worst gap and its graph, for a budget's row.
  std::string WorstGap() const {
    return worst.gap > 0
               ? absl::StrCat(Ratio(worst.gap), " (random-", worst.seed, ")")
               : "-";
  }

  // Where and against whom, for the targets.
  std::string WorstWhere(const std::string& policy) const {
    return absl::StrFormat("random-%d at %.1f: %s %s vs %s %.3f", worst.seed,
                           worst.ratio, policy, Ratio(worst.own),
                           worst.best_name, worst.best);
  }

  std::string Ahead() const {
    std::vector<std::pair<int, std::string>> order;
    for (const auto& [name, n] : by) order.push_back({-n, name});
    std::sort(order.begin(), order.end());
    std::vector<std::string> parts;
    for (const auto& [n, name] : order)
      parts.push_back(absl::StrCat(name, " ", -n));
    return parts.empty() ? "-" : absl::StrJoin(parts, ", ");
  }
};

std::string StandingTable(const std::vector<Cell>& cells,
                          const std::vector<double>& ratios,
                          const std::string& policy, Standing* all) {
  std::ostringstream md;
  md << "**`" << policy << "`**\n\n"
     << "| budget | cells | at or below every other | median ratio to the "
        "best other | worst ratio | ahead of it |\n"
     << "|---:|---:|---:|---:|---:|---|\n";
  for (double ratio : ratios) {
    Standing s;
    for (const Cell& c : cells) {
      if (c.ratio != ratio) continue;
      s.Add(c, policy);
      all->Add(c, policy);
    }
    md << absl::StrFormat("| %.1f | %d | %d | %s | %s | %s |\n", ratio, s.cells,
                          s.at_or_below, s.Median(), s.WorstGap(), s.Ahead());
  }
  md << "\n";
  return md.str();
}

}  // namespace

absl::StatusOr<std::string> RandomGraphSection(
    int graphs, const std::vector<std::string>& policies,
    const std::vector<double>& ratios, int iterations,
    const DeviceProfile& device, AllocatorKind allocator,
    const RunPolicyFn& run) {
  std::vector<Cell> cells;
  for (int seed = 1; seed <= graphs; ++seed) {
    auto program = Compile(RandomLayerGraph(seed));
    if (!program.ok()) return program.status();
    // At 1.0 nothing has to be released in any iteration: the second can
    // need more than the first (gradients and optimizer state it keeps).
    auto peak = UnlimitedPeak(*program, device, allocator, iterations);
    if (!peak.ok()) return peak.status();
    for (double ratio : ratios) {
      Cell cell{seed, ratio, {}};
      const auto budget =
          static_cast<int64_t>(ratio * static_cast<double>(*peak));
      for (const std::string& name : policies) {
        auto r = run(*program, device, name, budget, iterations);
        if (!r.ok()) {
          return absl::Status(r.status().code(),
                              absl::StrCat(program->name, ", ", name, ": ",
                                           r.status().message()));
        }
        cell.slowdown[name] = r->fits ? r->total_slowdown() : kNoFit;
      }
      cells.push_back(std::move(cell));
    }
  }
  std::ostringstream md;
  md << "### Random layer graphs: each policy against every other\n\n"
     << graphs << " random layered networks (`RandomLayerGraph`, seeds 1.."
     << graphs
     << ", the graphs of the section below: no policy was tuned on them), "
        "every policy run for "
     << iterations
     << " training iterations back to back, the first included, at each "
        "budget ratio of the peak of as many iterations under `"
     << AllocatorKindName(allocator)
     << "` (each iteration starts from the parameters and optimizer state "
        "the one before left, where it left them), on the "
     << device.name
     << " profile, compared by the total time against as many ideal "
        "iterations, as in the steady-state section: a policy that plans "
        "from what it saw pays for the iterations it learnt in. Per budget: "
        "the cells where another policy fits, those where the policy is at "
        "or below every other (ties within 0.5%), its total over the best "
        "other's (median and worst; `no fit` where it did not fit and "
        "another did), "
        "and the policies that were ahead of it, with how often.\n\n";
  std::ostringstream targets;
  for (const std::string& policy :
       {std::string("delta"), std::string("delta-steady")}) {
    if (std::find(policies.begin(), policies.end(), policy) == policies.end()) {
      continue;
    }
    Standing all;
    md << StandingTable(cells, ratios, policy, &all);
    targets << "| `" << policy
            << "` at or below every other policy on every random graph and "
               "budget (ties within 0.5%) | "
            << all.at_or_below << " of " << all.cells << " cells"
            << (all.worst.gap > 0 ? "; worst: " + all.WorstWhere(policy) : "")
            << " | **" << (all.at_or_below == all.cells ? "met" : "MISSED")
            << "** |\n";
  }
  if (!targets.str().empty()) {
    md << "| target | measured | result |\n|---|---|---|\n"
       << targets.str() << "\n";
  }
  return md.str();
}

}  // namespace deltad::sim
