#ifndef DELTAD_POLICIES_FREE_SLOTS_H_
#define DELTAD_POLICIES_FREE_SLOTS_H_

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace deltad::policy {

// The free slots of a table, handed out lowest first. A table that reuses
// its lowest free slot keeps its tensors packed at the front, so that once
// a peak has passed the slots past the last live one can be cut off and
// their memory given back; a stack of free slots hands back the slots freed
// last, high ones included, and holds the array at its peak for good.
//
// Three levels of 64-bit words (a bit per slot, a bit per non-empty word of
// the level below): finding the lowest is three count-trailing-zeros after
// a scan of the top level, one word per 262,144 slots.
class FreeSlots {
 public:
  bool empty() const { return count_ == 0; }
  size_t size() const { return count_; }

  bool contains(uint32_t slot) const {
    const size_t w = slot / 64;
    return w < bits_.size() && (bits_[w] >> (slot % 64) & 1) != 0;
  }

  // Marks `slot` free; it must not be already.
  void insert(uint32_t slot) {
    const size_t w0 = slot / 64;
    if (w0 >= bits_.size()) Grow(w0 + 1);
    const size_t w1 = w0 / 64;
    const size_t w2 = w1 / 64;
    if (bits_[w0] == 0) {
      if (words_[w1] == 0) top_[w2] |= uint64_t{1} << (w1 % 64);
      words_[w1] |= uint64_t{1} << (w0 % 64);
    }
    bits_[w0] |= uint64_t{1} << (slot % 64);
    ++count_;
  }

  // Unmarks `slot`; it must be free.
  void erase(uint32_t slot) {
    const size_t w0 = slot / 64;
    const size_t w1 = w0 / 64;
    bits_[w0] &= ~(uint64_t{1} << (slot % 64));
    if (bits_[w0] == 0) {
      words_[w1] &= ~(uint64_t{1} << (w0 % 64));
      if (words_[w1] == 0) top_[w1 / 64] &= ~(uint64_t{1} << (w1 % 64));
    }
    --count_;
  }

  // The lowest free slot, taken; the set must not be empty.
  uint32_t PopLowest() {
    size_t w2 = 0;
    while (top_[w2] == 0) ++w2;
    const size_t w1 = w2 * 64 + std::countr_zero(top_[w2]);
    const size_t w0 = w1 * 64 + std::countr_zero(words_[w1]);
    const auto slot =
        static_cast<uint32_t>(w0 * 64 + std::countr_zero(bits_[w0]));
    erase(slot);
    return slot;
  }

 private:
  void Grow(size_t bit_words) {
    // Doubling, so that growth one slot at a time stays amortised O(1).
    const size_t n = std::max(bit_words, 2 * bits_.size());
    bits_.resize(n, 0);
    words_.resize((n + 63) / 64, 0);
    top_.resize((words_.size() + 63) / 64, 0);
  }

  std::vector<uint64_t> bits_;   // a bit per slot
  std::vector<uint64_t> words_;  // a bit per non-zero word of bits_
  std::vector<uint64_t> top_;    // a bit per non-zero word of words_
  size_t count_ = 0;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_FREE_SLOTS_H_
