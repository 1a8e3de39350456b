#include "policies/sim/lower_bounds.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace deltad::sim {

namespace {

int64_t CeilNs(double bytes, double bytes_per_s) {
  return static_cast<int64_t>(std::ceil(1e9 * bytes / bytes_per_s));
}

// The steps whose bound is taken: those with the most bytes live.
constexpr size_t kStepsBounded = 64;

// What must be rebuilt or swapped around one step, and what that costs.
class StepBound {
 public:
  StepBound(const Program& program, const DeviceProfile& device,
            const std::vector<int32_t>& last_read,
            const std::vector<char>& dropped,
            const std::vector<int64_t>& before_ns, size_t s)
      : d2h_ns_per_byte_(1e9 / device.d2h_bytes_per_s),
        h2d_ns_per_byte_(1e9 / device.h2d_bytes_per_s) {
    const Step& step = program.steps[s];
    before_ = static_cast<double>(before_ns[s]);
    own_ = static_cast<double>(step.time_ns);
    after_ = static_cast<double>(program.compute_ns) - before_ - own_;
    std::vector<char> used(program.storages.size(), 0);
    for (int32_t r : step.reads) used[r] = 1;
    for (int32_t c : step.creates) used[c] = 1;
    must_ = step.need_bytes;
    absl::flat_hash_map<int32_t, int64_t> by_producer;
    for (size_t j = 0; j < program.storages.size(); ++j) {
      const Storage& st = program.storages[j];
      const bool made = st.constant ? !dropped[j]
                                    : st.producer >= 0 &&
                                          static_cast<size_t>(st.producer) < s;
      const bool lives =
          st.freed_at < 0 || static_cast<size_t>(st.freed_at) >= s;
      // Read after s: it must be back by then. (What is not read again can
      // be dropped for nothing, as far as this bound knows.)
      if (used[j] || !made || !lives ||
          last_read[j] <= static_cast<int32_t>(s)) {
        continue;
      }
      later_ += st.bytes;
      if (st.constant) carried_ += st.bytes;
      if (st.recomputable) {
        by_producer[st.producer] += st.bytes;
        rebuildable_ += st.bytes;
      }
    }
    for (const auto& [producer, bytes] : by_producer) {
      units_.push_back({static_cast<double>(program.steps[producer].time_ns),
                        static_cast<double>(bytes)});
    }
    std::sort(units_.begin(), units_.end(), [](const Unit& a, const Unit& b) {
      return a.ns * b.bytes < b.ns * a.bytes;
    });
  }

  int64_t live() const { return must_ + later_; }

  // The least time of a schedule that keeps at most `budget` bytes on the
  // device during this step (compute_ns where nothing has to leave).
  double Least(int64_t budget) const {
    const double excess = static_cast<double>(
        std::min(later_, std::max<int64_t>(0, live() - budget)));
    if (excess <= 0) return before_ + own_ + after_;
    const double lo = std::max(0.0, excess - static_cast<double>(rebuildable_));
    const double hi = excess;
    // Breakpoints of the convex, piecewise linear cost of swapping x: the
    // ends, where the copies out pass the compute before, where a producer
    // is rebuilt whole, and where the copies back cross the compute after
    // within a producer's span.
    std::vector<double> xs = {
        lo, hi, static_cast<double>(carried_) + before_ / d2h_ns_per_byte_};
    double rebuilt = 0;  // bytes of the units before this one
    double ns = 0;       // their op time
    for (const Unit& u : units_) {
      const double rate = u.ns / u.bytes;
      // Over this unit's span y = excess - x runs from `rebuilt` to
      // `rebuilt + u.bytes`: after(x) = after_ + ns + rate * (excess - x -
      // rebuilt), equal to x * h2d where
      xs.push_back((after_ + ns + rate * (excess - rebuilt)) /
                   (h2d_ns_per_byte_ + rate));
      rebuilt += u.bytes;
      ns += u.ns;
      xs.push_back(excess - rebuilt);
    }
    xs.push_back((after_ + ns) / h2d_ns_per_byte_);  // all rebuilt
    double best = std::numeric_limits<double>::infinity();
    for (double x : xs) {
      x = std::clamp(x, lo, hi);
      best = std::min(best, Cost(x, excess));
    }
    return best;
  }

 private:
  struct Unit {
    double ns;
    double bytes;
  };

  // Rebuilding y bytes, cheapest producers first, the last in part.
  double Rebuild(double y) const {
    double ns = 0;
    for (const Unit& u : units_) {
      if (y <= 0) break;
      const double take = std::min(y, u.bytes);
      ns += u.ns * take / u.bytes;
      y -= take;
    }
    return ns;
  }

  double Cost(double x, double excess) const {
    // What the iteration found on the host needs no copy out: the storages
    // that outlive iterations are taken to be that, first.
    const double out = std::max(0.0, x - static_cast<double>(carried_));
    return std::max(before_, out * d2h_ns_per_byte_) + own_ +
           std::max(after_ + Rebuild(excess - x), x * h2d_ns_per_byte_);
  }

  const double d2h_ns_per_byte_;
  const double h2d_ns_per_byte_;
  double before_ = 0;
  double own_ = 0;
  double after_ = 0;
  int64_t must_ = 0;         // read or made at the step, its workspace
  int64_t later_ = 0;        // living across it and read after it
  int64_t rebuildable_ = 0;  // of those, what can be recomputed
  int64_t carried_ = 0;      // and what outlives iterations (constants)
  std::vector<Unit> units_;  // their producers, cheapest per byte first
};

int64_t MixedBound(const Program& program, const DeviceProfile& device,
                   int64_t budget_bytes) {
  const size_t n = program.steps.size();
  std::vector<int32_t> last_read(program.storages.size(), -1);
  std::vector<int64_t> before_ns(n, 0);
  int64_t t = 0;
  for (size_t i = 0; i < n; ++i) {
    before_ns[i] = t;
    t += program.steps[i].time_ns;
    for (int32_t r : program.steps[i].reads) {
      last_read[r] = static_cast<int32_t>(i);
    }
  }
  // Constants dropped before the first step (inputs the trace frees).
  std::vector<char> dropped(program.storages.size(), 0);
  for (int32_t f : program.initial_frees) dropped[f] = 1;
  auto live = [&](size_t step) { return program.steps[step].live_bytes; };
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  const size_t bounded = std::min(kStepsBounded, n);
  std::partial_sort(order.begin(), order.begin() + bounded, order.end(),
                    [&](size_t a, size_t b) { return live(a) > live(b); });
  double best = static_cast<double>(program.compute_ns);
  for (size_t k = 0; k < bounded; ++k) {
    if (live(order[k]) <= budget_bytes) break;
    const StepBound step(program, device, last_read, dropped, before_ns,
                         order[k]);
    best = std::max(best, step.Least(budget_bytes));
  }
  // Rounded down, and a nanosecond per step for the doubles' rounding.
  return std::max(program.compute_ns, static_cast<int64_t>(std::floor(best)) -
                                          static_cast<int64_t>(n));
}

}  // namespace

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes) {
  LowerBounds lb;
  lb.compute_ns = program.compute_ns;
  lb.swap_only_ns = program.compute_ns;
  lb.mixed_ns = program.compute_ns;
  const int64_t excess =
      std::max<int64_t>(0, program.peak_bytes - budget_bytes);
  if (excess == 0) return lb;
  if (device.d2h_bytes_per_s <= 0 || device.h2d_bytes_per_s <= 0) {
    // Nothing can leave the device: no swap-only schedule fits.
    lb.swap_only_ns = std::numeric_limits<int64_t>::max();
    return lb;
  }
  // The excess must be copied out before the peak step and back after it,
  // once each way. With the paper's single link of bandwidth beta that is
  // 2 * excess / beta. The two directions are separate engines here, so
  // each is charged at its own rate: this equals the paper's bound when
  // they match, and stays a lower bound when they differ (charging both at
  // the slower rate would not be).
  const auto bytes = static_cast<double>(excess);
  const int64_t copy_ns = CeilNs(bytes, device.d2h_bytes_per_s) +
                          CeilNs(bytes, device.h2d_bytes_per_s);
  lb.swap_only_ns = std::max(lb.compute_ns, copy_ns);
  lb.mixed_ns = MixedBound(program, device, budget_bytes);
  return lb;
}

}  // namespace deltad::sim
