#include "daemon/memory_manager_service.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/monotonic_clock.h"
#include "common/protocol_version.h"
#include "daemon/request_parser.h"
#include "daemon/session_stream.h"
#include "grpc/grpc.h"

#ifndef DELTAD_VERSION
#define DELTAD_VERSION "0.0.0"
#endif

namespace deltad::daemon {

absl::Status ParseBuffer(const grpc::ByteBuffer& buffer,
                         google::protobuf::Message& message) {
  std::vector<grpc::Slice> slices;  // a small slice holds its bytes inline
  if (!buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("the request could not be read");
  }
  if (slices.size() == 1) {
    return ParseRequest(
        absl::string_view(reinterpret_cast<const char*>(slices[0].begin()),
                          slices[0].size()),
        message);
  }
  std::string joined;
  joined.reserve(buffer.Length());
  for (const grpc::Slice& s : slices) {
    joined.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return ParseRequest(joined, message);
}

namespace {
// The Session method's index among the methods the constructor adds, in
// their order (OpenSession, CloseSession, Session, ...).
constexpr int kSessionMethod = 2;

// Parses and validates one request off the wire.
template <typename Request>
absl::Status Decode(const grpc::ByteBuffer& buffer, const RequestLimits& limits,
                    Request* request) {
  if (absl::Status s = ParseBuffer(buffer, *request); !s.ok()) return s;
  return Validate(*request, limits);
}
}  // namespace

bool Mailboxes::Open(SessionId session, std::function<void()> on_overflow,
                     std::shared_ptr<MailboxListener> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  Box box;
  box.on_overflow = std::move(on_overflow);
  box.listener = std::move(listener);
  return boxes_.emplace(session, std::move(box)).second;
}

void Mailboxes::Close(SessionId session) {
  std::shared_ptr<MailboxListener> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = boxes_.find(session);
    if (it == boxes_.end()) return;
    it->second.closed = true;
    listener = it->second.listener;
  }
  if (listener) listener->Ready();
}

bool Mailboxes::Post(SessionId session, v1::Orders orders) {
  std::shared_ptr<MailboxListener> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = boxes_.find(session);
    if (it == boxes_.end() || it->second.closed) return false;
    Box& box = it->second;
    const auto bytes = static_cast<int64_t>(orders.ByteSizeLong());
    if (box.bytes + bytes > max_queued_bytes_) {
      box.closed = true;
      box.queue.clear();
      box.bytes = 0;
      if (box.on_overflow) std::exchange(box.on_overflow, nullptr)();
      return false;
    }
    box.bytes += bytes;
    box.queue.push_back({std::move(orders), bytes});
    listener = box.listener;
  }
  // Outside the lock: the listener takes the orders out, and another
  // session's stream may be posting to this one's meanwhile.
  if (listener) listener->Ready();
  return true;
}

void Mailboxes::Broadcast(const v1::Orders& orders) {
  std::vector<std::shared_ptr<MailboxListener>> listeners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Unbounded, once: a few bytes per box.
    const auto bytes = static_cast<int64_t>(orders.ByteSizeLong());
    for (auto& [session, box] : boxes_) {
      if (box.closed) continue;
      box.queue.push_back({orders, bytes});
      box.bytes += bytes;
      if (box.listener) listeners.push_back(box.listener);
    }
  }
  for (const auto& listener : listeners) listener->Ready();
}

Mailboxes::Taken Mailboxes::Take(SessionId session, v1::Orders* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = boxes_.find(session);
  if (it == boxes_.end()) return Taken::kClosed;
  Box& box = it->second;
  if (!box.queue.empty()) {
    *out = std::move(box.queue.front().orders);
    box.bytes -= box.queue.front().bytes;
    box.queue.pop_front();
    return Taken::kOrders;
  }
  if (box.closed) {
    boxes_.erase(it);
    return Taken::kClosed;
  }
  return Taken::kEmpty;
}

void Mailboxes::Remove(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  boxes_.erase(session);
}

void BatchCounter::Applied(SessionId session) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++applied_[session];
  }
  cv_.notify_all();
}

bool BatchCounter::WaitFor(SessionId session, uint64_t batches,
                           std::chrono::system_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [&] {
    auto it = applied_.find(session);
    return (it == applied_.end() ? 0 : it->second) >= batches;
  });
}

void BatchCounter::Forget(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  applied_.erase(session);
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

template <typename Request, typename Response>
void MemoryManagerService::AddUnary(
    const char* name,
    grpc::Status (MemoryManagerService::*handler)(grpc::ServerContext*,
                                                  const Request*, Response*)) {
  AddMethod(new grpc::internal::RpcServiceMethod(
      name, grpc::internal::RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<MemoryManagerService,
                                           grpc::ByteBuffer, Response>(
          [handler](MemoryManagerService* service, grpc::ServerContext* context,
                    const grpc::ByteBuffer* raw, Response* response) {
            if (absl::Status s =
                    CheckMessageBytes(raw->Length(), service->limits_);
                !s.ok()) {
              service->CountRefusal(Refusal::kMessageBytes);
              return ToGrpc(s);
            }
            Request request;
            if (absl::Status s = Decode(*raw, service->limits_, &request);
                !s.ok()) {
              service->CountInvalid();
              return ToGrpc(s);
            }
            return (service->*handler)(context, &request, response);
          },
          this)));
}

MemoryManagerService::MemoryManagerService(Node& node, RequestLimits limits,
                                           Metrics* metrics,
                                           LeaseOptions leases)
    : node_(node),
      limits_(limits),
      metrics_(metrics),
      mailboxes_(limits.max_queued_order_bytes),
      leases_(leases) {
  lease_thread_ = std::thread([this] { WatchLeases(); });
  // The names of proto/deltad/v1/memory_manager.proto's service, which the
  // generated stubs call.
  AddUnary("/deltad.v1.MemoryManager/OpenSession",
           &MemoryManagerService::OpenSession);
  AddUnary("/deltad.v1.MemoryManager/CloseSession",
           &MemoryManagerService::CloseSession);
  // The stream is served by gRPC's callback threads, not a thread of its
  // own (daemon/session_stream.h).
  AddMethod(new grpc::internal::RpcServiceMethod(
      "/deltad.v1.MemoryManager/Session",
      grpc::internal::RpcMethod::BIDI_STREAMING, nullptr));
  MarkMethodCallback(
      kSessionMethod,
      new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, v1::Orders>(
          [this](grpc::CallbackServerContext* context) {
            return new SessionStream(*this, context);
          }));
  AddUnary("/deltad.v1.MemoryManager/Release", &MemoryManagerService::Release);
  AddUnary("/deltad.v1.MemoryManager/NodeStatus",
           &MemoryManagerService::NodeStatus);
  AddUnary("/deltad.v1.MemoryManager/ListTensors",
           &MemoryManagerService::ListTensors);
}

MemoryManagerService::~MemoryManagerService() {
  {
    std::lock_guard<std::mutex> lock(lease_mu_);
    lease_stop_ = true;
  }
  lease_cv_.notify_all();
  lease_thread_.join();
}

void MemoryManagerService::WatchLeases() {
  // Ten ticks a lease, at most ten a second: a silence is seen within a
  // tenth of the lease past it.
  const auto tick = std::chrono::nanoseconds(std::clamp<int64_t>(
      leases_.options().lease_ns / 10, 10000000, 100000000));
  std::unique_lock<std::mutex> lock(lease_mu_);
  while (!lease_stop_) {
    lease_cv_.wait_for(lock, tick);
    if (lease_stop_) break;
    for (const SessionLeases::Change& c : leases_.Tick(
             common::MonotonicNs(),
             [this](SessionId id) { return node_.ProcessStoppedOf(id); })) {
      switch (c.kind) {
        case SessionLeases::Change::kUnresponsive:
          Deliver(node_.MarkUnresponsive(c.session, c.silent_ns));
          break;
        case SessionLeases::Change::kAnswered:
          Deliver(node_.MarkAnswered(c.session, c.silent_ns));
          break;
        case SessionLeases::Change::kEnd:
          (void)node_.EndUnresponsive(c.session, c.silent_ns);
          break;
      }
    }
    Deliver(node_.SettleLeftMapped());
    // The same timer returns what ended sessions freed (lease_mu_ is not
    // needed for it, but a trim is short and rare).
    const int64_t now = common::MonotonicNs();
    (void)heap_.Tick(now);
    // Once a second: mallinfo2 walks the arenas' free lists under their
    // locks.
    if (metrics_ != nullptr && now - heap_reported_ns_ >= 1000000000) {
      metrics_->SetHeapInUse(HeapInUseBytes());
      heap_reported_ns_ = now;
    }
  }
}

void MemoryManagerService::CountInvalid() {
  CountRefusal(Refusal::kInvalidRequest);
}

void MemoryManagerService::CountRefusal(Refusal refusal) {
  if (metrics_ != nullptr) metrics_->AddRefusal(refusal);
}

void MemoryManagerService::EndUnread(grpc::ServerContextBase* context,
                                     SessionId session) {
  if (metrics_ != nullptr) metrics_->AddRefusal(Refusal::kQueuedOrderBytes);
  const std::string why = absl::StrCat(
      "session ", session,
      " did not read its stream: the orders waiting for it passed ",
      limits_.max_queued_order_bytes,
      " bytes (limits.max_queued_order_bytes); the session is closed");
  // TryCancel would end the call as CANCELLED, with no reason. The status
  // goes out as HTTP/2 trailers, which flow control does not hold back
  // behind the data the process never read.
  grpc_call_cancel_with_status(
      context->c_call(), GRPC_STATUS_RESOURCE_EXHAUSTED, why.c_str(), nullptr);
}

void MemoryManagerService::Deliver(const OrdersBySession& orders) {
  for (const auto& [session, o] : orders) {
    if (!mailboxes_.Post(session, o)) node_.Undeliverable(session, o);
  }
}

grpc::Status MemoryManagerService::OpenSession(
    grpc::ServerContext* /*context*/, const v1::OpenSessionRequest* request,
    v1::OpenSessionResponse* response) {
  if (draining_.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "deltad is shutting down and opens no new sessions");
  }
  if (const uint32_t spoken =
          common::SpokenProtocol(request->protocol_version());
      spoken != common::kProtocolVersion) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        common::ProtocolMismatch(request->client_version(), spoken,
                                 DELTAD_VERSION, common::kProtocolVersion));
  }
  auto opened = node_.OpenSession(request->peer_token(), *request);
  if (!opened.ok()) return ToGrpc(opened.status());
  *response = std::move(opened->response);
  response->set_daemon_version(DELTAD_VERSION);
  response->set_protocol_version(common::kProtocolVersion);
  response->set_release_retries(true);
  response->set_lease_ms(
      static_cast<int32_t>(leases_.options().lease_ns / 1000000));
  Deliver(opened->others);
  return grpc::Status::OK;
}

grpc::Status MemoryManagerService::CloseSession(
    grpc::ServerContext* /*context*/, const v1::CloseSessionRequest* request,
    v1::CloseSessionResponse* /*response*/) {
  auto session = node_.registry().Authorize(request->session_token());
  auto others = node_.CloseSession(request->session_token());
  if (!others.ok()) return ToGrpc(others.status());
  if (session.ok()) mailboxes_.Close(session->id);
  Deliver(*others);
  return grpc::Status::OK;
}

grpc::Status MemoryManagerService::Release(grpc::ServerContext* context,
                                           const v1::ReleaseRequest* request,
                                           v1::ReleaseResponse* response) {
  auto session = node_.registry().Authorize(request->session_token());
  if (!session.ok()) return ToGrpc(session.status());
  // A process waiting on a call answers, whatever its stream says.
  leases_.Heard(session->id);
  // Without a deadline from the caller, a bounded wait: a stream batch that
  // never comes, or an earlier call that never ends, must not hold the call
  // for ever.
  const auto deadline =
      std::min(context->deadline(),
               std::chrono::system_clock::now() + std::chrono::seconds(10));
  const SessionId id = session->id;
  auto answer = replies_.Run(
      id, request->release_seq(), deadline, [&]() -> ReleaseReplies::Outcome {
        if (request->stream_batches_sent() > 0 &&
            !batches_.WaitFor(id, request->stream_batches_sent(), deadline)) {
          return {absl::DeadlineExceededError(
                      absl::StrCat("the stream has not delivered the ",
                                   request->stream_batches_sent(),
                                   " batches this call follows")),
                  /*applied=*/false};
        }
        auto released = node_.Release(*request);
        if (!released.ok()) return {released.status()};
        Deliver(released->others);
        return {std::move(released->response)};
      });
  if (!answer.ok()) return ToGrpc(answer.status());
  *response = std::move(*answer);
  return grpc::Status::OK;
}

grpc::Status MemoryManagerService::NodeStatus(
    grpc::ServerContext* /*context*/, const v1::NodeStatusRequest* /*request*/,
    v1::NodeStatusResponse* response) {
  *response = node_.Status();
  return grpc::Status::OK;
}

grpc::Status MemoryManagerService::ListTensors(
    grpc::ServerContext* /*context*/, const v1::ListTensorsRequest* request,
    v1::ListTensorsResponse* response) {
  auto listed = node_.ListTensors(*request);
  if (!listed.ok()) return ToGrpc(listed.status());
  *response = std::move(*listed);
  return grpc::Status::OK;
}

void MemoryManagerService::Drain() {
  draining_.store(true);
  v1::Orders draining;
  draining.set_draining(true);
  mailboxes_.Broadcast(draining);
}

}  // namespace deltad::daemon
