#include "policies/ranked_candidates.h"

#include <algorithm>

namespace deltad::policy {

namespace {
// A min-heap by (key, position) for std::push_heap and friends: the order
// of a scan's picks, the first of the lowest scores.
struct Above {
  template <typename T>
  bool operator()(const T& a, const T& b) const {
    return a.key > b.key || (a.key == b.key && a.pos > b.pos);
  }
};
}  // namespace

bool RankedCandidates::Use(const Key& key,
                           absl::Span<const CandidateEntry> entries,
                           Bound bound) {
  if (key_ != key) {
    key_ = key;
    built_ = false;
    return false;
  }
  if (!built_) Build(entries, bound);
  return true;
}

void RankedCandidates::Build(absl::Span<const CandidateEntry> entries,
                             Bound bound) {
  heap_.clear();
  aside_.clear();
  heap_.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    heap_.push_back(
        {bound(entries[i]), static_cast<uint32_t>(i), entries[i].slot});
  }
  std::make_heap(heap_.begin(), heap_.end(), Above{});
  NoteTail(entries);
  built_ = true;
}

void RankedCandidates::NoteTail(absl::Span<const CandidateEntry> entries) {
  size_ = entries.size();
  tail_.clear();
  for (size_t i = size_ - std::min(size_, kTail); i < size_; ++i) {
    tail_.push_back({entries[i].slot, static_cast<uint32_t>(i)});
  }
}

void RankedCandidates::Push(Item item) {
  heap_.push_back(item);
  std::push_heap(heap_.begin(), heap_.end(), Above{});
}

RankedCandidates::Item RankedCandidates::Pop() {
  std::pop_heap(heap_.begin(), heap_.end(), Above{});
  const Item top = heap_.back();
  heap_.pop_back();
  return top;
}

uint32_t RankedCandidates::PositionOf(absl::Span<const CandidateEntry> entries,
                                      uint32_t slot) const {
  const Tensor& t = key_.table->AtSlot(slot);
  const uint32_t pos = key_.session ? t.session_pos : t.gpu_pos;
  return pos < entries.size() && entries[pos].slot == slot ? pos : UINT32_MAX;
}

uint32_t RankedCandidates::Pick(absl::Span<const CandidateEntry> entries,
                                Bound bound, Usable usable, Score score) {
  // A release removes its entry by moving the list's last one into its
  // place; only entries of the old tail can have moved. Ranked again at
  // their new places (their old items no longer match and are dropped),
  // or everything anew when more left than the tail kept.
  if (entries.size() > size_ || size_ - entries.size() > tail_.size()) {
    Build(entries, bound);
  } else {
    for (const Placed& was : tail_) {
      const uint32_t pos = PositionOf(entries, was.slot);
      if (pos != UINT32_MAX && pos != was.pos) {
        Push({bound(entries[pos]), pos, was.slot});
      }
    }
  }
  for (const Item& item : aside_) Push(item);
  aside_.clear();
  uint32_t best = UINT32_MAX;
  // Every key is at most its candidate's score and positions are current,
  // so the first top whose score is its key is the lowest (score,
  // position) of all.
  while (!heap_.empty()) {
    const Item top = Pop();
    if (PositionOf(entries, top.slot) != top.pos) continue;  // gone or moved
    if (!usable(top.slot)) {
      aside_.push_back(top);
      continue;
    }
    const double s = score(top.slot);
    if (s > top.key) {  // its score rose: ranked again where it now stands
      Push({s, top.pos, top.slot});
      continue;
    }
    // It stays ranked: the caller may not release it, and a released one
    // is dropped when it next comes up.
    Push({s, top.pos, top.slot});
    best = top.slot;
    break;
  }
  NoteTail(entries);
  return best;
}

}  // namespace deltad::policy
