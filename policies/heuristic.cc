#include "policies/heuristic.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/cost_model.h"

namespace deltad::policy {

namespace {

struct Named {
  Heuristic h;
  absl::string_view name;
};
constexpr Named kNames[] = {
    {Heuristic::kDelta, "delta"},          {Heuristic::kLru, "lru"},
    {Heuristic::kGreedy, "greedy"},        {Heuristic::kDtr, "dtr"},
    {Heuristic::kDtrEq, "dtr_eq"},         {Heuristic::kMegEngine, "megengine"},
    {Heuristic::kDeltaCost, "delta_cost"},
};

}  // namespace

absl::StatusOr<Heuristic> ParseHeuristic(absl::string_view name) {
  for (const Named& n : kNames) {
    if (n.name == name) return n.h;
  }
  std::vector<absl::string_view> all;
  for (const Named& n : kNames) all.push_back(n.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown heuristic '", name,
                                                 "'; expected one of ",
                                                 absl::StrJoin(all, ", ")));
}

absl::string_view HeuristicName(Heuristic h) {
  for (const Named& n : kNames) {
    if (n.h == h) return n.name;
  }
  return "unknown";
}

using heuristic_internal::DeltaCost;
using heuristic_internal::Staleness;
using heuristic_internal::SwapPrice;

bool HasLowerBound(Heuristic h) { return h != Heuristic::kMegEngine; }

double ScoreLowerBound(Heuristic h, const MegEngineParams& me,
                       const TensorTable& table, uint32_t slot, int64_t now_ns,
                       const CostModel* costs) {
  const Tensor& t = table.AtSlot(slot);
  if (!HasLowerBound(h)) return Score(h, me, table, slot, now_ns, costs);
  return EntryBound(h, CandidateEntry::Of(t, slot), t.gpu, now_ns, costs);
}

double Score(Heuristic h, const MegEngineParams& me, const TensorTable& table,
             uint32_t slot, int64_t now_ns, const CostModel* costs) {
  const Tensor& t = table.AtSlot(slot);
  const double m = static_cast<double>(t.bytes);
  const double s = Staleness(t.last_access_ns, now_ns);
  switch (h) {
    case Heuristic::kDelta:
    case Heuristic::kLru:
    case Heuristic::kGreedy:  // their bound is the score
      return EntryBound(h, CandidateEntry::Of(t, slot), t.gpu, now_ns, costs);
    case Heuristic::kDtr:
      return static_cast<double>(NeighbourhoodNsExact(table, slot)) / (m * s);
    case Heuristic::kDtrEq:
      return static_cast<double>(NeighbourhoodNsEq(table, slot)) / (m * s);
    case Heuristic::kDeltaCost: {
      // The neighbours' walk changes nothing when the tensor cannot be
      // recomputed, or when a swap costs less than its own recompute.
      const double swap = SwapPrice(t.flags, t.gpu, t.bytes, costs);
      int64_t recompute_ns = t.compute_cost_ns;
      if (!t.flags.uncomputable && !t.flags.evict_pinned &&
          swap > static_cast<double>(recompute_ns)) {
        recompute_ns = NeighbourhoodNsEq(table, slot, costs);
      }
      return DeltaCost(t.flags, t.bytes, t.last_access_ns, recompute_ns, swap,
                       now_ns);
    }
    case Heuristic::kMegEngine: {
      const double cost = static_cast<double>(NeighbourhoodNsEq(table, slot));
      const double mem = m + static_cast<double>(t.adjacent_free_bytes);
      return std::pow(cost + 1e-3, me.cost_exp) *
             std::pow(me.recompute_penalty, t.recompute_count) /
             (std::pow(mem, me.mem_exp) * std::pow(s, me.time_exp));
    }
  }
  return 0;
}

}  // namespace deltad::policy
