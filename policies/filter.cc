#include "policies/filter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

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

// The bounds of dtr, dtr_eq and delta_cost are numerator / (m * s): for
// delta_cost min(c_r, c_s), three divisions with the two in the swap's
// price. The exact scan compares a lower bound of the numerator with the
// best score times m * s first, which costs no division: an entry that
// fails that check cannot win, and is passed over. The swap's lower bound
// gives up a millionth and two nanoseconds for the price's truncation to
// whole nanoseconds and the reciprocals' rounding, and the check a
// billionth for the product's: an entry near the best is checked by its
// bound as before, so the pick is the same.
class BoundPrecheck {
 public:
  BoundPrecheck(Heuristic h, const CostModel* costs, GpuId gpu)
      : heuristic_(h), priced_(costs != nullptr) {
    if (!priced_) return;
    const LinkBandwidth bw = costs->Bandwidth(gpu);
    d2h_ns_per_byte_ = 1e9 / bw.d2h_bytes_per_s;
    h2d_ns_per_byte_ = 1e9 / bw.h2d_bytes_per_s;
    latency_ = static_cast<double>(bw.copy_latency_ns);
    backlog_ = static_cast<double>(costs->Backlog(gpu));
  }

  static bool Applies(Heuristic h) {
    return h == Heuristic::kDtr || h == Heuristic::kDtrEq ||
           h == Heuristic::kDeltaCost;
  }

  // Whether `e`'s bound is certainly above `best` at `now_ns`.
  bool Beaten(const CandidateEntry& e, int64_t now_ns, double best) const {
    const double m = static_cast<double>(e.bytes);
    double numerator = static_cast<double>(e.compute_cost_ns);
    if (heuristic_ == Heuristic::kDeltaCost) {
      numerator =
          heuristic_internal::RecomputePrice(e.flags, e.compute_cost_ns);
      if (priced_ && !e.flags.offload_pinned) {
        const double reload = latency_ + m * h2d_ns_per_byte_;
        const double swap =
            e.flags.host_copy
                ? reload
                : latency_ + (backlog_ + m) * d2h_ns_per_byte_ + reload;
        numerator = std::min(numerator, swap * (1 - 1e-6) - 2);
      }
    }
    const double s = heuristic_internal::Staleness(e.last_access_ns, now_ns);
    return numerator > best * (m * s) * (1 + 1e-9);
  }

 private:
  Heuristic heuristic_;
  bool priced_;
  double d2h_ns_per_byte_ = 0;
  double h2d_ns_per_byte_ = 0;
  double latency_ = 0;
  double backlog_ = 0;
};

absl::Status NoneReleasable(const Scope& scope) {
  return absl::NotFoundError(
      absl::StrCat("no releasable tensor on GPU ", scope.gpu,
                   scope.session ? absl::StrCat(" in session ", *scope.session)
                                 : std::string()));
}
}  // namespace

Filter::Filter(FilterOptions options, const CostModel* costs)
    : options_(options), costs_(costs), rng_state_(options.seed) {}

absl::StatusOr<uint32_t> Filter::Select(const TensorTable& table,
                                        const Scope& scope, int64_t now_ns,
                                        Eligible eligible) {
  const absl::Span<const CandidateEntry> entries =
      table.CandidateEntries(scope);
  const size_t n = entries.size();
  const GpuId gpu = table.ScopeGpu(scope);
  // Below exact_below a sampled filter searches as a plain one: every
  // candidate, the small ones too.
  const bool exact_regime =
      options_.sampled && static_cast<int64_t>(n) < options_.exact_below;
  const bool sampling = options_.sampled && !exact_regime;
  int64_t min_bytes = 0;
  if (options_.skip_small && !exact_regime && n > 0) {
    // 1% of the mean, computed from the running byte total: O(1).
    min_bytes = table.CandidateBytes(scope) / static_cast<int64_t>(n) / 100;
  }
  auto usable = [&](uint32_t slot) {
    const Tensor& t = table.AtSlot(slot);
    return t.lock_count == 0 && t.bytes >= min_bytes && eligible(t);
  };

  // Every score but MegEngine's has a bound read from the list entry alone
  // (EntryBound): a candidate whose bound cannot beat the best so far is
  // neither loaded nor scored, and the choice is the same.
  const bool bounded =
      options_.skip_by_bound && HasLowerBound(options_.heuristic);
  auto bound_of = [&](const CandidateEntry& e) {
    return bounded ? EntryBound(options_.heuristic, e, gpu, now_ns, costs_)
                   : -std::numeric_limits<double>::infinity();
  };
  // The first of the lowest scores in scan order wins; `pos` is the order.
  // Which it is does not depend on the order of the offers.
  uint32_t best = UINT32_MAX;
  size_t best_pos = 0;
  double best_score = std::numeric_limits<double>::infinity();
  auto offer = [&](uint32_t slot, size_t pos, double bound) {
    if (best != UINT32_MAX &&
        (bound > best_score || (bound == best_score && pos > best_pos))) {
      return;
    }
    if (!usable(slot)) return;
    const double s = Score(table, slot, now_ns);
    if (best == UINT32_MAX || s < best_score ||
        (s == best_score && pos < best_pos)) {
      best = slot;
      best_pos = pos;
      best_score = s;
    }
  };

  if (sampling && n > 0) {
    // A sample serves one pick per kTensorsPerPick of its tensors: the
    // j-th best of k is about as good as the best of k/j, so a small
    // sample (a small table) draws anew for every pick, as without a batch.
    bool again = batch_depth_ > 0 && batch_sample_ &&
                 batch_scope_.gpu == scope.gpu &&
                 batch_scope_.session == scope.session &&
                 batch_picks_ < sample_.size() / kTensorsPerPick;
    const size_t fresh_k =
        static_cast<size_t>(std::ceil(std::sqrt(static_cast<double>(n))));
    size_t k = again ? sample_.size() : fresh_k;
    sample_.resize(k);
    bounds_.resize(k);
    uint32_t* sample = sample_.data();
    double* bounds = bounds_.data();
    constexpr double kOut = std::numeric_limits<double>::quiet_NaN();
    // The sample with the lowest bound, noted as the bounds are made.
    size_t lowest = SIZE_MAX;
    auto note = [&](size_t i) {
      if (lowest == SIZE_MAX || bounds[i] < bounds[lowest]) lowest = i;
    };
    // When the lowest bound's tensor is one the caller will not take,
    // such tensors are common in this search (other sessions', locked):
    // loading each lazily in the pass below would be a serial miss, so
    // every sample's usability is read first, its tensor loaded ahead.
    auto drop_unusable = [&] {
      if (lowest == SIZE_MAX || usable(sample[lowest])) return;
      lowest = SIZE_MAX;
      for (size_t i = 0; i < std::min(k, kPrefetchAhead); ++i) {
        table.Prefetch(sample[i]);
      }
      for (size_t i = 0; i < k; ++i) {
        if (i + kPrefetchAhead < k) table.Prefetch(sample[i + kPrefetchAhead]);
        if (std::isnan(bounds[i])) continue;
        if (usable(sample[i])) {
          note(i);
        } else {
          bounds[i] = kOut;
        }
      }
    };
    if (again) {
      // The sample's entries are in cache. A sampled tensor is still a
      // candidate where its entry is still at the position it was drawn
      // from (an entry is unique in its list; an earlier pick's removal
      // moved the last entry into its place, or shortened the list).
      for (size_t i = 0; i < k; ++i) {
        const uint32_t p = positions_[i];
        if (p < n && entries[p].slot == sample[i] &&
            entries[p].bytes >= min_bytes) {
          bounds[i] = bound_of(entries[p]);
          note(i);
        } else {
          bounds[i] = kOut;
        }
      }
      drop_unusable();
      if (lowest == SIZE_MAX) {  // nothing of it qualifies: a new sample
        again = false;
        k = fresh_k;
        sample_.resize(k);
        bounds_.resize(k);
        sample = sample_.data();
        bounds = bounds_.data();
      }
    }
    if (!again) {
      // Every load is a miss at a million tensors, so each is started
      // kPrefetchAhead draws before it is needed: the entry, and without
      // a bound the tensor too (the slot in the entry, then the tensor).
      // A multiply maps a draw to [0, n) (Lemire): a division took a third
      // of the decision. (Drawing slots of the table and keeping the
      // candidates measured 1.3-1.5x slower: most slots were not in the
      // scope.)
      positions_.resize(k);
      for (size_t i = 0; i < k; ++i) {
        sample[i] = static_cast<uint32_t>(
            absl::Uint128High64(absl::uint128(NextRandom()) * n));
        positions_[i] = sample[i];
      }
      const size_t ahead = bounded ? kPrefetchAhead : 2 * kPrefetchAhead;
      for (size_t i = 0; i < std::min(k, ahead); ++i) {
        __builtin_prefetch(&entries[sample[i]]);
      }
      auto resolve = [&](size_t i) {
        const CandidateEntry& e = entries[sample[i]];
        sample[i] = e.slot;
        if (e.bytes < min_bytes) {
          bounds[i] = kOut;
        } else {
          bounds[i] = bound_of(e);
          note(i);
        }
        if (!bounded) table.Prefetch(e.slot);
      };
      if (!bounded) {
        for (size_t i = 0; i < std::min(k, kPrefetchAhead); ++i) resolve(i);
      }
      const size_t lag = bounded ? 0 : kPrefetchAhead;
      for (size_t i = 0; i < k; ++i) {
        if (i + ahead < k) __builtin_prefetch(&entries[sample[i + ahead]]);
        if (i + lag < k) resolve(i + lag);
        if (!bounded && !std::isnan(bounds[i])) offer(sample[i], i, bounds[i]);
      }
      if (bounded) drop_unusable();
      if (batch_depth_ > 0) {
        batch_sample_ = true;
        batch_scope_ = scope;
        batch_picks_ = 0;
      }
    }
    if (bounded || again) {
      // The lowest bound first: scored first, it leaves few others that
      // can beat it, against a walk per new minimum in sample order.
      if (lowest != SIZE_MAX) offer(sample[lowest], lowest, bounds[lowest]);
      for (size_t i = 0; i < k; ++i) {
        // !(<=): neither out (NaN) nor beaten already; offer decides ties.
        if (!(bounds[i] <= best_score) || sample[i] == best) continue;
        offer(sample[i], i, bounds[i]);
      }
    }
    if (batch_depth_ > 0 && best != UINT32_MAX) ++batch_picks_;
  }
  // The next exact pick of a release, from its ranking; the first scans.
  if (!sampling && bounded && min_bytes == 0 && batch_depth_ > 0 &&
      options_.rank_in_batch) {
    const RankedCandidates::Key key =
        RankKey(table, scope, now_ns, /*by_next_use=*/false);
    if (ranked_.Use(key, entries, bound_of)) {
      const uint32_t pick = ranked_.Pick(
          entries, bound_of, usable,
          [&](uint32_t slot) { return Score(table, slot, now_ns); });
      if (pick == UINT32_MAX) return NoneReleasable(scope);
      return pick;
    }
  }
  // Entries are read in order; a tensor is loaded only where its bound can
  // win (every one without a bound, ahead of need).
  const bool precheck = bounded && BoundPrecheck::Applies(options_.heuristic);
  // Its reciprocals only where it is used: sampled searches and the other
  // heuristics pay nothing for it.
  std::optional<BoundPrecheck> beaten;
  auto scan_all = [&] {
    if (precheck && !beaten) beaten.emplace(options_.heuristic, costs_, gpu);
    for (size_t i = 0; i < n; ++i) {
      if (!bounded && i + kPrefetchAhead < n) {
        table.Prefetch(entries[i + kPrefetchAhead].slot);
      }
      if (entries[i].bytes < min_bytes) continue;
      if (precheck && best != UINT32_MAX &&
          beaten->Beaten(entries[i], now_ns, best_score)) {
        continue;
      }
      offer(entries[i].slot, i, bound_of(entries[i]));
    }
  };
  if (best == UINT32_MAX) scan_all();
  // Skipping small tensors must not make a release impossible: when only
  // small ones qualify, take the best of them.
  if (best == UINT32_MAX && min_bytes > 0) {
    min_bytes = 0;
    scan_all();
  }
  if (best == UINT32_MAX) return NoneReleasable(scope);
  return best;
}

RankedCandidates::Key Filter::RankKey(const TensorTable& table,
                                      const Scope& scope, int64_t now_ns,
                                      bool by_next_use) const {
  return {&table,     scope.gpu,          scope.session,
          now_ns,     table.rank_epoch(), costs_ ? costs_->epoch() : 0,
          by_next_use};
}

absl::StatusOr<uint32_t> Filter::SelectByNextUse(const TensorTable& table,
                                                 const Scope& scope,
                                                 int64_t now_ns,
                                                 Eligible eligible,
                                                 NextUse next_use) {
  const Heuristic h = options_.heuristic;
  if (h == Heuristic::kGreedy || h == Heuristic::kMegEngine) {
    return Select(table, scope, now_ns, eligible);
  }
  const absl::Span<const CandidateEntry> entries =
      table.CandidateEntries(scope);
  const GpuId gpu = table.ScopeGpu(scope);
  // The next picks of a release from a ranking, as Select's exact ones: a
  // release moves no cursor of the recorded order (no access comes in
  // between), so each tensor's distance stays what it was.
  if (batch_depth_ > 0 && options_.rank_in_batch) {
    const RankedCandidates::Key key =
        RankKey(table, scope, now_ns, /*by_next_use=*/true);
    auto bound_of = [&](const CandidateEntry& e) {
      const int64_t d = next_use(table.AtSlot(e.slot));
      return d < 0 ? -1.0 : EntryBound(h, e, gpu, e.last_access_ns + d, costs_);
    };
    if (ranked_.Use(key, entries, bound_of)) {
      const uint32_t pick = ranked_.Pick(
          entries, bound_of,
          [&](uint32_t slot) {
            const Tensor& t = table.AtSlot(slot);
            return t.lock_count == 0 && eligible(t);
          },
          [&](uint32_t slot) {
            const Tensor& t = table.AtSlot(slot);
            const int64_t d = next_use(t);
            return d < 0 ? -1.0
                         : policy::Score(h, options_.megengine, table, slot,
                                         t.last_access_ns + d, costs_);
          });
      if (pick == UINT32_MAX) return NoneReleasable(scope);
      return pick;
    }
  }
  uint32_t best = UINT32_MAX;
  double best_score = 0;
  for (const CandidateEntry& e : entries) {
    const Tensor& t = table.AtSlot(e.slot);
    if (t.lock_count != 0 || !eligible(t)) continue;
    const int64_t d = next_use(t);
    // Not used at all in the recorded iteration: first of all, in list
    // order (every score is positive).
    double s = -1;
    if (d >= 0) {
      // A score's staleness is now - last access: the distance stands in.
      const int64_t at = e.last_access_ns + d;
      // Its bound first: the neighbourhood walk only where it can win.
      if (best != UINT32_MAX &&
          EntryBound(h, e, gpu, at, costs_) >= best_score) {
        continue;
      }
      s = policy::Score(h, options_.megengine, table, e.slot, at, costs_);
    }
    if (best == UINT32_MAX || s < best_score) {
      best = e.slot;
      best_score = s;
    }
  }
  if (best == UINT32_MAX) return NoneReleasable(scope);
  return best;
}

}  // namespace deltad::policy
