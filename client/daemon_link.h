#ifndef DELTAD_CLIENT_DAEMON_LINK_H_
#define DELTAD_CLIENT_DAEMON_LINK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/side_protocol.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::client {

struct LinkOptions {
  std::string socket_path = "/run/deltad/deltad.sock";
  // The daemon's index of the GPU; -1: the one whose UUID is `gpu_uuid`
  // (a process in a container, or with CUDA_VISIBLE_DEVICES, sees its GPU
  // as device 0 whatever the node's index), or GPU 0 without a UUID.
  int gpu = -1;
  std::string gpu_uuid;
  int64_t requested_budget_bytes = 0;  // 0: a fair share
  int64_t requested_host_bytes = 0;    // 0: the daemon's default
  // What the process cannot run without (0: none declared): no later
  // admission cuts its budget below it; refused if it does not fit.
  int64_t min_budget_bytes = 0;
  uint32_t priority = 1;
  std::string label;
  // How long a connect or a synchronous call may take before the daemon
  // counts as unreachable (the client then decides by itself).
  int rpc_timeout_ms = 2000;
  // How long a Release call is sent again, each try bounded by
  // rpc_timeout_ms, before the session counts as lost: on a busy node the
  // daemon answers late rather than never, and a lost session costs a new
  // one and every tensor reported again. Only where the daemon applies a
  // call once however often it comes (OpenSessionResponse.release_retries).
  // 0: one try.
  int release_retry_ms = 8000;
};

// One session with the daemon, as the client sees it: the session's
// answer, its host slabs and device chunks, its stream of events and of
// orders, and its one synchronous call (Release). Orders arrive on a thread
// of the link's and go to `on_orders`; when the session ends for any
// reason, `on_lost` runs once on that thread. Both name the link they come
// from, so that a link already replaced can be told apart. Open() is the
// real one, over gRPC and the side socket (GrpcDaemonLink); tests stand in
// another (ClientOptions::open_link). Thread safe.
class DaemonLink {
 public:
  using OrdersFn = std::function<void(const DaemonLink*, const v1::Orders&)>;
  using LostFn = std::function<void(const DaemonLink*, const std::string&)>;
  using OpenFn = std::function<absl::StatusOr<std::unique_ptr<DaemonLink>>(
      const LinkOptions&, OrdersFn, LostFn)>;

  // Connects, opens the session, fetches the host slabs and opens the
  // stream. UNAVAILABLE when no daemon answers.
  static absl::StatusOr<std::unique_ptr<DaemonLink>> Open(
      const LinkOptions& options, OrdersFn on_orders, LostFn on_lost);

  DaemonLink(const DaemonLink&) = delete;
  DaemonLink& operator=(const DaemonLink&) = delete;
  virtual ~DaemonLink() = default;

  virtual const v1::OpenSessionResponse& session() const = 0;
  // The daemon's index of the session's GPU.
  virtual int gpu() const = 0;
  // The slabs received at Open; the caller owns their descriptors.
  virtual std::vector<common::side::Grant> TakeSlabs() = 0;

  // Device chunks until the session holds target_bytes, as far as the
  // daemon allows (see Node::GrantChunks); the new ones only. Each blocks the
  // calling thread for at most the RPC timeout. UNAVAILABLE once the side
  // connection is gone.
  virtual absl::StatusOr<std::vector<common::side::Grant>> FetchChunks(
      int64_t target_bytes) = 0;
  // Chunks this process unmapped, for the daemon to release.
  virtual absl::Status ReturnChunks(const std::vector<uint64_t>& chunk_ids) = 0;

  // Sends a batch on the stream. UNAVAILABLE once the stream is gone.
  virtual absl::Status Send(const v1::EventBatch& batch) = 0;
  // The synchronous release (ReleaseRequest), with the events not yet sent
  // and the number of batches sent on the stream before it.
  virtual absl::StatusOr<v1::ReleaseResponse> Release(
      int64_t bytes, const v1::EventBatch& batch,
      uint64_t stream_batches_sent) = 0;
  // Ends the session: ends the stream (the daemon reclaims the session once
  // it has applied every batch sent), then the side connection. Waits for
  // the orders' thread; `on_lost` does not run for a Close.
  virtual void Close() = 0;

  // Sends a message on the stream when nothing was written for a quarter
  // of the session's lease (OpenSessionResponse.lease_ms), so the daemon
  // knows the process still answers, or when `unlisted_chunk_bytes` (what
  // the process maps beside this session's chunks; -1: unknown now)
  // differs from what it last sent. Skipped while another write is under
  // way. Called from the session keeper's thread only.
  virtual void Heartbeat(int64_t unlisted_chunk_bytes = -1) = 0;

  virtual bool alive() const = 0;
  // Release calls sent again because the daemon answered past the RPC
  // timeout (late, not lost: see LinkOptions::release_retry_ms).
  virtual int64_t release_calls_sent_again() const = 0;
  // Whether a write on the stream has waited past the RPC timeout: the
  // daemon stopped reading (stalled), and gRPC's writes have no deadline.
  // A write begun before `resumed_ns` (when this process last ran again
  // after being stopped) counts from then: its wait is the daemon's only
  // while this process ran.
  virtual bool WriteStalled(int64_t resumed_ns = 0) const = 0;
  // Cuts the stream off: a write waiting on it returns, and `on_lost` runs
  // with `why`.
  virtual void Cancel(const std::string& why) = 0;
  // Whether the daemon's end of the side connection has closed: the daemon
  // died, stopped, or reclaimed this process's sessions. Then nothing the
  // session held can be handed to another process any more.
  virtual bool SideClosedByDaemon() const = 0;

 protected:
  DaemonLink() = default;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_DAEMON_LINK_H_
