#ifndef DELTAD_CLIENT_GRPC_DAEMON_LINK_H_
#define DELTAD_CLIENT_GRPC_DAEMON_LINK_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "client/daemon_link.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::client {

// The session over gRPC: the side-socket connection that proves who this
// process is (and whose end tells the daemon the process is gone), the
// gRPC channel, and the session's stream, whose orders a reader thread
// reads. What each call does: DaemonLink. Thread safe.
class GrpcDaemonLink final : public DaemonLink {
 public:
  static absl::StatusOr<std::unique_ptr<DaemonLink>> Open(
      const LinkOptions& options, OrdersFn on_orders, LostFn on_lost);
  ~GrpcDaemonLink() override;  // Close()

  const v1::OpenSessionResponse& session() const override { return session_; }
  int gpu() const override { return gpu_; }
  std::vector<common::side::Grant> TakeSlabs() override;
  absl::StatusOr<std::vector<common::side::Grant>> FetchChunks(
      int64_t target_bytes) override;
  absl::Status ReturnChunks(const std::vector<uint64_t>& chunk_ids) override;
  absl::Status Send(const v1::EventBatch& batch) override;
  absl::StatusOr<v1::ReleaseResponse> Release(
      int64_t bytes, const v1::EventBatch& batch,
      uint64_t stream_batches_sent) override;
  void Close() override;
  void Heartbeat(int64_t unlisted_chunk_bytes = -1) override;
  bool alive() const override { return alive_.load(); }
  int64_t release_calls_sent_again() const override {
    return sent_again_.load();
  }
  bool WriteStalled(int64_t resumed_ns = 0) const override;
  void Cancel(const std::string& why) override;
  bool SideClosedByDaemon() const override;

 private:
  GrpcDaemonLink() = default;
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

#endif  // DELTAD_CLIENT_GRPC_DAEMON_LINK_H_
