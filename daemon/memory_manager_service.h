#ifndef DELTAD_DAEMON_MEMORY_MANAGER_SERVICE_H_
#define DELTAD_DAEMON_MEMORY_MANAGER_SERVICE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "daemon/heap_return.h"
#include "daemon/metrics.h"
#include "daemon/node.h"
#include "daemon/release_replies.h"
#include "daemon/request_limits.h"
#include "daemon/session_leases.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::daemon {

// Told that a session's box has orders to take or was closed. Called
// outside the boxes' lock, on the thread that posted or closed, possibly
// after the box is gone: it must tolerate a call that finds nothing.
class MailboxListener {
 public:
  virtual ~MailboxListener() = default;
  virtual void Ready() = 0;
};

// Orders waiting to go out on each session's stream. A session's orders may
// come from any thread (another session's release, a rebalance); the
// stream takes them out one write at a time, since gRPC allows a single
// write in flight, and a post wakes it through its listener.
//
// A box holds at most `max_queued_bytes` of orders: a process that does not
// read its stream would otherwise grow the daemon without bound. A post
// that would pass it closes and empties the box, and its `on_overflow` is
// called, once, under the boxes' lock (so that its stream still exists):
// it must not call back into the Mailboxes. Thread safe.
class Mailboxes {
 public:
  explicit Mailboxes(int64_t max_queued_bytes = int64_t{1} << 20)
      : max_queued_bytes_(max_queued_bytes) {}

  // False when the session already has an open box (a second stream).
  // `listener` (kept while the box lives) hears of every post and the
  // close.
  bool Open(SessionId session, std::function<void()> on_overflow = nullptr,
            std::shared_ptr<MailboxListener> listener = nullptr);
  // Tells the listener, which then finds the box closed once it is empty.
  void Close(SessionId session);
  // False, and dropped, when the session has no open box (no stream), or
  // when the box overflows.
  bool Post(SessionId session, v1::Orders orders);
  // Every open box gets the same orders (draining).
  void Broadcast(const v1::Orders& orders);
  enum class Taken { kOrders, kEmpty, kClosed };
  // The oldest orders into `out` (kOrders); kEmpty when none wait; kClosed
  // once the box is closed and empty, or gone (the box is then forgotten).
  // Never waits.
  Taken Take(SessionId session, v1::Orders* out);
  // Forgets the box and whatever is still queued in it (the stream is gone).
  void Remove(SessionId session);

 private:
  struct Queued {
    v1::Orders orders;
    int64_t bytes = 0;
  };
  struct Box {
    std::deque<Queued> queue;
    int64_t bytes = 0;  // of the orders queued
    bool closed = false;
    std::function<void()> on_overflow;
    std::shared_ptr<MailboxListener> listener;
  };

  const int64_t max_queued_bytes_;
  std::mutex mu_;
  std::map<SessionId, Box> boxes_;
};

// How many batches each session's stream has applied, so that a Release
// call can wait for the stream batches the process sent before it (see
// ReleaseRequest.stream_batches_sent). Thread safe.
class BatchCounter {
 public:
  void Applied(SessionId session);
  // True once `session` has applied at least `batches`, false when the
  // deadline passes first.
  bool WaitFor(SessionId session, uint64_t batches,
               std::chrono::system_clock::time_point deadline);
  void Forget(SessionId session);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<SessionId, uint64_t> applied_;
};

// grpc::StatusCode for an absl::Status, with its message: the two share
// their numbering.
grpc::Status ToGrpc(const absl::Status& status);

// Parses a request off the wire (see ParseRequest).
absl::Status ParseBuffer(const grpc::ByteBuffer& buffer,
                         google::protobuf::Message& message);

// The MemoryManager service: translates between the wire and the Node and
// holds no policy of its own. A session's Session stream is its lifeline:
// when it ends, the session is reclaimed (daemon/session_stream.h). Thread
// safe.
//
// Requests arrive as bytes and are parsed and checked here (ParseRequest,
// Validate), not by gRPC: a request that does not parse, or whose fields
// pass the limits, gets INVALID_ARGUMENT naming the field, and nothing
// else happens. The methods below take them parsed and checked.
class MemoryManagerService final : public grpc::Service {
 public:
  // `metrics` may be null; it must outlive the service. A thread of the
  // service watches the sessions' leases (`leases`) until it is destroyed.
  explicit MemoryManagerService(Node& node, RequestLimits limits = {},
                                Metrics* metrics = nullptr,
                                LeaseOptions leases = {});
  ~MemoryManagerService() override;

  grpc::Status OpenSession(grpc::ServerContext* context,
                           const v1::OpenSessionRequest* request,
                           v1::OpenSessionResponse* response);
  grpc::Status CloseSession(grpc::ServerContext* context,
                            const v1::CloseSessionRequest* request,
                            v1::CloseSessionResponse* response);
  grpc::Status Release(grpc::ServerContext* context,
                       const v1::ReleaseRequest* request,
                       v1::ReleaseResponse* response);
  grpc::Status NodeStatus(grpc::ServerContext* context,
                          const v1::NodeStatusRequest* request,
                          v1::NodeStatusResponse* response);
  grpc::Status ListTensors(grpc::ServerContext* context,
                           const v1::ListTensorsRequest* request,
                           v1::ListTensorsResponse* response);

  // Tells every open stream the daemon is going away, and refuses new
  // sessions (UNAVAILABLE) from now on; clients carry on with their
  // in-process policy.
  void Drain();
  Mailboxes& mailboxes() { return mailboxes_; }

  // Posts each session's orders; those that cannot be delivered are undone
  // in the Node, so its view of the tensors stays the process's view.
  void Deliver(const OrdersBySession& orders);

 private:
  // Registers a unary method whose request is parsed and validated before
  // `handler` sees it.
  template <typename Request, typename Response>
  void AddUnary(const char* name,
                grpc::Status (MemoryManagerService::*handler)(
                    grpc::ServerContext*, const Request*, Response*));
  // The Session stream (daemon/session_stream.h) works with the service's
  // parts below.
  friend class SessionStream;

  // The session's stream was not read while its orders piled up past
  // limits.max_queued_order_bytes: ends the call with RESOURCE_EXHAUSTED.
  void EndUnread(grpc::ServerContextBase* context, SessionId session);
  void CountInvalid();
  void CountRefusal(Refusal refusal);

  // Ticks the leases and carries out what changed (Node::MarkUnresponsive
  // and the others), until the service is destroyed.
  void WatchLeases();

  Node& node_;
  const RequestLimits limits_;
  Metrics* const metrics_;
  Mailboxes mailboxes_;
  BatchCounter batches_;
  ReleaseReplies replies_;
  std::atomic<bool> draining_{false};
  SessionLeases leases_;
  HeapReturn heap_;               // ticked by the lease thread
  int64_t heap_reported_ns_ = 0;  // the lease thread's: the last gauge set
  // Held while lease changes are carried out, and while a stream gives up
  // its lease, so that no change lands on a session whose stream ended.
  std::mutex lease_mu_;
  std::condition_variable lease_cv_;
  bool lease_stop_ = false;  // guarded by lease_mu_
  std::thread lease_thread_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_MEMORY_MANAGER_SERVICE_H_
