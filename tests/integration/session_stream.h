#ifndef DELTAD_TESTS_INTEGRATION_SESSION_STREAM_H_
#define DELTAD_TESTS_INTEGRATION_SESSION_STREAM_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::testing_util {

// Generous: the machine is slow and shared, and ASan slows the daemon.
inline constexpr absl::Duration kTimeout = absl::Seconds(30);

inline std::chrono::system_clock::time_point Deadline(
    absl::Duration d = absl::Seconds(60)) {
  return std::chrono::system_clock::now() + absl::ToChronoSeconds(d);
}

// One Session stream as a training process holds it: the first message
// names the session; orders are read on a thread of their own into a queue,
// so that a test can wait for one with a timeout and a stream never blocks

// One Session stream as a training process holds it: the first message
// names the session; orders are read on a thread of their own into a queue,
// so that a test can wait for one with a timeout and a stream never blocks
// the daemon's writer. The call has a deadline, so nothing hangs for ever.
class SessionStream {
 public:
  SessionStream(v1::MemoryManager::Stub& stub, const std::string& token) {
    context_.set_deadline(Deadline(absl::Seconds(300)));
    stream_ = stub.Session(&context_);
    reader_ = std::thread([this] {
      v1::Orders orders;
      while (stream_->Read(&orders)) {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(orders);
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu_);
      ended_ = true;
      cv_.notify_all();
    });
    v1::SessionMessage hello;
    hello.set_session_token(token);
    // A failed write shows later, as the stream's end and its status.
    (void)stream_->Write(hello);
  }
  SessionStream(const SessionStream&) = delete;
  SessionStream& operator=(const SessionStream&) = delete;
  ~SessionStream() {
    if (!finished_) {
      context_.TryCancel();
      reader_.join();
      (void)stream_->Finish();
    }
  }

  // Sends a batch (no token: the stream's first message named it).
  bool Send(const v1::EventBatch& batch) {
    v1::SessionMessage m;
    *m.mutable_batch() = batch;
    return stream_->Write(m);
  }
  bool SendMessage(const v1::SessionMessage& m) { return stream_->Write(m); }

  // The next orders that satisfy `match`, skipping others (budget changes
  // as sessions come and go); empty on timeout or when the stream ended.
  std::optional<v1::Orders> NextMatching(
      const std::function<bool(const v1::Orders&)>& match,
      absl::Duration timeout = kTimeout) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline =
        std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(timeout);
    for (;;) {
      while (!queue_.empty()) {
        v1::Orders o = std::move(queue_.front());
        queue_.pop_front();
        if (match(o)) return o;
      }
      if (ended_) return std::nullopt;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          queue_.empty()) {
        return std::nullopt;
      }
    }
  }

  // The text of the next refused batch; "<none>" when none came.
  std::string NextRejection(absl::Duration timeout = kTimeout) {
    auto o = NextMatching(
        [](const v1::Orders& x) { return !x.rejected_batch().empty(); },
        timeout);
    return o ? o->rejected_batch() : "<none>";
  }

  // Whether the daemon ended the stream within `timeout`.
  bool WaitEnded(absl::Duration timeout = kTimeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout),
                        [&] { return ended_; });
  }

  // Half-closes (WritesDone), waits for the daemon to end the stream, and
  // returns its status. DEADLINE_EXCEEDED-like statuses mean it hung.
  grpc::Status Finish() {
    stream_->WritesDone();
    return FinishWithoutWritesDone();
  }
  // The status of a stream the daemon ended by itself.
  grpc::Status FinishWithoutWritesDone() {
    if (!WaitEnded(absl::Seconds(60))) context_.TryCancel();
    reader_.join();
    finished_ = true;
    return stream_->Finish();
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::Orders>>
      stream_;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::Orders> queue_;
  bool ended_ = false;
  bool finished_ = false;
};

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_SESSION_STREAM_H_
