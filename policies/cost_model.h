#ifndef DELTAD_POLICIES_COST_MODEL_H_
#define DELTAD_POLICIES_COST_MODEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {

// Measured effective host-link bandwidth of one GPU, each way.
struct LinkBandwidth {
  double d2h_bytes_per_s = 0;
  double h2d_bytes_per_s = 0;
  // What a copy costs besides its bytes (issuing it, the link's latency).
  // Without it a tensor of a few bytes whose copy has landed is priced at
  // nothing, and the Filter takes it first though it frees nothing. 0
  // where not measured.
  int64_t copy_latency_ns = 0;
};

// Times of the three ways to get a tensor's bytes back: copy out and in
// (swap), or recompute from parents. Thread compatible (const methods only
// read); the owner serialises SetBandwidth.
class CostModel {
 public:
  // Used for a GPU nobody measured: PCIe 4.0 x16 at the ~35% efficiency the
  // DELTA paper observed (64 GB/s nominal both ways, §4.1 and §5.1).
  static constexpr LinkBandwidth kDefaultBandwidth{11.2e9, 11.2e9};

  absl::Status SetBandwidth(GpuId gpu, LinkBandwidth bw);
  const LinkBandwidth& Bandwidth(GpuId gpu) const {
    if (gpu < 0 || static_cast<size_t>(gpu) >= bandwidth_.size() ||
        bandwidth_[gpu].d2h_bytes_per_s <= 0) {
      return kDefaultBandwidth;
    }
    return bandwidth_[gpu];
  }

  // Bytes already queued for copy to the host on this GPU's link. An offload
  // decided now frees its memory only after they have gone, so its cost
  // includes them: with a saturated link the Director evicts instead of
  // queueing more.
  void SetOffloadBacklog(GpuId gpu, int64_t bytes);

  // Inline, as SwapNs: a sampled decision prices a swap for each of its
  // sqrt(N) candidates.
  int64_t OffloadNs(GpuId gpu, int64_t bytes) const {
    const LinkBandwidth& bw = Bandwidth(gpu);
    return bw.copy_latency_ns +
           static_cast<int64_t>(1e9 * static_cast<double>(bytes) /
                                bw.d2h_bytes_per_s);
  }
  int64_t ReloadNs(GpuId gpu, int64_t bytes) const {
    const LinkBandwidth& bw = Bandwidth(gpu);
    return bw.copy_latency_ns +
           static_cast<int64_t>(1e9 * static_cast<double>(bytes) /
                                bw.h2d_bytes_per_s);
  }
  // c_s(t): offload now (after the backlog and `queued` more bytes that
  // the caller is about to add) and reload later; a tensor whose bytes are
  // on the host already pays the reload alone.
  int64_t SwapNs(const Tensor& t, int64_t queued = 0) const {
    return SwapNs(t.gpu, t.bytes, t.flags, queued);
  }
  int64_t SwapNs(GpuId gpu, int64_t bytes, const TensorFlags& flags,
                 int64_t queued = 0) const {
    return flags.host_copy ? ReloadNs(gpu, bytes) : SwapNs(gpu, bytes, queued);
  }
  int64_t SwapNs(GpuId gpu, int64_t bytes, int64_t queued = 0) const {
    return OffloadNs(gpu, Backlog(gpu) + queued + bytes) + ReloadNs(gpu, bytes);
  }

  // Whether a rebuild's ancestors on the host count in its price
  // (NeighbourhoodNsEq, the Filter's delta_cost): a rebuild reads its
  // parents, and one offloaded comes back first, by its reload or, where
  // restores may rebuild, its own rebuild if cheaper. Off, they count as
  // free, and a tensor whose ancestors were offloaded from their copies
  // made ahead looks as cheap to evict as if they were resident, though its
  // rebuild brings them back one by one (on unet-6 at half its peak, an
  // 8-deep rebuild chain of 22 ms, bench/policy_bench). On by default, the
  // restores by reload, as the Director's default restores.
  void SetPriceOffloadedAncestors(bool price, bool restore_may_recompute) {
    price_offloaded_ancestors_ = price;
    restore_may_recompute_ = restore_may_recompute;
    ++epoch_;
  }
  bool price_offloaded_ancestors() const { return price_offloaded_ancestors_; }
  // What bringing offloaded `t` back costs: its reload, or its own compute
  // cost where restores may rebuild and that is less.
  int64_t RestoreNs(const Tensor& t) const;

  // Moves with every change of a price (bandwidth, backlog): a ranking of
  // candidates by their prices holds while it stays.
  uint64_t epoch() const { return epoch_; }

  // What SetOffloadBacklog set for `gpu` (0 if nothing).
  int64_t Backlog(GpuId gpu) const {
    return gpu >= 0 && static_cast<size_t>(gpu) < backlog_.size()
               ? backlog_[gpu]
               : 0;
  }

 private:
  // Indexed by GPU: a node has a handful, and the Filter prices a swap for
  // every candidate it scores.
  std::vector<LinkBandwidth> bandwidth_;  // zero: not measured, use default
  std::vector<int64_t> backlog_;
  uint64_t epoch_ = 0;
  bool price_offloaded_ancestors_ = true;
  bool restore_may_recompute_ = false;
};

// c_r(t): the tensor's own compute cost plus that of every evicted component
// adjacent to it through its parents (ancestors that must be rebuilt first).
// Counted once per component, as DTR's equivalence-class approximation does.
int64_t RecomputeNs(const TensorTable& table, uint32_t slot);

// DTR's neighbourhood cost for the `dtr_eq` heuristic: own cost plus the
// evicted components adjacent through parents and children (evicting t would
// also make its evicted children's rebuild need t).
// With `costs` that price offloaded ancestors (SetPriceOffloadedAncestors),
// plus the restore of each offloaded ancestor a rebuild of the tensor
// reaches through its evicted (or freed) ones (CostModel::RestoreNs); one
// restored by a rebuild leads on to its own parents.
int64_t NeighbourhoodNsEq(const TensorTable& table, uint32_t slot,
                          const CostModel* costs = nullptr);

// DTR's exact neighbourhood e*(t): own cost plus every evicted ancestor
// reachable through evicted parents and every evicted descendant reachable
// through evicted children. O(size of that region).
int64_t NeighbourhoodNsExact(const TensorTable& table, uint32_t slot);

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_COST_MODEL_H_
