#ifndef DELTAD_POLICIES_HEURISTIC_H_
#define DELTAD_POLICIES_HEURISTIC_H_

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/cost_model.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

// Filter scores: the lowest score is released first.
enum class Heuristic {
  kDelta,      // 1 / (m * s)                 DELTA eq. (1), the default
  kLru,        // 1 / s                       DELTA eq. (2)
  kGreedy,     // 1 / m                       DELTA eq. (3)
  kDtr,        // c_r / (m * s), exact evicted neighbourhood (DTR's h_DTR)
  kDtrEq,      // c_r / (m * s), union-find neighbourhood (DTR's h_DTR-eq)
  kMegEngine,  // DTR-eq with MegEngine's fragmentation and recompute terms
  // min(c_r, c_s) / (m * s): DELTA's h_r and h_o (eqs. 5, 6) taken together,
  // the cost of whichever release the Director would choose. c_r here is
  // DTR's neighbourhood (evicted ancestors and children, union-find): evicting
  // t also makes its evicted children's rebuild need t. An action the flags
  // forbid counts as infinitely dear.
  kDeltaCost,
};

absl::StatusOr<Heuristic> ParseHeuristic(absl::string_view name);
absl::string_view HeuristicName(Heuristic h);

// MegEngine's evaluation function (MegEngine v1.4 DTR):
//   (c_r + eps)^cost_exp * penalty^recomputes
//   / ((m + adjacent_free)^mem_exp * s^time_exp)
// The adjacent free bytes favour releasing tensors that join free space
// (less fragmentation); the penalty spares tensors recomputed many times.
struct MegEngineParams {
  double cost_exp = 1.0;
  double mem_exp = 1.0;
  double time_exp = 1.0;
  double recompute_penalty = 1.5;  // > 1 makes each recompute count
};

// Score of a resident tensor at `now_ns`. Staleness is at least 1 ns so a
// tensor touched this instant gets a finite score. `costs` is needed by
// kDeltaCost only (swap cost); without it that heuristic uses c_r alone.
double Score(Heuristic h, const MegEngineParams& me, const TensorTable& table,
             uint32_t slot, int64_t now_ns, const CostModel* costs = nullptr);

// Whether a score has a bound that reads the candidate entry alone
// (EntryBound): every heuristic but MegEngine's, whose terms the entry
// lacks. For dtr, dtr_eq and delta_cost the bound lets a search skip the
// neighbourhood walk of candidates that cannot beat the best found; for
// all, it lets a search at scale skip loading the tensor (a cache miss).
bool HasLowerBound(Heuristic h);

// At most Score (exactly, in floating point), from the entry alone: the
// neighbourhood cost taken as the tensor's own compute cost, which every
// neighbourhood includes and costs never being negative; Score itself for
// delta, lru and greedy. -infinity (no bound) for MegEngine. `gpu` is the
// tensor's (the swap price depends on its link).
// Inline: a sampled search bounds ~1000 entries a decision, and three
// divisions each are most of its work besides the misses.
inline double EntryBound(Heuristic h, const CandidateEntry& e, GpuId gpu,
                         int64_t now_ns, const CostModel* costs = nullptr);

// EntryBound of a table's tensor; Score itself for MegEngine.
double ScoreLowerBound(Heuristic h, const MegEngineParams& me,
                       const TensorTable& table, uint32_t slot, int64_t now_ns,
                       const CostModel* costs = nullptr);

// --- Inline definitions.

namespace heuristic_internal {

inline constexpr double kNever = 1e30;

inline double Staleness(int64_t last_access_ns, int64_t now_ns) {
  return static_cast<double>(std::max<int64_t>(1, now_ns - last_access_ns));
}

// c_s for delta_cost: kNever where offloading is forbidden or unpriced.
inline double SwapPrice(const TensorFlags& flags, GpuId gpu, int64_t bytes,
                        const CostModel* costs) {
  return flags.offload_pinned || costs == nullptr
             ? kNever
             : static_cast<double>(costs->SwapNs(gpu, bytes, flags));
}

// c_r for delta_cost: kNever where recompute is impossible or forbidden.
inline double RecomputePrice(const TensorFlags& flags, int64_t recompute_ns) {
  return flags.uncomputable || flags.evict_pinned
             ? kNever
             : static_cast<double>(recompute_ns);
}

// delta_cost's min(c_r, c_s) / (m * s) for a given c_r and c_s.
inline double DeltaCost(const TensorFlags& flags, int64_t bytes,
                        int64_t last_access_ns, int64_t recompute_ns,
                        double swap, int64_t now_ns) {
  const double recompute = RecomputePrice(flags, recompute_ns);
  return std::min(recompute, swap) /
         (static_cast<double>(bytes) * Staleness(last_access_ns, now_ns));
}

}  // namespace heuristic_internal

inline double EntryBound(Heuristic h, const CandidateEntry& e, GpuId gpu,
                         int64_t now_ns, const CostModel* costs) {
  using heuristic_internal::DeltaCost;
  using heuristic_internal::Staleness;
  using heuristic_internal::SwapPrice;
  const double m = static_cast<double>(e.bytes);
  const double s = Staleness(e.last_access_ns, now_ns);
  switch (h) {
    case Heuristic::kDelta:
      return 1.0 / (m * s);
    case Heuristic::kLru:
      return 1.0 / s;
    case Heuristic::kGreedy:
      return 1.0 / m;
    case Heuristic::kDtr:
    case Heuristic::kDtrEq:
      return static_cast<double>(e.compute_cost_ns) / (m * s);
    case Heuristic::kDeltaCost:
      return DeltaCost(e.flags, e.bytes, e.last_access_ns, e.compute_cost_ns,
                       SwapPrice(e.flags, gpu, e.bytes, costs), now_ns);
    case Heuristic::kMegEngine:
      break;
  }
  return -std::numeric_limits<double>::infinity();
}

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_HEURISTIC_H_
