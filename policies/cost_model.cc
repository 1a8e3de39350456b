#include "policies/cost_model.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "policies/epoch_marks.h"

namespace deltad::policy {

absl::Status CostModel::SetBandwidth(GpuId gpu, LinkBandwidth bw) {
  if (gpu < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative GPU index ", gpu));
  }
  if (!(bw.d2h_bytes_per_s > 0) || !(bw.h2d_bytes_per_s > 0) ||
      !std::isfinite(bw.d2h_bytes_per_s) ||
      !std::isfinite(bw.h2d_bytes_per_s) || bw.copy_latency_ns < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu,
        ": bandwidth must be positive and finite and latency not negative, "
        "got d2h=",
        bw.d2h_bytes_per_s, " h2d=", bw.h2d_bytes_per_s, " bytes/s, latency ",
        bw.copy_latency_ns, " ns"));
  }
  if (static_cast<size_t>(gpu) >= bandwidth_.size()) {
    bandwidth_.resize(gpu + 1, LinkBandwidth{});
  }
  bandwidth_[gpu] = bw;
  ++epoch_;
  return absl::OkStatus();
}

void CostModel::SetOffloadBacklog(GpuId gpu, int64_t bytes) {
  if (gpu < 0) return;
  if (static_cast<size_t>(gpu) >= backlog_.size()) backlog_.resize(gpu + 1, 0);
  const int64_t backlog = std::max<int64_t>(0, bytes);
  if (backlog_[gpu] != backlog) ++epoch_;
  backlog_[gpu] = backlog;
}

namespace {

// Sums the distinct components among `neighbours`. Degrees are small, so a
// linear check of the roots seen beats a hash set.
template <typename... Lists>
int64_t SumAdjacentComponents(const TensorTable& table, const Lists&... lists) {
  const EvictedComponents& uf = table.components();
  absl::InlinedVector<uint32_t, 8> roots;
  int64_t sum = 0;
  auto add = [&](absl::Span<const uint32_t> list) {
    for (uint32_t n : list) {
      if (!uf.Contains(n)) continue;
      const uint32_t r = uf.ComponentOf(n);
      if (std::find(roots.begin(), roots.end(), r) != roots.end()) continue;
      roots.push_back(r);
      sum += uf.Cost(r);
    }
  };
  (add(lists), ...);
  return sum;
}

// The restores of the offloaded ancestors a rebuild of `t` reaches: its
// offloaded parents, and those of the evicted or freed ancestors it
// rebuilds on the way (the components price those); an ancestor restored
// by its own rebuild leads on to its parents.
int64_t OffloadedAncestorsNs(const TensorTable& table, const Tensor& t,
                             const CostModel* costs) {
  if (costs == nullptr || !costs->price_offloaded_ancestors()) return 0;
  // Reused from call to call, as NeighbourhoodNsExact's.
  thread_local EpochMarks seen;
  thread_local std::vector<uint32_t> stack;
  seen.Clear(table.slot_count());
  stack.assign(t.parents.begin(), t.parents.end());
  int64_t sum = 0;
  while (!stack.empty()) {
    const uint32_t s = stack.back();
    stack.pop_back();
    if (!seen.insert(s)) continue;
    const Tensor& n = table.AtSlot(s);
    bool rebuilt = TensorTable::NeedsRecompute(n.state);
    if (n.state == TensorState::kOffloaded ||
        n.state == TensorState::kOffloading) {
      const int64_t restore = costs->RestoreNs(n);
      sum += restore;
      rebuilt = restore < costs->ReloadNs(n.gpu, n.bytes);
    }
    if (rebuilt) stack.insert(stack.end(), n.parents.begin(), n.parents.end());
  }
  return sum;
}

}  // namespace

int64_t CostModel::RestoreNs(const Tensor& t) const {
  const int64_t reload = ReloadNs(t.gpu, t.bytes);
  if (!restore_may_recompute_ || t.flags.uncomputable || t.flags.evict_pinned) {
    return reload;
  }
  return std::min(reload, t.compute_cost_ns);
}

int64_t RecomputeNs(const TensorTable& table, uint32_t slot) {
  const Tensor& t = table.AtSlot(slot);
  return t.compute_cost_ns + SumAdjacentComponents(table, t.parents);
}

int64_t NeighbourhoodNsEq(const TensorTable& table, uint32_t slot,
                          const CostModel* costs) {
  const Tensor& t = table.AtSlot(slot);
  return t.compute_cost_ns +
         SumAdjacentComponents(table, t.parents, t.children) +
         OffloadedAncestorsNs(table, t, costs);
}

int64_t NeighbourhoodNsExact(const TensorTable& table, uint32_t slot) {
  const Tensor& start = table.AtSlot(slot);
  int64_t sum = start.compute_cost_ns;
  // Reused from call to call: a set and a stack allocated per walk were
  // most of a `dtr` replay's time (walks are mostly a few tensors long).
  thread_local EpochMarks seen;
  thread_local std::vector<uint32_t> stack;
  seen.Clear(table.slot_count());
  // Ancestors through evicted parents, descendants through evicted children:
  // two separate walks, since an evicted ancestor's other children are not
  // part of t's rebuild.
  for (bool up : {true, false}) {
    const auto& first = up ? start.parents : start.children;
    stack.assign(first.begin(), first.end());
    while (!stack.empty()) {
      const uint32_t s = stack.back();
      stack.pop_back();
      const Tensor& n = table.AtSlot(s);
      if (!TensorTable::NeedsRecompute(n.state) || !seen.insert(s)) {
        continue;
      }
      sum += n.compute_cost_ns;
      const auto& next = up ? n.parents : n.children;
      stack.insert(stack.end(), next.begin(), next.end());
    }
  }
  return sum;
}

}  // namespace deltad::policy
