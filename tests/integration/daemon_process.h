#ifndef DELTAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define DELTAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/side_protocol.h"
#include "common/unix_socket.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/child_process.h"

// Fixtures for integration tests that run the real deltad binary and talk to
// it the way training processes do: gRPC on its Unix socket, and the side
// socket beside it for the peer token and host slabs.
//
//   auto daemon = DaemonProcess::Start({.flags = {"--sim_gpus=2"}});
//   ASSERT_TRUE(daemon.ok()) << daemon.status();  // message has its stderr
//   auto peer = Peer::Connect((*daemon)->side_socket_path());
//   auto stub = (*daemon)->NewStub();
//   ... OpenSession with peer->token() ...
//   ExitStatus e = (*daemon)->Stop();  // SIGTERM; EXPECT_TRUE(e.ok())
//
// The kernel binds a peer token, and through it every session, to the pid
// that connected to the side socket; a process may hold one session per GPU.
// A test that needs a second process (two sessions on one GPU, a process
// that dies) uses PeerProcess, a helper binary that holds a side
// connection of its own.
namespace deltad::testing_util {

struct DaemonOptions {
  // Appended after the defaults below, so they override them (absl flags:
  // the last one wins).
  std::vector<std::string> flags;
  // When non-empty: written to <dir>/deltad.conf (protobuf text format,
  // proto/deltad/v1/daemon_config.proto) and passed as --config.
  std::string config_text;
  // Empty: <dir>/deltad.sock in the daemon's fresh temp dir. Two daemons
  // given the same path test the "already serving" refusal.
  std::string socket_path;
  // Simulated node: --backend=sim --sim_gpus --sim_memory --host_pool
  // --host_slab, and --metrics=127.0.0.1:0 so that daemons never share a
  // port. Left empty, a value is not passed (the daemon's default applies).
  int sim_gpus = 2;
  std::string sim_memory = "8GiB";
  std::string host_pool = "1GiB";
  std::string host_slab = "64MiB";
  // Start() returns once the sockets accept connections and a NodeStatus
  // call succeeds, or fails after this long. Generous: under ASan on a
  // loaded 2-core machine start-up takes seconds.
  absl::Duration ready_timeout = absl::Seconds(60);
  // False: Start() returns right after exec (for a daemon expected to fail
  // at start-up; see Wait()).
  bool wait_ready = true;
  // "NAME=value" for the daemon's environment, beside the test's.
  std::vector<std::string> env;
};

// The deltad binary (DELTAD_BINARY, set by CMake) running as a child of the
// test, in a fresh temp dir that holds its socket, config and a log of its
// stdout and stderr. The destructor kills it (SIGKILL) and removes the
// dir. Not thread safe: one owner (stubs and channels it makes are thread
// safe as gRPC's are).
class DaemonProcess {
 public:
  // Starts the daemon. On a start-up failure (exit, or not ready in time)
  // the status says what happened and quotes the daemon's output.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(
      DaemonOptions options = {});

  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess();

  const std::string& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_path_; }
  std::string side_socket_path() const;
  // "unix:<socket_path>", for grpc::CreateChannel and tools.
  std::string target() const { return "unix:" + socket_path_; }
  pid_t pid() const { return process_->pid(); }

  // A new channel (its own connection) to the daemon. `max_send_bytes`:
  // the client's own limit (-1: none), so that tests can send what the
  // daemon must refuse.
  std::shared_ptr<grpc::Channel> NewChannel(int max_send_bytes = -1) const;
  std::unique_ptr<v1::MemoryManager::Stub> NewStub() const;

  // Whether the process is still alive.
  bool Running() { return process_->Running(); }
  // What the daemon wrote to stdout and stderr so far.
  std::string Output() const;

  // Sends SIGTERM without waiting (the daemon drains: see Stop()).
  void Terminate() { process_->Signal(SIGTERM); }
  // SIGTERM, then waits up to `timeout` for the exit; killed if it does not
  // come (timed_out set). The daemon waits up to --drain_seconds (default
  // 10) for sessions to end before it exits.
  ExitStatus Stop(absl::Duration timeout = absl::Seconds(60));
  // Waits for an exit the test caused or expects (e.g. a refused start);
  // killed after `timeout` (timed_out set).
  ExitStatus Wait(absl::Duration timeout = absl::Seconds(60));
  // SIGKILL, as if the daemon crashed. Idempotent.
  ExitStatus Kill() { return process_->Kill(); }

 private:
  DaemonProcess() = default;
  absl::Status WaitReady(absl::Duration timeout);

  std::string dir_;
  std::string socket_path_;
  std::string log_path_;
  std::unique_ptr<ChildProcess> process_;
};

// A connection to the side socket, as a training process holds it: the
// daemon sends the peer token on accept; OpenSession must present it; and
// closing the connection is the process dying, which reclaims its
// sessions. Move-only; not thread safe.
class Peer {
 public:
  // Connects and waits (up to `timeout`) for the kPeerToken message.
  static absl::StatusOr<Peer> Connect(
      const std::string& side_socket_path,
      absl::Duration timeout = absl::Seconds(30));

  const std::string& token() const { return token_; }
  int fd() const { return fd_.get(); }
  bool connected() const { return fd_.valid(); }

  // One message (common/unix_socket.h framing).
  absl::Status Send(uint64_t tag, absl::string_view payload = {},
                    absl::Span<const int> fds = {});
  // The next message, within `timeout` (DEADLINE_EXCEEDED) ; UNAVAILABLE
  // when the daemon closed the connection.
  absl::StatusOr<common::ReceivedFds> Receive(
      absl::Duration timeout = absl::Seconds(30), int max_fds = 1);
  // Whether the daemon closed the connection, waiting up to `timeout` for
  // it; messages that arrive meanwhile are discarded.
  bool WaitClosedByDaemon(absl::Duration timeout = absl::Seconds(30));

  // What the daemon granted over the side socket: a host slab or a device
  // chunk, its id, size and descriptor.
  using Grant = common::side::Grant;
  // kSlabsWanted for a session: the slabs in the order sent. A kError
  // answer is FAILED_PRECONDITION with the daemon's text (the side
  // protocol carries text, not codes); see common::side::ReceiveGrants.
  absl::StatusOr<std::vector<Grant>> FetchSlabs(
      const std::string& session_token,
      absl::Duration timeout = absl::Seconds(30));
  // kChunksWanted: the new chunks until the session holds target_bytes;
  // errors as FetchSlabs.
  absl::StatusOr<std::vector<Grant>> FetchChunks(
      const std::string& session_token, int64_t target_bytes,
      absl::Duration timeout = absl::Seconds(30));
  // kChunksReturned; OK when the daemon took them back (kChunksDone).
  absl::Status ReturnChunks(const std::string& session_token,
                            const std::vector<uint64_t>& chunk_ids,
                            absl::Duration timeout = absl::Seconds(30));

  // Closes the connection: the daemon reclaims this peer's sessions.
  void Close() { fd_.reset(); }

 private:
  Peer(common::UniqueFd fd, std::string token)
      : fd_(std::move(fd)), token_(std::move(token)) {}
  // ReceiveGrants, each read bounded by `timeout`.
  absl::StatusOr<std::vector<Grant>> ReceiveGrants(common::side::Tag item,
                                                   common::side::Tag done,
                                                   absl::Duration timeout);

  common::UniqueFd fd_;
  std::string token_;
};

// Another process holding a side connection: the helper binary
// DELTAD_SIDE_PEER_BINARY connects, prints its peer token, and keeps the
// connection until its stdin closes or it is killed. Sessions opened with
// token() belong to that process (its pid), and their session tokens work
// from any process, as they would for a client that passed them on.
class PeerProcess {
 public:
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Start(
      const std::string& side_socket_path,
      absl::Duration timeout = absl::Seconds(30));

  const std::string& token() const { return token_; }
  pid_t pid() const { return process_->pid(); }
  // Closes its stdin: it closes the connection and exits 0.
  ExitStatus Exit(absl::Duration timeout = absl::Seconds(30));
  // SIGKILL: the connection closes as the kernel cleans up.
  ExitStatus Kill() { return process_->Kill(); }

 private:
  PeerProcess() = default;
  std::unique_ptr<ChildProcess> process_;
  std::string token_;
};

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
