#ifndef DELTAD_DAEMON_GPU_POLICY_H_
#define DELTAD_DAEMON_GPU_POLICY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/prefetch_order.h"
#include "daemon/session_id.h"
#include "deltad/v1/memory_manager.pb.h"
#include "policies/cost_model.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/prefetcher.h"
#include "policies/release_planner.h"
#include "policies/tensor_table.h"
#include "policies/watermarks.h"

namespace deltad::daemon {

struct GpuPolicyOptions {
  policy::FilterOptions filter;  // heuristic, sampled search
  double high_watermark = policy::Watermarks::kDefaultHigh;
  double low_watermark = policy::Watermarks::kDefaultLow;
  policy::LinkBandwidth link{25e9, 25e9};  // measured by the backend
  int max_prefetch_in_flight = 2;
  // The replay's look-ahead, as a fraction of the session's budget (see
  // PrefetchOrder); 0: prefetches always follow DELTA's queue.
  double prefetch_replay_window = 0.25;
  // Accesses one iteration's record may hold, per session.
  int64_t max_recorded_accesses = 65536;
  int64_t max_tensors_per_session = int64_t{4} << 20;
  int32_t max_batch_events = 65536;
};

// What a batch reported having done, for the metrics.
struct AppliedCounts {
  int64_t offloaded_bytes = 0;  // copies to the host that completed
  int64_t reloaded_bytes = 0;   // copies back that completed
  int64_t evictions = 0;        // device copies freed without a copy
  int64_t recomputes = 0;
  int64_t recompute_ns = 0;  // the recomputed tensors' compute costs
};

struct SessionUsage {
  int64_t budget_bytes = 0;
  int64_t host_quota_bytes = 0;
  int64_t device_bytes = 0;  // committed: resident, minus offloads leaving
  int64_t host_bytes = 0;
  int64_t tensors = 0;
  uint64_t releases_ordered = 0;
};

// One GPU's policy engine: the tensors of every session on the GPU in one
// TensorTable, and the Filter/Director/Prefetcher running over them.
//
// Tensor ids on the wire are the session's own; they are mapped to ids that
// are unique on the GPU, so a session can never name, release or read the
// tensors of another (a foreign or unknown id is NOT_FOUND, as if it did not
// exist).
//
// Memory is shared across sessions. A session may hold more than its budget
// (its arbiter share) while the GPU has room; when room is needed, the
// tensors released come first from sessions above their share, then from
// the requesting session itself. A session within its share never loses
// tensors to another.
//
// What a session reports is not backed by anything the daemon can check,
// so what it claims beyond its share is accounted against itself alone:
// when another session asks for room, it counts only up to its share, and
// what of it cannot be released (pinned, or never real) neither fails that
// Release nor costs the asking session its own tensors. A session within
// its share therefore gets its Release met whatever another one claims.
//
// Not thread safe: the service serialises calls per GPU.
class GpuPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<GpuPolicy>> Create(
      int gpu, int64_t gpu_budget_bytes, GpuPolicyOptions options);

  // ALREADY_EXISTS for a known session.
  absl::Status AddSession(SessionId session, int64_t budget_bytes,
                          int64_t host_quota_bytes);
  // Forgets the session and every tensor it had. NOT_FOUND when unknown.
  absl::Status RemoveSession(SessionId session);
  absl::Status SetBudget(SessionId session, int64_t budget_bytes);

  // Applies a batch: creations first (parents by the session's ids, within
  // the batch or already known), then events in order. All or nothing: on
  // error nothing of the batch is applied and the message names the tensor
  // and what was wrong. INVALID_ARGUMENT for malformed input (sizes, unknown
  // event kinds, cycles), NOT_FOUND for unknown ids, FAILED_PRECONDITION for
  // an event the tensor's state does not allow, RESOURCE_EXHAUSTED past the
  // batch or tensor limits, or when the batch would leave the session
  // holding more bytes on the device than the GPU's whole budget.
  // `counts`, when given, receives what the batch reported having done.
  absl::Status Apply(SessionId session, const v1::EventBatch& batch,
                     int64_t now_ns, AppliedCounts* counts = nullptr);

  // Orders that make room for `bytes` more in `session`: the synchronous
  // path. Keyed by the session that must carry each order out (ids are that
  // session's own). RESOURCE_EXHAUSTED "can free at most N bytes" when the
  // allowed victims cannot cover it; nothing changes then.
  //
  // Releases what the GPU lacks, max(0, GPU committed bytes + bytes - GPU
  // budget): an empty map means the allocation fits as it is, even past the
  // session's share. Victims, one at a time in the Filter's order over the
  // GPU: first tensors of sessions above their budget (`session` included,
  // counting `bytes`), each only while it stays above; then `session`'s
  // own, but only toward its own part of the lack: what it would be were
  // every other session counted only up to its share (see the class
  // comment). Room is made once that part is freed, even if others' excess
  // is not. Offloads fit the owner's host quota, else evict. Bytes above
  // the GPU budget: RESOURCE_EXHAUSTED; negative: INVALID_ARGUMENT.
  absl::StatusOr<std::map<SessionId, std::vector<v1::ReleaseOrder>>> MakeRoom(
      SessionId session, int64_t bytes, int64_t now_ns);

  // After a batch: early releases above the high watermark of the GPU and
  // prefetches for `session` while its backward pass reads offloaded
  // tensors. Orders for other sessions are keyed by their id.
  //
  // Early releases are offloads only (ReleasePlanner::OffloadAhead), down to
  // the low watermark, from the same victims as MakeRoom, `session`'s own
  // again only toward its own part. Prefetched tensors
  // become kReloading (they count as device bytes) until RELOADED, or
  // OFFLOADED / RELEASE_FAILED when the reload did not happen. Empty for an
  // unknown session.
  std::map<SessionId, v1::Orders> Plan(SessionId session, int64_t now_ns);

  // The session ended a training iteration (EventBatch.
  // iteration_peak_bytes): its accesses since the last one are the order
  // its prefetches may replay. Returns the session's PrefetchOrder once
  // its trial ends with this iteration (for a log line), else nullptr.
  // NOT_FOUND when unknown.
  absl::StatusOr<const PrefetchOrder*> EndIteration(SessionId session,
                                                    int64_t now_ns);

  // Whether orders can reach the session (its stream is open). Other
  // sessions' tensors are taken only from reachable sessions, since an
  // order nobody receives frees nothing. Sessions start unreachable.
  absl::Status SetReachable(SessionId session, bool reachable);
  // Orders that could not reach their session (it has no stream): its
  // releases are cancelled, since the process will never carry them out.
  // Ids are the session's own; unknown ones are skipped.
  void Undeliverable(SessionId session, const v1::Orders& orders);
  // The session's releases ordered on its stream (since the last call) and
  // still outstanding, as orders to repeat in a synchronous answer: room
  // counted on them is room only once they are carried out, and the stream
  // may not have delivered them yet. The process carries out each order
  // once and ignores the repeat.
  std::vector<v1::ReleaseOrder> TakeStreamReleases(SessionId session);

  absl::StatusOr<SessionUsage> Usage(SessionId session) const;
  // The session's `limit` largest tensors, largest first (ties by the
  // session's id), with ids as the session knows them; freed tensors kept
  // only for recompute are left out. For operators (deltactl top): a full
  // scan of the session's tensors. NOT_FOUND for an unknown session.
  absl::StatusOr<std::vector<v1::TensorStatus>> LargestTensors(
      SessionId session, size_t limit, int64_t now_ns) const;
  int64_t device_bytes() const;  // all sessions
  int64_t gpu_budget_bytes() const { return gpu_budget_bytes_; }

 private:
  GpuPolicy(int gpu, int64_t gpu_budget_bytes, GpuPolicyOptions options,
            policy::Watermarks watermarks);

  struct Session {
    int64_t budget_bytes = 0;
    int64_t host_quota_bytes = 0;
    uint64_t releases_ordered = 0;
    // The session's own id -> the GPU-wide id in table_.
    absl::flat_hash_map<uint64_t, policy::TensorId> ids;
    // The reverse, for every tensor of the session that table_ records,
    // freed ones kept for recompute included (their own id may already name
    // a newer tensor): translates orders back and counts against
    // max_tensors_per_session.
    absl::flat_hash_map<policy::TensorId, uint64_t> locals;
    // Prefetches ordered (kReloading) and maybe not reported back yet;
    // pruned when Plan counts them.
    std::vector<policy::TensorId> reloading;
    // Releases ordered on the session's stream since its last synchronous
    // release (see TakeStreamReleases).
    std::vector<policy::TensorId> stream_releases;
    // Pruned of orders no longer outstanding when it reaches this size, so
    // a session that never asks synchronously does not grow it for ever.
    size_t stream_releases_cap = 4096;
    std::unique_ptr<policy::Prefetcher> prefetcher;
    std::unique_ptr<PrefetchOrder> order;  // the queue's, or a replay's
    // No prefetch is ordered before this time. A refused prefetch (the
    // process had no room for it, by its own count or its chunks') holds
    // the session's prefetches for kRefusalBackoffNs, doubled for each
    // refusal in a row up to kMaxPrefetchHoldShift doublings: ordered again
    // at once, the same tensor went back and forth with every batch (over
    // 13,000 orders a second under bench/soak).
    int64_t prefetch_held_until_ns = 0;
    int prefetch_refusals = 0;  // in a row; a prefetch done resets it
    bool reachable = false;     // see SetReachable
  };

  // Whose tensors a release may take, in this order (see the class comment).
  enum class Tier {
    kOverShare,  // sessions above their budget, each down to it at most
    kRequester,  // the session that asks for room, without limit
  };

  struct BatchPlan;  // a validated batch, ready to apply (gpu_policy.cc)
  absl::Status PlanCreations(SessionId session, const Session& s,
                             const v1::EventBatch& batch,
                             BatchPlan& plan) const;
  absl::Status PlanEvents(SessionId session, const Session& s,
                          const v1::EventBatch& batch, BatchPlan& plan) const;
  absl::Status ApplyPlan(Session& s, const BatchPlan& plan, int64_t now_ns,
                         AppliedCounts* counts);
  // Frees a tensor and forgets the ids of every record the table retires.
  absl::Status FreeAndForget(Session& s, policy::TensorId id);
  // The tensors Free(id) retires: id itself and its freed ancestors whose
  // last live child it is, transitively. Read before freeing.
  std::vector<policy::TensorId> RetiredByFree(policy::TensorId id) const;

  // The GPU's committed bytes as `session` answers for them: its own, and
  // each other session's only up to that session's share.
  int64_t AccountableBytes(SessionId session) const;
  // How far a round of releases has got: the over-share tier works toward
  // the GPU's whole lack, the requester's own tier only toward its part.
  struct Shortage {
    int64_t gpu = 0;  // what the GPU lacks
    int64_t own = 0;  // the part the requester answers for
    int64_t freed = 0;
    int64_t own_freed = 0;  // by the requester's own tensors
    bool Wants(Tier tier) const {
      return tier == Tier::kOverShare ? freed < gpu : own_freed < own;
    }
  };
  // Counts `order` in `shortage`, as the requester's own when it is.
  void Count(const policy::ReleaseOrder& order, SessionId requester,
             Shortage& shortage) const;

  // Sessions whose tensors `tier` allows as victims, with the host bytes
  // each has left for offloads. `incoming` counts as already held by
  // `requester`.
  struct Victim {
    int64_t host_left = 0;  // of its host quota, for offloads
    // The largest tensor it may lose: its excess over its share in the
    // over-share tier (so it never ends below its share), unbounded for the
    // requester's own tier.
    int64_t max_bytes = 0;
  };
  absl::flat_hash_map<SessionId, Victim> Victims(SessionId requester,
                                                 int64_t incoming,
                                                 Tier tier) const;
  // One release (or offload ahead) chosen by the Filter over the whole GPU
  // among the victims of `tier`; NotFound/ResourceExhausted when none.
  absl::StatusOr<policy::ReleaseOrder> ReleaseOne(SessionId requester,
                                                  int64_t incoming, Tier tier,
                                                  int64_t now_ns);
  std::optional<policy::ReleaseOrder> OffloadOneAhead(SessionId requester,
                                                      Tier tier,
                                                      int64_t now_ns);
  // The order as its owner must read it: owner's id and its own tensor id.
  // Records a release ordered on `owner`'s stream (see TakeStreamReleases).
  void NoteStreamRelease(Session& owner, SessionId owner_id,
                         policy::TensorId id);
  // `order` in its owner's terms, counted, and noted as a stream release
  // unless its owner is `on_stream_unless` (who gets it in an answer; 0,
  // which no session is, for none).
  std::pair<SessionId, v1::ReleaseOrder> Order(
      const policy::ReleaseOrder& order, SessionId on_stream_unless);
  // The release still outstanding on `t` (offload in flight, or evicted
  // from the device), if it is `session`'s; none for a null `t`.
  static std::optional<policy::ReleaseAction> Outstanding(
      const policy::Tensor* t, SessionId session);
  std::pair<SessionId, v1::ReleaseOrder> ToWire(
      const policy::ReleaseOrder& order) const;
  int64_t HostLeft(SessionId session, const Session& s) const;

  int gpu_;
  int64_t gpu_budget_bytes_;
  GpuPolicyOptions options_;
  policy::Watermarks watermarks_;
  policy::TensorTable table_;
  policy::CostModel costs_;
  policy::Filter filter_;
  policy::Director director_;
  std::map<SessionId, Session> sessions_;
  policy::TensorId next_id_ = 1;
  // When the process last refused an order for a tensor (RELEASE_FAILED:
  // it was pinned). The daemon does not see pins, so early releases leave
  // such a tensor alone for a while: otherwise every refusal's batch
  // re-plans the same order and the two sides loop (seen under
  // bench/soak: hundreds of thousands of orders a minute for one pinned
  // session).
  static constexpr int64_t kRefusalBackoffNs = 20'000'000;
  static constexpr int kMaxPrefetchHoldShift = 6;  // 1.28 s at most
  // The most compute cost one tensor may report. Costs are summed over
  // evicted components (a session's tensors, at most
  // max_tensors_per_session of them): bounded per tensor, those sums stay
  // far from int64 overflow. 1e12 ns is a quarter of an hour for one op.
  static constexpr int64_t kMaxComputeCostNs = 1'000'000'000'000;
  absl::flat_hash_map<policy::TensorId, int64_t> refused_at_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_GPU_POLICY_H_
