#ifndef DELTAD_POLICIES_EPOCH_MARKS_H_
#define DELTAD_POLICIES_EPOCH_MARKS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace deltad::policy {

// A set of small keys (slots, storages) emptied in O(1): a walk or a search
// that runs many times marks what it met without allocating a set per run,
// which was most of the time of the loops that use it.
class EpochMarks {
 public:
  // Empties the set and makes room for keys below `n`.
  void Clear(size_t n) {
    if (mark_.size() < n) mark_.resize(n, 0);
    if (++epoch_ == 0) {  // wrapped: old marks would read as current
      std::fill(mark_.begin(), mark_.end(), 0);
      epoch_ = 1;
    }
  }
  bool contains(size_t key) const { return mark_[key] == epoch_; }
  // Whether `key` was not in the set yet.
  bool insert(size_t key) {
    if (mark_[key] == epoch_) return false;
    mark_[key] = epoch_;
    return true;
  }
  void erase(size_t key) { mark_[key] = 0; }

 private:
  std::vector<uint32_t> mark_;
  uint32_t epoch_ = 0;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_EPOCH_MARKS_H_
