#ifndef DELTAD_POLICIES_RANKED_CANDIDATES_H_
#define DELTAD_POLICIES_RANKED_CANDIDATES_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

// The candidates of one scope, ranked once for the several picks of one
// release: a min-heap keyed by a lower bound of each score, re-scored only
// when it reaches the top (lazy greedy). A pick then costs a few pops
// instead of a scan of every candidate.
//
// Valid while scores can only rise and no candidate joins: what a release
// does to the table (a tensor leaving for kEvicted or kOffloading joins
// evicted components, so its neighbours' recompute costs grow) at one
// `now_ns`. The owner checks that with Key: the table's and the prices'
// epochs move with every other change (TensorTable::rank_epoch,
// CostModel::epoch).
class RankedCandidates {
 public:
  struct Key {
    const TensorTable* table = nullptr;
    GpuId gpu = 0;
    std::optional<SessionId> session;
    int64_t now_ns = 0;
    uint64_t table_epoch = 0;
    uint64_t prices_epoch = 0;
    // Scores by the distance to each tensor's next use
    // (Filter::SelectByNextUse), not by the time since its last.
    bool by_next_use = false;
    bool operator==(const Key&) const = default;
  };
  using Bound = absl::FunctionRef<double(const CandidateEntry&)>;
  using Usable = absl::FunctionRef<bool(uint32_t slot)>;
  using Score = absl::FunctionRef<double(uint32_t slot)>;

  // Whether this pick may come from the ranking: true from the second
  // pick with the same `key` on (the ranking built from `entries` at the
  // first of them); false for a first, which the caller makes by a scan,
  // so that a release of one tensor pays for no heap.
  bool Use(const Key& key, absl::Span<const CandidateEntry> entries,
           Bound bound);
  void Invalidate() {
    built_ = false;
    key_ = Key{};
  }

  // The usable candidate of `entries` (the key's list, as it is now) with
  // the lowest score, the first in list order among equal ones: what a scan
  // of every entry picks. UINT32_MAX when none is usable. `bound` is the
  // one Build was given. Usability may differ from one pick to the next
  // (host memory spent, a session back within its share): candidates
  // passed over for it are looked at again in the next pick.
  uint32_t Pick(absl::Span<const CandidateEntry> entries, Bound bound,
                Usable usable, Score score);

 private:
  // Ties in score are common (free views, tensors made by one step), so
  // the heap orders by position too: the first top whose key is still its
  // score is the pick, with no walk over its ties.
  struct Item {
    double key;    // at most the score
    uint32_t pos;  // in the list when ranked; stale when it moved since
    uint32_t slot;
  };
  struct Placed {
    uint32_t slot;
    uint32_t pos;
  };

  void Build(absl::Span<const CandidateEntry> entries, Bound bound);
  // How many of the list's last entries a pick remembers: a removal
  // between two picks moves one of them (see Pick).
  static constexpr size_t kTail = 16;

  // The candidate's position in `entries`, or UINT32_MAX when it is no
  // longer one (released since it was ranked).
  uint32_t PositionOf(absl::Span<const CandidateEntry> entries,
                      uint32_t slot) const;
  void NoteTail(absl::Span<const CandidateEntry> entries);
  void Push(Item item);
  Item Pop();

  Key key_;
  bool built_ = false;
  std::vector<Item> heap_;
  std::vector<Item> aside_;  // unusable when last popped
  // The list's size and last entries at the end of the last pick.
  size_t size_ = 0;
  std::vector<Placed> tail_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_RANKED_CANDIDATES_H_
