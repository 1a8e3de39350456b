#include "daemon/session_stream.h"

#include <chrono>
#include <utility>

#include "common/monotonic_clock.h"
#include "daemon/memory_manager_service.h"

namespace deltad::daemon {

namespace {
// How long what is queued may take to go out once reads have ended, before
// the call is cancelled: a process that stopped reading would otherwise
// hold its session for ever.
constexpr std::chrono::seconds kWriterGrace{2};

// A refused batch, as the stream tells it; the stream carries on.
v1::Orders Rejected(const absl::Status& status) {
  v1::Orders refused;
  refused.set_rejected_batch(std::string(status.message()));
  refused.set_rejected_code(static_cast<int32_t>(status.code()));
  return refused;
}

// Marks the session busy while its message is worked on (see
// SessionLeases::Busy), whichever way the work is left.
class Working {
 public:
  Working(SessionLeases& leases, SessionId id) : leases_(leases), id_(id) {
    leases_.Busy(id_, true);
  }
  ~Working() { leases_.Busy(id_, false); }

 private:
  SessionLeases& leases_;
  SessionId id_;
};
}  // namespace

class SessionStream::Writer final : public MailboxListener {
 public:
  explicit Writer(SessionStream* stream) : stream_(stream) {}

  void Ready() override {
    SessionStream* ending = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stream_ != nullptr && stream_->PumpLocked()) {
        ending = std::exchange(stream_, nullptr);
      }
    }
    if (ending != nullptr) ending->End();
  }

  // A write ended (a reaction of the stream's).
  void Written(bool ok) {
    SessionStream* ending = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stream_ == nullptr) return;
      stream_->writing_ = false;
      if (!ok) stream_->write_failed_ = true;
      if (stream_->PumpLocked()) ending = std::exchange(stream_, nullptr);
    }
    if (ending != nullptr) ending->End();
  }

  void ReadsEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    if (stream_ != nullptr) stream_->reads_ended_ = true;
  }

  // The grace after reads ended ran out with orders still going out.
  void GraceOver() {
    SessionStream* stream;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stream_ == nullptr) return;
      stream = stream_;
      stream->stuck_ = true;
      stream->cancelling_ = true;  // it does not end before TryCancel returns
    }
    // Outside the lock, as gRPC may run reactions meanwhile; the write in
    // flight then ends, not OK.
    stream->context_->TryCancel();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stream->cancelling_ = false;
      if (!stream->PumpLocked()) return;
      stream_ = nullptr;
    }
    stream->End();
  }

 private:
  std::mutex mu_;
  SessionStream* stream_;  // null once the stream ends
};

SessionStream::SessionStream(MemoryManagerService& service,
                             grpc::CallbackServerContext* context)
    : service_(service), context_(context) {
  StartRead(&raw_);
}

void SessionStream::OnReadDone(bool ok) {
  if (!ok) {
    if (opened_) {
      EndReads(absl::OkStatus());
    } else {
      Finish(grpc::Status::OK);  // ended before it named a session
    }
    return;
  }
  v1::SessionMessage message;
  // A message past the size limit, or that does not parse, ends the
  // stream: what else the client meant cannot be known.
  absl::Status parsed = CheckMessageBytes(raw_.Length(), service_.limits_);
  if (!parsed.ok()) {
    service_.CountRefusal(Refusal::kMessageBytes);
  } else if (parsed = ParseBuffer(raw_, message); !parsed.ok()) {
    service_.CountInvalid();
  }
  if (!parsed.ok()) {
    if (opened_) {
      EndReads(std::move(parsed));
    } else {
      Finish(ToGrpc(parsed));
    }
    return;
  }
  if (!opened_) {
    if (absl::Status started = Start(message); !started.ok()) {
      Finish(ToGrpc(started));
      return;
    }
  }
  if (!Work(message)) {
    EndReads(end_);
    return;
  }
  StartRead(&raw_);
}

void SessionStream::OnWriteDone(bool ok) { writer_->Written(ok); }

absl::Status SessionStream::Start(const v1::SessionMessage& message) {
  token_ = message.session_token();
  auto session = service_.node_.registry().Authorize(token_);
  if (!session.ok()) return session.status();
  id_ = session->id;
  // Set before the box opens: a post may start a write at once.
  writer_ = std::make_shared<Writer>(this);
  MemoryManagerService& service = service_;
  grpc::CallbackServerContext* context = context_;
  const SessionId id = id_;
  if (!service_.mailboxes_.Open(
          id_, [&service, context, id] { service.EndUnread(context, id); },
          writer_)) {
    writer_.reset();
    return absl::AlreadyExistsError("this session already has a stream");
  }
  opened_ = true;
  service_.node_.SetReachable(id_, true);
  if (message.heartbeats()) service_.leases_.Add(id_, common::MonotonicNs());
  return absl::OkStatus();
}

bool SessionStream::Work(const v1::SessionMessage& message) {
  Working working(service_.leases_, id_);
  if (message.has_unlisted_chunk_bytes()) {
    // A figure out of range is dropped: the rest of the message stands.
    if (!service_.node_.SetUnlisted(token_, message.unlisted_chunk_bytes())
             .ok()) {
      service_.CountInvalid();
    }
  }
  if (!message.session_token().empty() && message.session_token() != token_) {
    service_.mailboxes_.Post(id_,
                             Rejected(absl::InvalidArgumentError(
                                 "a stream carries one session's batches")));
    return true;
  }
  if (!message.has_batch()) return true;
  auto orders = service_.node_.Apply(token_, message.batch());
  service_.batches_.Applied(id_);
  if (!orders.ok()) {
    if (orders.status().code() == absl::StatusCode::kUnauthenticated) {
      end_ = orders.status();  // closed meanwhile: the stream ends
      return false;
    }
    service_.mailboxes_.Post(id_, Rejected(orders.status()));
    return true;
  }
  service_.Deliver(*orders);
  return true;
}

void SessionStream::EndReads(absl::Status end) {
  end_ = std::move(end);
  // Reads end without a cancel only after the process's WritesDone: a
  // close. Anything else (a cut connection, the process cancelling a
  // stream it gave up on) broke the stream.
  cancelled_ = context_->IsCancelled();
  {
    std::lock_guard<std::mutex> lock(service_.lease_mu_);
    service_.leases_.Remove(id_);
  }
  service_.node_.SetReachable(id_, false);
  std::shared_ptr<Writer> writer = writer_;
  grace_.Set(std::chrono::system_clock::now() + kWriterGrace,
             [writer](bool expired) {
               if (expired) writer->GraceOver();
             });
  // From here on the stream may end on another thread (a failed write
  // seen by a post); gRPC deletes it only after this reaction returns.
  writer->ReadsEnded();
  service_.mailboxes_.Close(id_);
  // The box may be gone already (emptied after an overflow), and then
  // Close wakes nobody.
  writer->Ready();
}

bool SessionStream::PumpLocked() {
  if (ending_) return false;
  if (!writing_ && !write_failed_ && !box_closed_) {
    switch (service_.mailboxes_.Take(id_, &out_)) {
      case Mailboxes::Taken::kOrders:
        writing_ = true;
        StartWrite(&out_);
        break;
      case Mailboxes::Taken::kEmpty:
        break;
      case Mailboxes::Taken::kClosed:
        box_closed_ = true;
        break;
    }
  }
  if (!reads_ended_ || writing_ || cancelling_) return false;
  if (!box_closed_ && !write_failed_) return false;
  ending_ = true;
  return true;
}

void SessionStream::End() {
  grace_.Cancel();
  service_.mailboxes_.Remove(id_);
  service_.batches_.Forget(id_);
  service_.replies_.Forget(id_);
  auto others = service_.node_.CloseSession(
      token_,
      cancelled_ || stuck_ ? SessionEnd::kStreamBroken : SessionEnd::kClosed,
      stuck_       ? "the process stopped reading its orders"
      : cancelled_ ? "cancelled or cut off"
                   : "");
  if (others.ok()) service_.Deliver(*others);
  Finish(ToGrpc(end_));
}

}  // namespace deltad::daemon
