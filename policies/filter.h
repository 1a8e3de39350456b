#ifndef DELTAD_POLICIES_FILTER_H_
#define DELTAD_POLICIES_FILTER_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "policies/heuristic.h"
#include "policies/ranked_candidates.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

// The daemon's and the client's default for FilterOptions::exact_below: an
// exact delta_cost decision over 2048 tensors costs about what a sampled one
// over a million does (docs/BENCHMARKS.md, policy_micro).
inline constexpr int64_t kDefaultExactBelow = 2048;

struct FilterOptions {
  Heuristic heuristic = Heuristic::kDelta;
  // Score ceil(sqrt(N)) random candidates instead of all N (DTR's sampling).
  bool sampled = false;
  // With `sampled`: while there are fewer candidates than this, score
  // every one, small ones included (skip_small is for samples). Sampling
  // buys speed, which a small search does not need, and costs choices
  // (docs/BENCHMARKS.md: `delta` in the simulator with and without it).
  int64_t exact_below = 0;
  // Ignore tensors under 1% of the mean candidate size (DTR, MegEngine).
  bool skip_small = false;
  uint64_t seed = 1;  // sampling is deterministic for a seed and call order
  // Skip the neighbourhood walk of candidates whose lower bound cannot beat
  // the best found (ScoreLowerBound): the same pick, found faster. Off
  // only to check that it is the same.
  bool skip_by_bound = true;
  // Take the exact picks of a Batch after its first from a ranking
  // (Batch): the same picks, found faster. Off only to check that it is
  // the same, and to measure what it saves.
  bool rank_in_batch = true;
  MegEngineParams megengine;
};

// Algorithm 2 of DELTA: picks the resident tensor to release next.
// Owns only its options and sampling state; not thread safe.
class Filter {
 public:
  using Eligible = absl::FunctionRef<bool(const Tensor&)>;

  // `costs` (may be null; must outlive the Filter) prices swaps for the
  // delta_cost heuristic.
  explicit Filter(FilterOptions options = {}, const CostModel* costs = nullptr);

  // The lowest-scoring candidate of `scope` that is unlocked and passes
  // `eligible`. NotFound when there is none. Sampling falls back to an exact
  // scan when no sampled tensor qualifies, so NotFound always means none.
  absl::StatusOr<uint32_t> Select(const TensorTable& table, const Scope& scope,
                                  int64_t now_ns, Eligible eligible);

  // How far ahead a tensor is next used, in a recorded iteration's order
  // (AccessPlan::AccessesUntilNext: accesses from now; -1: not in it).
  using NextUse = absl::FunctionRef<int64_t(const Tensor&)>;
  // Select with the future known: each score's staleness (time since the
  // last use, DELTA's guess of how long until the next) is the distance
  // to the next use, so that of two tensors alike the one needed last goes
  // first (Belady's rule within the heuristic's costs), and one the
  // recorded iteration never used before all. An exact scan. Heuristics
  // without staleness in their score (greedy, MegEngine) select as Select
  // does.
  absl::StatusOr<uint32_t> SelectByNextUse(const TensorTable& table,
                                           const Scope& scope, int64_t now_ns,
                                           Eligible eligible, NextUse next_use);

  double Score(const TensorTable& table, uint32_t slot, int64_t now_ns) const {
    return policy::Score(options_.heuristic, options_.megengine, table, slot,
                         now_ns, costs_);
  }
  const FilterOptions& options() const { return options_; }

  // The picks of one release (RAII; may nest; every Select in it on the
  // same table). While one is open, a sampled Select scores the sample it
  // drew last for the same scope again (its entries are in cache: no
  // miss), less the tensors no longer candidates (their entries moved
  // from where they were drawn) or usable, each pick seeing the table as
  // the earlier ones left it; it draws anew when none of them qualifies, or
  // when the sample has served one pick per 64 of its tensors (a sample of
  // under 128 serves one: each pick draws anew, as without a batch). A release
  // of several tensors at scale then costs one sample's misses instead of one
  // each: the best few of a sample of ceil(sqrt(N)) rather than the best
  // of several samples.
  //
  // An exact search in a Batch ranks its scope's candidates at the second
  // pick (RankedCandidates) and takes the next picks from that ranking, the
  // same tensors a scan would pick, while the table changes only by those
  // releases and `now_ns` stays the same; any other change is seen and
  // ranks anew.
  class Batch {
   public:
    explicit Batch(Filter& filter) : filter_(filter) {
      if (filter_.batch_depth_++ == 0) filter_.batch_sample_ = false;
    }
    ~Batch() {
      if (--filter_.batch_depth_ == 0) {
        filter_.batch_sample_ = false;
        filter_.ranked_.Invalidate();
      }
    }
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

   private:
    Filter& filter_;
  };

 private:
  // What a ranking of `scope`'s candidates made now stays valid for.
  RankedCandidates::Key RankKey(const TensorTable& table, const Scope& scope,
                                int64_t now_ns, bool by_next_use) const;
  uint64_t NextRandom() {
    // splitmix64: tiny, fast, and the same sequence on every platform.
    uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  FilterOptions options_;
  const CostModel* costs_;
  uint64_t rng_state_;
  // Reused between calls: the sampled slots, the list positions they were
  // drawn from, and their lower bounds.
  std::vector<uint32_t> sample_;
  std::vector<uint32_t> positions_;
  std::vector<double> bounds_;
  // Open Batches, and whether sample_ is the last one drawn in them, for
  // batch_scope_.
  int batch_depth_ = 0;
  bool batch_sample_ = false;
  size_t batch_picks_ = 0;  // made from sample_ so far
  Scope batch_scope_;
  // The exact picks of the open Batches.
  RankedCandidates ranked_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_FILTER_H_
