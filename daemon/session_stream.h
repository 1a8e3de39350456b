#ifndef DELTAD_DAEMON_SESSION_STREAM_H_
#define DELTAD_DAEMON_SESSION_STREAM_H_

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "daemon/session_id.h"
#include "deltad/v1/memory_manager.pb.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_callback.h"

namespace deltad::daemon {

class MemoryManagerService;

// One session's Session stream: its batches in, its orders out, and its end
// the session's end. Served by gRPC's callback threads, not threads of its
// own: a training process holds its stream for as long as it runs and
// sends a batch now and then, and a thread to read and one to write each
// stream sat idle for hours, each with its stack and its share of malloc
// arenas (the soak's RSS climbed with the sessions).
//
// Reads: the first message names the session (its token); each message is
// worked on as it arrives, and the next read starts after it, so a
// session's batches apply in order. One that does not parse ends the
// stream with INVALID_ARGUMENT. Writes: one at a time, taken from the
// session's mailbox, which wakes the stream when orders are posted.
// The end: once reads end (the process closed the stream, went away, or
// was cancelled), what is queued gets kWriterGrace to go out; a process
// that does not read is then cancelled. The session is reclaimed, and the
// call finishes; gRPC then deletes the stream (OnDone).
class SessionStream final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, v1::Orders> {
 public:
  SessionStream(MemoryManagerService& service,
                grpc::CallbackServerContext* context);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // The mailbox's listener: outlives the stream (the mailbox and the grace
  // timer hold it), and forgets the stream once it finishes.
  class Writer;

  // The first message: the session, its mailbox and its lease.
  absl::Status Start(const v1::SessionMessage& message);
  // One message of an open session; false when the stream must end (the
  // session was closed meanwhile), with `end_` set.
  bool Work(const v1::SessionMessage& message);
  // Reads are over: the writer drains, then the stream ends.
  void EndReads(absl::Status end);
  // Takes the next orders and starts their write (writer's lock held).
  // True when the stream is done and must end now: the caller then calls
  // End outside the lock.
  bool PumpLocked();
  // Reclaims the session and finishes the call.
  void End();

  MemoryManagerService& service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer raw_;  // the read in flight
  std::string token_;
  SessionId id_ = 0;
  bool opened_ = false;     // Start succeeded
  bool cancelled_ = false;  // when reads ended: cut off, not closed
  absl::Status end_;        // what the call ends with
  std::shared_ptr<Writer> writer_;
  grpc::Alarm grace_;

  // Guarded by the writer's lock.
  v1::Orders out_;  // the write in flight
  bool writing_ = false;
  bool write_failed_ = false;
  bool reads_ended_ = false;
  bool box_closed_ = false;
  bool cancelling_ = false;  // the grace ran out: TryCancel under way
  bool stuck_ = false;       // the grace ran out with orders unread
  bool ending_ = false;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SESSION_STREAM_H_
