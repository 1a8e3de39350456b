#include "policies/filter.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace deltad::policy {

namespace {
// Sampled candidates live at random slots; loading this many ahead keeps
// several misses in flight. (The exact scan showed no gain from it.)
constexpr size_t kPrefetchAhead = 8;
}  // namespace

Filter::Filter(FilterOptions options, const CostModel* costs)
    : options_(options), costs_(costs), rng_state_(options.seed) {}

uint64_t Filter::NextRandom() {
  // splitmix64: tiny, fast, and the same sequence on every platform.
  uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

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
  auto usable = [&](uint32_t slot) {
    const Tensor& t = table.AtSlot(slot);
    return t.lock_count == 0 && t.bytes >= min_bytes && eligible(t);
  };

  uint32_t best = UINT32_MAX;
  double best_score = std::numeric_limits<double>::infinity();
  auto consider = [&](uint32_t slot) {
    if (!usable(slot)) return;
    const double s = Score(table, slot, now_ns);
    if (best == UINT32_MAX || s < best_score) {
      best = slot;
      best_score = s;
    }
  };

  if (options_.sampled && n > 0) {
    const size_t k = static_cast<size_t>(std::ceil(std::sqrt(double(n))));
    // Draw every sample first, then score with the next ones already being
    // fetched: the misses overlap instead of queueing one after another.
    sample_.resize(k);
    for (size_t i = 0; i < k; ++i) sample_[i] = candidates[NextRandom() % n];
    for (size_t i = 0; i < std::min(k, kPrefetchAhead); ++i) {
      table.Prefetch(sample_[i]);
    }
    for (size_t i = 0; i < k; ++i) {
      if (i + kPrefetchAhead < k) table.Prefetch(sample_[i + kPrefetchAhead]);
      consider(sample_[i]);
    }
  }
  if (best == UINT32_MAX) {
    for (size_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n)
        table.Prefetch(candidates[i + kPrefetchAhead]);
      consider(candidates[i]);
    }
  }
  // Skipping small tensors must not make a release impossible: when only
  // small ones qualify, take the best of them.
  if (best == UINT32_MAX && min_bytes > 0) {
    min_bytes = 0;
    for (uint32_t slot : candidates) consider(slot);
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
