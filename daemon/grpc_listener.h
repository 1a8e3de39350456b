#ifndef DELTAD_DAEMON_GRPC_LISTENER_H_
#define DELTAD_DAEMON_GRPC_LISTENER_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/log_limit.h"
#include "common/unix_socket.h"
#include "daemon/http2_gate.h"
#include "daemon/http2_refusal.h"
#include "grpcpp/grpcpp.h"

namespace deltad::daemon {

// The gRPC Unix socket (and the optional TCP port), accepted by the daemon
// and handed to gRPC one connection at a time
// (grpc::AddInsecureChannelFromFd), for two things gRPC does not do on its
// own:
// - connections are counted per user (SO_PEERCRED) and in all before gRPC
//   sees them: one past a limit has each gRPC call it starts answered with
//   RESOURCE_EXHAUSTED naming the limit, then an HTTP/2 GOAWAY naming it
//   too, and is closed once its client has read them (it closes, or
//   `linger` passes: closed at once, the client's first write would fail
//   with a broken pipe before it reads why);
// - a connection whose client has left the daemon's bytes unread for
//   `unread_for` (the socket's send queue not empty and not moving) is shut
//   down. gRPC closes a connection only once its writes are done, and its
//   keepalive starts no ping while one waits, so such a connection (a PING
//   flood that never reads, a client stopped in the middle of a reply)
//   would otherwise hold its memory until the client closes it;
// - a connection goes to gRPC only once its client has acknowledged the
//   daemon's SETTINGS, with at most `max_calls_before_ack` calls opened
//   before (Http2Gate): from there on gRPC holds it to
//   max_concurrent_streams, which it would not otherwise do. One that opens
//   more first, or does not acknowledge within `ack_within`, is refused as
//   above.
// gRPC owns each connection's descriptor once handed over: the listener
// never closes one, and learns that gRPC did when the number no longer
// names that socket (its inode). Thread safe.
class GrpcListener {
 public:
  struct Options {
    std::string path;
    mode_t mode = 0660;
    // Also accepted the same way: gRPC on TCP ("host:port"; empty: none).
    // A TCP client's user is its socket's owner when it runs on this
    // machine (LocalTcpPeerUid); clients elsewhere count as one user.
    std::string tcp_address;
    size_t max_connections = 4096;
    size_t max_connections_per_uid = 256;
    absl::Duration unread_for = absl::Seconds(60);
    absl::Duration sweep_every = absl::Seconds(1);
    // How long a refused connection stays open for its client to read the
    // GOAWAY, and how many may at once (past it the oldest is closed: a
    // flood of connections holds no more than this many descriptors).
    absl::Duration linger = absl::Seconds(1);
    // When the GOAWAY goes to a refused connection that started no call: a
    // gRPC client starts its call as soon as it reads the daemon's
    // SETTINGS, and gets the refusal as its answer (Http2Refusal).
    absl::Duration goaway_after = absl::Milliseconds(100);
    size_t max_lingering = 64;
    // Called with the limit's name for each connection refused or shut
    // down: "max_grpc_connections", "max_grpc_connections_per_uid",
    // "unread_connection", "max_concurrent_streams", "settings_ack_ms".
    std::function<void(const char* limit)> refused;
    // Http2Gate: calls a client may open before it acknowledges the
    // daemon's SETTINGS (limits.max_concurrent_streams), and how long it
    // has to acknowledge them.
    size_t max_calls_before_ack = 256;
    absl::Duration ack_within = absl::Seconds(10);
  };

  // Listens at `options.path` (see common::ListenUnix) and hands what it
  // accepts to `server`, which must be started and outlive the listener.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Start(
      grpc::Server* server, Options options);

  GrpcListener(const GrpcListener&) = delete;
  GrpcListener& operator=(const GrpcListener&) = delete;
  ~GrpcListener();  // Stop()

  // The TCP port listened on (tcp_address's, or the one chosen for port
  // 0); 0 without TCP.
  int tcp_port() const { return tcp_port_; }

  // Stops accepting and sweeping and removes the socket file; the
  // connections already handed over stay gRPC's. Idempotent.
  void Stop();

 private:
  struct Connection {
    int fd;                   // gRPC's (or at the gate); never closed here
    ino_t inode;              // the socket's, to tell when the number is reused
    int64_t uid;              // -1 when SO_PEERCRED failed
    int unread = 0;           // bytes queued to the client, last sweep
    absl::Time unread_since;  // when they stopped moving
    bool shut = false;        // shut down for unread bytes
  };

  GrpcListener(grpc::Server* server, Options options, common::UniqueFd listener,
               common::UniqueFd wake);
  void Loop();
  void Accept(int listening, bool tcp);
  void Sweep(absl::Time now);
  // The refusal (Http2Refusal) begins; the descriptor lingers.
  void Refuse(common::UniqueFd fd, const char* limit, const std::string& why);
  // Reads what lingering clients sent and closes those that closed, failed
  // or lingered past `linger`.
  void DrainLingering(absl::Time now);
  // Looks at what the connections at the gate sent since the last look:
  // hands those that acknowledged the daemon's SETTINGS to gRPC, refuses
  // those the gate refuses or that are past `ack_within`.
  void ServeGate(absl::Time now);
  // Forgets a connection that never reached gRPC.
  void Forget(int fd);

  grpc::Server* server_;
  const Options options_;
  common::UniqueFd listener_;
  std::vector<common::UniqueFd> tcp_;  // tcp_address's listening sockets
  int tcp_port_ = 0;
  common::UniqueFd wake_;  // an eventfd: Stop() ends the loop's poll
  std::thread thread_;
  struct Lingering {
    common::UniqueFd fd;
    absl::Time until;      // closed then
    absl::Time goaway_at;  // the GOAWAY then, if no call came
    Http2Refusal refusal;
    bool goaway_sent = false;
  };
  std::vector<Lingering> lingering_;  // the loop's thread only
  struct AtGate {
    common::UniqueFd fd;
    absl::Time until;  // refused then, not acknowledged
    Http2Gate gate;
    int seen = 0;  // bytes looked at
    // Not looked at again before then: each look copies all the client
    // sent so far, and a client that sends a byte at a time must not make
    // the listener copy its bytes over and over.
    absl::Time next_look = absl::InfinitePast();
  };
  std::vector<AtGate> gate_;  // the loop's thread only
  std::string peeked_;        // the loop's buffer for them
  // A client can provoke these lines as often as it likes.
  common::LogLimit refused_log_{1, std::chrono::seconds(10)};
  common::LogLimit unread_log_{1, std::chrono::seconds(10)};
  std::mutex mu_;
  std::vector<Connection> connections_;
  bool stopping_ = false;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_GRPC_LISTENER_H_
