#ifndef DELTAD_DAEMON_TCP_SOCKET_H_
#define DELTAD_DAEMON_TCP_SOCKET_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unix_socket.h"

namespace deltad::daemon {

// The daemon's optional gRPC TCP port (tcp_address), accepted by the daemon
// itself (GrpcListener) as the Unix socket is.

struct TcpListeners {
  std::vector<common::UniqueFd> fds;  // one per address the host names
  int port = 0;                       // the one bound (port 0: chosen)
};

// Listens (non-blocking) on every address `host_port` names: "host:port",
// "[v6 address]:port", "*:port" or ":port" for all addresses; port 0 picks
// one port for them all.
absl::StatusOr<TcpListeners> ListenTcp(absl::string_view host_port);

// The user whose process holds the other end of the accepted TCP connection
// `fd`, when that process is on this machine: the kernel lists both ends in
// `proc_net`/tcp or tcp6 with their owners. NotFound for a peer elsewhere.
absl::StatusOr<uid_t> LocalTcpPeerUid(
    int fd, const std::string& proc_net = "/proc/net");

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_TCP_SOCKET_H_
