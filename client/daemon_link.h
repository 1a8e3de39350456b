#ifndef DELTAD_CLIENT_DAEMON_LINK_H_
#define DELTAD_CLIENT_DAEMON_LINK_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

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

// One session with the daemon: the side-socket connection that proves who
// this process is (and whose end tells the daemon the process is gone), the
// gRPC channel, and the session's stream. Orders arrive on a reader thread
// and go to `on_orders`; when the stream ends for any reason, `on_lost`
// runs once on that thread. Both name the link they come from, so that a
// link already replaced can be told apart. Thread safe.
class DaemonLink {
 public:
  using OrdersFn = std::function<void(const DaemonLink*, const v1::Orders&)>;
  using LostFn = std::function<void(const DaemonLink*, const std::string&)>;

  // Connects, opens the session, fetches the host slabs and opens the
  // stream. UNAVAILABLE when no daemon answers.
  static absl::StatusOr<std::unique_ptr<DaemonLink>> Open(
      const LinkOptions& options, OrdersFn on_orders, LostFn on_lost);

  DaemonLink(const DaemonLink&) = delete;
  DaemonLink& operator=(const DaemonLink&) = delete;
  ~DaemonLink();  // Close()

  const v1::OpenSessionResponse& session() const { return session_; }
  int gpu() const { return gpu_; }  // the daemon's index of the session's GPU
  // The slabs received at Open; the caller owns their descriptors.
  std::vector<common::side::Grant> TakeSlabs();

  // Device chunks until the session holds target_bytes, as far as the
  // daemon allows (see Node::GrantChunks); the new ones only. Each blocks the
  // calling thread for at most the RPC timeout. UNAVAILABLE once the side
  // connection is gone.
  absl::StatusOr<std::vector<common::side::Grant>> FetchChunks(
      int64_t target_bytes);
  // Chunks this process unmapped, for the daemon to release.
  absl::Status ReturnChunks(const std::vector<uint64_t>& chunk_ids);

  // Sends a batch on the stream. UNAVAILABLE once the stream is gone.
  absl::Status Send(const v1::EventBatch& batch);
  // The synchronous release (ReleaseRequest), with the events not yet sent
  // and the number of batches sent on the stream before it.
  absl::StatusOr<v1::ReleaseResponse> Release(int64_t bytes,
                                              const v1::EventBatch& batch,
                                              uint64_t stream_batches_sent);
  // Ends the session: ends the stream (the daemon reclaims the session once
  // it has applied every batch sent), then the side connection. Waits for
  // the reader thread; `on_lost` does not run for a Close.
  void Close();

  // Sends a message on the stream when nothing was written for a quarter
  // of the session's lease (OpenSessionResponse.lease_ms), so the daemon
  // knows the process still answers, or when `unlisted_chunk_bytes` (what
  // the process maps beside this session's chunks; -1: unknown now)
  // differs from what it last sent. Skipped while another write is under
  // way. Called from the session keeper's thread only.
  void Heartbeat(int64_t unlisted_chunk_bytes = -1);

  bool alive() const { return alive_.load(); }
  // Release calls sent again because the daemon answered past the RPC
  // timeout (late, not lost: see LinkOptions::release_retry_ms).
  int64_t release_calls_sent_again() const { return sent_again_.load(); }
  // Whether a write on the stream has waited past the RPC timeout: the
  // daemon stopped reading (stalled), and gRPC's writes have no deadline.
  // A write begun before `resumed_ns` (when this process last ran again
  // after being stopped) counts from then: its wait is the daemon's only
  // while this process ran.
  bool WriteStalled(int64_t resumed_ns = 0) const;
  // Cuts the stream off: a write waiting on it returns, and `on_lost` runs
  // with `why`.
  void Cancel(const std::string& why);
  // Whether the daemon's end of the side connection has closed: the daemon
  // died, stopped, or reclaimed this process's sessions. Then nothing the
  // session held can be handed to another process any more.
  bool SideClosedByDaemon() const;

 private:
  DaemonLink() = default;
  void ReadOrders();

  LinkOptions options_;
  OrdersFn on_orders_;
  LostFn on_lost_;
  common::UniqueFd side_;
  std::mutex side_mu_;        // one request and its answer at a time
  std::mutex release_mu_;     // one Release call (and its retries) at a time
  uint64_t release_seq_ = 0;  // guarded by release_mu_
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
  v1::OpenSessionResponse session_;
  int gpu_ = 0;
  std::vector<common::side::Grant> slabs_;

  grpc::ClientContext stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::Orders>>
      stream_;
  std::mutex write_mu_;  // one writer at a time on the stream
  std::atomic<int64_t> write_since_ns_{0};  // 0: no write under way
  std::atomic<int64_t> last_write_ns_{0};   // when the last one ended
  int64_t unlisted_sent_ = 0;               // the keeper's thread only
  std::mutex cancel_mu_;
  std::string cancelled_for_;  // guarded by cancel_mu_
  std::thread reader_;
  std::mutex reader_mu_;
  std::condition_variable reader_cv_;
  bool reader_done_ = false;  // the stream ended and was finished
  std::atomic<bool> alive_{false};
  std::atomic<int64_t> sent_again_{0};
  std::atomic<bool> closing_{false};
  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_DAEMON_LINK_H_
