#ifndef DELTAD_DAEMON_NODE_H_
#define DELTAD_DAEMON_NODE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/log_limit.h"
#include "daemon/backend/device_backend.h"
#include "daemon/chunk_ledger.h"
#include "daemon/gpu_arbiter.h"
#include "daemon/gpu_policy.h"
#include "daemon/host_pool.h"
#include "daemon/node_events.h"
#include "daemon/session_end_log.h"
#include "daemon/session_registry.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::daemon {

struct NodeOptions {
  double gpu_share = 0.9;  // of each GPU's memory, handed out as budgets
  int64_t min_session_bytes = int64_t{1} << 30;
  int64_t default_host_quota_bytes = int64_t{8} << 30;
  int max_sessions_per_gpu = 64;
  int max_sessions_per_uid = 256;                    // on all GPUs
  int64_t max_host_quota_bytes = int64_t{64} << 30;  // per session
  // NodeStatus lists at most this many sessions, in at most this many
  // bytes, and counts the others (NodeStatusResponse.sessions_omitted).
  int max_status_sessions = 1024;
  int64_t max_status_bytes = int64_t{2} << 20;
  GpuPolicyOptions policy;       // its link bandwidth is taken from the backend
  std::string side_socket_path;  // told to clients in OpenSession
  std::string version = "0.1.0";
};

// Orders to deliver, by the session that must carry them out.
using OrdersBySession = std::map<SessionId, v1::Orders>;

// The daemon's state and its every decision, behind one thread-safe API:
// sessions and their credentials, each GPU's arbiter and policy engine, the
// host pool. The gRPC service and the side socket only translate to and from
// it. Each GPU has its own lock, so sessions on different GPUs never wait
// for each other. What it does is reported to its NodeEvents (the metrics
// watch it through MetricsObserver). Does not own the backend or the pool;
// they must outlive it. Thread safe.
class Node {
 public:
  // `events` may be null: nothing watches.
  static absl::StatusOr<std::unique_ptr<Node>> Create(
      DeviceBackend& backend, HostPool& pool,
      std::unique_ptr<NodeEvents> events, NodeOptions options);

  SessionRegistry& registry() { return registry_; }

  struct Opened {
    v1::OpenSessionResponse response;
    std::vector<Slab> slabs;  // fds to pass to the process (pool-owned)
    OrdersBySession others;   // budget changes of the other sessions
  };
  // For the process that holds `peer_token` (see SessionRegistry).
  absl::StatusOr<Opened> OpenSession(absl::string_view peer_token,
                                     const v1::OpenSessionRequest& request);
  // Returns the budget changes of the sessions that remain. `why` and
  // `detail` are logged (see SessionEndLog); `why` is reported.
  absl::StatusOr<OrdersBySession> CloseSession(
      absl::string_view token, SessionEnd why = SessionEnd::kClosed,
      absl::string_view detail = {});
  // The process behind a peer token is gone: reclaims all its sessions.
  OrdersBySession PeerGone(absl::string_view peer_token);

  // Applies a batch from the session; returns the orders it causes, for it
  // and for others.
  absl::StatusOr<OrdersBySession> Apply(absl::string_view token,
                                        const v1::EventBatch& batch);
  // The synchronous path: orders that make room for request.bytes().
  struct Released {
    v1::ReleaseResponse response;
    OrdersBySession others;
  };
  absl::StatusOr<Released> Release(const v1::ReleaseRequest& request);

  // The host slabs of a session, for the process that holds `peer_token`
  // only (see SessionRegistry::AuthorizeForPeer).
  absl::StatusOr<std::vector<common::side::Grant>> HostSlabs(
      absl::string_view session_token, absl::string_view peer_token) const;

  // Device chunks for a session, for the process that holds `peer_token`
  // only: new ones until it holds target_bytes in whole chunks, within its
  // budget, or beyond it by what the GPU's budget has that no session
  // holds (see ChunkLedger::Grant).
  // When the GPU is short, the sessions holding chunks beyond their budget
  // are told their budget again (in `others`), which makes them return
  // what they hold past it once it is free.
  struct Granted {
    std::vector<common::side::Grant> chunks;
    OrdersBySession others;
  };
  absl::StatusOr<Granted> GrantChunks(absl::string_view session_token,
                                      absl::string_view peer_token,
                                      int64_t target_bytes);
  // The process unmapped these chunks of its session. NOT_FOUND for a chunk
  // that is not that session's.
  absl::Status ReturnChunks(absl::string_view session_token,
                            absl::string_view peer_token,
                            absl::Span<const uint64_t> chunk_ids);

  // Every GPU, and the sessions within NodeOptions' bounds.
  v1::NodeStatusResponse Status() const;

  // The daemon is going away: sessions reclaimed from now on keep their
  // slabs' contents. A process that lives on keeps training on its own and
  // still maps its slabs, with its offloaded tensors in them; wiping them
  // would lose those bytes. The pool dies with the daemon anyway.
  void KeepSlabContents() { keep_slab_contents_.store(true); }
  // The largest tensors of any session, for operators. NOT_FOUND for an
  // unknown session id, INVALID_ARGUMENT for a limit above
  // kMaxListTensors (0 means kDefaultListTensors).
  static constexpr uint32_t kDefaultListTensors = 20;
  static constexpr uint32_t kMaxListTensors = 1000;
  absl::StatusOr<v1::ListTensorsResponse> ListTensors(
      const v1::ListTensorsRequest& request) const;

  // Leases (docs/RELIABILITY.md, "Leases"). The session's process has not
  // been heard from past its lease (`silent_ns`): its budget becomes what
  // it holds (GpuArbiter::Freeze), its tensors are no longer chosen for
  // releases, and it is logged, counted and shown
  // (SessionStatus.unresponsive_ms). Returns the other sessions' budget
  // changes, each with a note naming it. Nothing for a session unknown or
  // already marked.
  OrdersBySession MarkUnresponsive(SessionId session, int64_t silent_ns);
  // It answers again: shared as before, its own budget included.
  OrdersBySession MarkAnswered(SessionId session, int64_t silent_ns);
  // SIGKILL to the process of a session unresponsive for `silent_ns`
  // (lease.end_unresponsive_after_ms), if it is still the process that
  // opened it; logged and counted either way. Its memory comes back when
  // the kernel has torn it down and its side connection closes.
  absl::Status EndUnresponsive(SessionId session, int64_t silent_ns);
  // Whether the session's process is stopped (see ProcessStopped).
  bool ProcessStoppedOf(SessionId session) const;

  // Chunks left mapped by processes whose sessions ended (see
  // Gpu::left_mapped) for longer than `settle_ns` come out of the budgets
  // shared; returns the budgets that changed. Called every lease tick.
  OrdersBySession SettleLeftMapped(int64_t settle_ns = 1000000000);

  // What the session's process maps beside its granted chunks
  // (SessionMessage.unlisted_chunk_bytes). INVALID_ARGUMENT below 0 or
  // above the GPU's memory; UNAUTHENTICATED for an unknown token.
  absl::Status SetUnlisted(absl::string_view token, int64_t bytes);

  // The session's stream opened (true) or closed (false); see
  // GpuPolicy::SetReachable.
  void SetReachable(SessionId session, bool reachable);
  // Orders the service could not deliver (the session has no stream): the
  // releases and prefetches in them are undone.
  void Undeliverable(SessionId session, const v1::Orders& orders);

 private:
  struct Gpu {
    std::mutex mu;
    GpuArbiter arbiter;
    std::unique_ptr<GpuPolicy> policy;
    // Sessions marked unresponsive: since when (NowNs), and how long they
    // had been silent then.
    struct Silence {
      int64_t since_ns = 0;
      int64_t silent_ns = 0;
    };
    std::map<SessionId, Silence> unresponsive;
    // Chunk bytes processes map beside what their sessions hold, as they
    // report them (SessionMessage.unlisted_chunk_bytes).
    std::map<SessionId, int64_t> unlisted;
    // Chunk bytes of sessions that ended while their processes live on
    // (still mapped, whatever the daemon released), by peer token: until
    // the process is gone (PeerGone). A new session of the process reports
    // them itself as unlisted. Never granted at once; taken out of the
    // budgets shared only once settled (SettleLeftMapped), since most
    // processes whose session ends exit a moment later.
    struct LeftMapped {
      int64_t bytes = 0;
      int64_t since_ns = 0;
      bool settled = false;
    };
    std::map<std::string, LeftMapped> left_mapped;
    int64_t UnlistedTotal() const;
    int64_t SettledLeftMapped() const;
    explicit Gpu(GpuArbiter a) : arbiter(std::move(a)) {}
  };

  Node(DeviceBackend& backend, HostPool& pool,
       std::unique_ptr<NodeEvents> events, NodeOptions options)
      : backend_(backend),
        pool_(pool),
        events_(events != nullptr ? std::move(events)
                                  : std::make_unique<NodeEvents>()),
        options_(std::move(options)),
        registry_(options_.max_sessions_per_gpu, options_.max_sessions_per_uid),
        chunks_(backend) {}
  // Removes a session from its GPU and the pool; the lock of its GPU must
  // not be held.
  OrdersBySession Reclaim(const SessionInfo& session, SessionEnd why,
                          absl::string_view detail);
  void AddBudgetOrders(const std::vector<BudgetChange>& changes,
                       SessionId except, Gpu& gpu, OrdersBySession& out);
  // The GPU's state and the pool's to events_; the GPU's lock is held.
  void ReportGpu(int gpu_index, Gpu& gpu);
  // The budgets shared without the GPU's settled left-mapped chunks, their
  // changes into `out`; the GPU's lock is held.
  void ShareWithoutLeftMapped(Gpu& gpu, OrdersBySession& out);
  // The session with this id, if it is open.
  std::optional<SessionInfo> Find(SessionId session) const;
  // A session's batch applied to its GPU (whose lock is held): events to the
  // policy, an iteration's peak to the arbiter. Nothing changes if refused.
  absl::Status ApplyBatch(const SessionInfo& session, Gpu& gpu,
                          const v1::EventBatch& batch, int64_t now);

  DeviceBackend& backend_;
  HostPool& pool_;
  const std::unique_ptr<NodeEvents> events_;  // never null
  const NodeOptions options_;
  SessionRegistry registry_;
  ChunkLedger chunks_;
  SessionEndLog end_log_;
  common::LogLimit lease_log_{10, std::chrono::seconds(1)};
  std::vector<std::unique_ptr<Gpu>> gpus_;
  std::atomic<bool> keep_slab_contents_{false};
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_NODE_H_
