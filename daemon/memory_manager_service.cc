#include "daemon/memory_manager_service.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {

namespace {
// How long a stream's writer may take to deliver what is queued once the
// stream has ended, before the call is cancelled to unblock it.
constexpr std::chrono::seconds kWriterGrace{2};
}  // namespace

bool Mailboxes::Open(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  return boxes_.emplace(session, Box{}).second;
}

void Mailboxes::Close(SessionId session) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = boxes_.find(session);
    if (it != boxes_.end()) it->second.closed = true;
  }
  cv_.notify_all();
}

bool Mailboxes::Post(SessionId session, v1::Orders orders) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = boxes_.find(session);
    if (it == boxes_.end() || it->second.closed) return false;
    it->second.queue.push_back(std::move(orders));
  }
  cv_.notify_all();
  return true;
}

void Mailboxes::Broadcast(const v1::Orders& orders) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [session, box] : boxes_) {
      if (!box.closed) box.queue.push_back(orders);
    }
  }
  cv_.notify_all();
}

bool Mailboxes::Take(SessionId session, v1::Orders* out) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto it = boxes_.find(session);
    if (it == boxes_.end()) return false;
    Box& box = it->second;
    if (!box.queue.empty()) {
      *out = std::move(box.queue.front());
      box.queue.pop_front();
      return true;
    }
    if (box.closed) {
      boxes_.erase(it);
      return false;
    }
    cv_.wait(lock);
  }
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
  auto opened = node_.OpenSession(request->peer_token(), *request);
  if (!opened.ok()) return ToGrpc(opened.status());
  *response = std::move(opened->response);
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

grpc::Status MemoryManagerService::Session(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::Orders, v1::SessionMessage>* stream) {
  v1::SessionMessage message;
  if (!stream->Read(&message)) return grpc::Status::OK;
  const std::string token = message.session_token();
  auto session = node_.registry().Authorize(token);
  if (!session.ok()) return ToGrpc(session.status());
  const SessionId id = session->id;
  if (!mailboxes_.Open(id)) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        "this session already has a stream");
  }
  // The only writer of this stream: orders from every source go through the
  // session's mailbox.
  node_.SetReachable(id, true);
  std::promise<void> writer_done;
  std::future<void> writer_finished = writer_done.get_future();
  std::thread writer([this, id, stream, &writer_done] {
    v1::Orders orders;
    while (mailboxes_.Take(id, &orders)) {
      if (!stream->Write(orders)) break;
    }
    writer_done.set_value();
  });
  absl::Status end;  // what the stream ends with
  do {
    if (!message.session_token().empty() && message.session_token() != token) {
      v1::Orders refused;
      refused.set_rejected_batch("a stream carries one session's batches");
      refused.set_rejected_code(
          static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
      mailboxes_.Post(id, std::move(refused));
      continue;
    }
    if (!message.has_batch()) continue;
    auto orders = node_.Apply(token, message.batch());
    batches_.Applied(id);
    if (!orders.ok()) {
      if (orders.status().code() == absl::StatusCode::kUnauthenticated) {
        end = orders.status();  // closed meanwhile: the stream ends
        break;
      }
      v1::Orders refused;
      refused.set_rejected_batch(std::string(orders.status().message()));
      refused.set_rejected_code(static_cast<int32_t>(orders.status().code()));
      mailboxes_.Post(id, std::move(refused));
      continue;
    }
    Deliver(*orders);
  } while (stream->Read(&message));
  // The stream ended: the process closed it or went away. Reclaim now. The
  // writer gets a moment to deliver what is queued; a client that stopped
  // reading would leave it blocked in Write for ever, and cancelling the
  // call wakes it.
  // Reads end without a cancel only after the process's WritesDone: a
  // close. Anything else (a cut connection, the process cancelling a
  // stream it gave up on) broke the stream.
  const bool cancelled = context->IsCancelled();
  node_.SetReachable(id, false);
  mailboxes_.Close(id);
  const bool stuck =
      writer_finished.wait_for(kWriterGrace) != std::future_status::ready;
  if (stuck) context->TryCancel();
  writer.join();
  mailboxes_.Remove(id);
  batches_.Forget(id);
  auto others = node_.CloseSession(
      token,
      cancelled || stuck ? SessionEnd::kStreamBroken : SessionEnd::kClosed,
      stuck       ? "the process stopped reading its orders"
      : cancelled ? "cancelled or cut off"
                  : "");
  if (others.ok()) Deliver(*others);
  return ToGrpc(end);
}

grpc::Status MemoryManagerService::Release(grpc::ServerContext* context,
                                           const v1::ReleaseRequest* request,
                                           v1::ReleaseResponse* response) {
  if (request->stream_batches_sent() > 0) {
    auto session = node_.registry().Authorize(request->session_token());
    if (!session.ok()) return ToGrpc(session.status());
    // Without a deadline from the caller, a bounded wait: a stream batch
    // that never comes must not hold the call for ever.
    const auto deadline =
        std::min(context->deadline(),
                 std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!batches_.WaitFor(session->id, request->stream_batches_sent(),
                          deadline)) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("the stream has not delivered the ",
                                       request->stream_batches_sent(),
                                       " batches this call follows"));
    }
  }
  auto released = node_.Release(*request);
  if (!released.ok()) return ToGrpc(released.status());
  *response = std::move(released->response);
  Deliver(released->others);
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
