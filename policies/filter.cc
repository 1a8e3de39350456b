#include "policies/filter.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/numeric/int128.h"
#include "absl/strings/str_cat.h"

namespace deltad::policy {

namespace {
// Sampled candidates live at random slots; loading this many ahead keeps
// several misses in flight. (The exact scan showed no gain from it.)
constexpr size_t kPrefetchAhead = 24;
// In a Batch, a sample serves a pick per this many of its tensors (at
// 800k tensors, 14 picks from 900); below, each pick draws anew. Set by
// the simulator's traces: reusing samples of 15-40 tensors made some
// cells up to 1.7x slower (dtr-sampled, docs/BENCHMARKS.md).
constexpr size_t kTensorsPerPick = 64;
}  // namespace

Filter::Filter(FilterOptions options, const CostModel* costs)
    : options_(options), costs_(costs), rng_state_(options.seed) {}

absl::StatusOr<uint32_t> Filter::Select(const TensorTable& table,
                                        const Scope& scope, int64_t now_ns,
                                        Eligible eligible) {
  const absl::Span<const uint32_t> candidates = table.Candidates(scope);
  const size_t n = candidates.size();
  int64_t min_bytes = 0;
  if (options_.skip_small && n > 0) {
    // 1% of the mean, computed from the running byte total: O(1).
    min_bytes = table.CandidateBytes(scope) / static_cast<int64_t>(n) / 100;
  }
  // Set while a batch scores its sample again: a sampled tensor may have
  // left the candidates since (released by an earlier pick).
  bool recheck = false;
  auto usable = [&](uint32_t slot) {
    const Tensor& t = table.AtSlot(slot);
    if (recheck &&
        (t.bytes <= 0 || t.state != TensorState::kResident ||
         (scope.session ? t.session != *scope.session : t.gpu != scope.gpu))) {
      return false;
    }
    return t.lock_count == 0 && t.bytes >= min_bytes && eligible(t);
  };

  // The first of the lowest scores in scan order wins; `pos` is the order.
  // A candidate whose lower bound cannot beat the best so far is never
  // scored: the choice is the same, without most neighbourhood walks.
  const bool bounded =
      options_.skip_by_bound && HasLowerBound(options_.heuristic);
  uint32_t best = UINT32_MAX;
  size_t best_pos = 0;
  double best_score = std::numeric_limits<double>::infinity();
  auto offer = [&](uint32_t slot, size_t pos, double bound) {
    if (best != UINT32_MAX &&
        (bound > best_score || (bound == best_score && pos > best_pos))) {
      return;
    }
    const double s = Score(table, slot, now_ns);
    if (best == UINT32_MAX || s < best_score ||
        (s == best_score && pos < best_pos)) {
      best = slot;
      best_pos = pos;
      best_score = s;
    }
  };
  auto consider = [&](uint32_t slot, size_t pos) {
    if (!usable(slot)) return;
    offer(slot, pos,
          bounded ? LowerBound(table, slot, now_ns)
                  : -std::numeric_limits<double>::infinity());
  };

  if (options_.sampled && n > 0) {
    // A sample serves one pick per kTensorsPerPick of its tensors: the
    // j-th best of k is about as good as the best of k/j, so a small
    // sample (a small table) draws anew for every pick, as without a batch.
    bool again = batch_depth_ > 0 && batch_sample_ &&
                 batch_scope_.gpu == scope.gpu &&
                 batch_scope_.session == scope.session &&
                 batch_picks_ < sample_.size() / kTensorsPerPick;
    size_t k = again ? sample_.size()
                     : static_cast<size_t>(std::ceil(std::sqrt(double(n))));
    sample_.resize(k);
    uint32_t* sample = sample_.data();
    // With a lower bound, the first pass only bounds each sample (NaN:
    // not usable); scoring the lowest bound first then leaves few others
    // that can beat it, against a walk per new minimum in sample order.
    if (bounded) bounds_.resize(k);
    double* bounds = bounds_.data();
    size_t lowest = SIZE_MAX;
    auto look = [&](size_t i) {
      if (!bounded) {
        consider(sample[i], i);
        return;
      }
      bounds[i] = std::numeric_limits<double>::quiet_NaN();
      if (!usable(sample[i])) return;
      bounds[i] = LowerBound(table, sample[i], now_ns);
      if (lowest == SIZE_MAX || bounds[i] < bounds[lowest]) lowest = i;
    };
    // Every load is a miss at a million tensors, so each is started
    // kPrefetchAhead draws before it is needed. A multiply maps a draw to
    // [0, n) (Lemire): a division took a third of the decision.
    auto below = [&](uint64_t range) {
      return static_cast<uint32_t>(
          absl::Uint128High64(absl::uint128(NextRandom()) * range));
    };
    if (again) {
      recheck = true;
      for (size_t i = 0; i < k; ++i) look(i);
      recheck = false;
      if (lowest == SIZE_MAX && best == UINT32_MAX) {
        // Nothing of it qualifies any more: a new sample.
        k = static_cast<size_t>(std::ceil(std::sqrt(double(n))));
        sample_.resize(k);
        sample = sample_.data();
        if (bounded) bounds_.resize(k);
        bounds = bounds_.data();
        again = false;
      }
    }
    if (!again) {
      // Three stages: a position in the list (its entry being loaded), the
      // slot there (its tensor being loaded), the tensor. (Drawing slots of
      // the table and keeping the candidates, one miss a draw instead of
      // two, measured 1.3-1.5x slower at a million tensors, whether each
      // draw was kept as it arrived or all were checked after loading.)
      for (size_t i = 0; i < k; ++i) sample[i] = below(n);
      auto resolve = [&](size_t i) {
        sample[i] = candidates[sample[i]];
        table.Prefetch(sample[i]);
      };
      for (size_t i = 0; i < std::min(k, 2 * kPrefetchAhead); ++i) {
        __builtin_prefetch(&candidates[sample[i]]);
      }
      for (size_t i = 0; i < std::min(k, kPrefetchAhead); ++i) resolve(i);
      for (size_t i = 0; i < k; ++i) {
        if (i + 2 * kPrefetchAhead < k) {
          __builtin_prefetch(&candidates[sample[i + 2 * kPrefetchAhead]]);
        }
        if (i + kPrefetchAhead < k) resolve(i + kPrefetchAhead);
        look(i);
      }
      if (batch_depth_ > 0) {
        batch_sample_ = true;
        batch_scope_ = scope;
        batch_picks_ = 0;
      }
    }
    if (bounded && lowest < k) {
      offer(sample[lowest], lowest, bounds[lowest]);
      for (size_t i = 0; i < k; ++i) {
        if (i != lowest && !std::isnan(bounds[i])) {
          offer(sample[i], i, bounds[i]);
        }
      }
    }
    if (batch_depth_ > 0 && best != UINT32_MAX) ++batch_picks_;
  }
  if (best == UINT32_MAX) {
    for (size_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n)
        table.Prefetch(candidates[i + kPrefetchAhead]);
      consider(candidates[i], i);
    }
  }
  // Skipping small tensors must not make a release impossible: when only
  // small ones qualify, take the best of them.
  if (best == UINT32_MAX && min_bytes > 0) {
    min_bytes = 0;
    for (size_t i = 0; i < n; ++i) consider(candidates[i], i);
  }
  if (best == UINT32_MAX) {
    return absl::NotFoundError(absl::StrCat(
        "no releasable tensor on GPU ", scope.gpu,
        scope.session ? absl::StrCat(" in session ", *scope.session)
                      : std::string()));
  }
  return best;
}

}  // namespace deltad::policy
