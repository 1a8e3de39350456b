#ifndef DELTAD_DAEMON_SIDE_CHANNEL_H_
#define DELTAD_DAEMON_SIDE_CHANNEL_H_

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/unix_socket.h"
#include "daemon/node.h"

namespace deltad::daemon {

// Serves the side socket (common/side_protocol.h): each connecting process
// gets a peer token bound to its kernel credentials (SO_PEERCRED), fetches
// its sessions' host slabs as descriptors, and keeps the connection open for
// as long as it lives. When the connection closes (exit, crash, kill -9) the
// Node reclaims every session of that process at once, and the budget
// changes this causes for the others go to `deliver`.
//
// One thread accepts, one thread serves each connection: connections are
// few (one per training process) and mostly idle. Does not own the Node,
// which must outlive it. Thread safe.
class SideChannel {
 public:
  using DeliverFn = std::function<void(const OrdersBySession&)>;

  // Called once for each connection refused at a limit, with the limit's
  // name ("max_side_connections", "max_side_connections_per_uid").
  using RefusedFn = std::function<void(const char* limit)>;

  // Listens at `path` with file mode `mode` (see common::ListenUnix) and
  // starts accepting. At most `max_connections` at a time, and
  // `max_per_uid` of one user; more are closed at once, with an error
  // message naming the limit.
  static absl::StatusOr<std::unique_ptr<SideChannel>> Start(
      const std::string& path, mode_t mode, Node& node, DeliverFn deliver,
      size_t max_connections = 4096, size_t max_per_uid = 256,
      RefusedFn refused = nullptr);

  SideChannel(const SideChannel&) = delete;
  SideChannel& operator=(const SideChannel&) = delete;
  ~SideChannel();  // Stop()

  // Stops accepting, closes every connection (reclaiming their sessions)
  // and waits for the threads. Idempotent.
  void Stop();

 private:
  struct Connection {
    common::UniqueFd fd;
    std::thread thread;
    bool done = false;
    pid_t pid = 0;           // once it has a peer token
    int64_t uid = -1;        // from SO_PEERCRED at accept; -1 unknown
    std::string peer_token;  // secret; empty until sent
  };

  SideChannel(std::string path, Node& node, DeliverFn deliver,
              size_t max_connections, size_t max_per_uid, RefusedFn refused,
              common::UniqueFd listener)
      : path_(std::move(path)),
        node_(node),
        deliver_(std::move(deliver)),
        max_connections_(max_connections),
        max_per_uid_(max_per_uid),
        refused_(std::move(refused)),
        listener_(std::move(listener)) {}
  // Closes `fd` with an error message; counts the refusal.
  void Refuse(int fd, const char* limit, const std::string& why);
  void AcceptLoop();
  void Serve(uint64_t id, int fd);
  // Answers one request; false when the connection should close.
  bool Answer(int fd, const std::string& peer_token,
              const common::ReceivedFds& message);
  void JoinFinished();  // mu_ not held
  // Reclaims the sessions of `pid`'s connections that the process has
  // closed but whose threads have not seen it yet (mu_ not held). A process
  // that gives up a session and opens another closes the old connection
  // first; without this its new session could race the old one's reclaim
  // and be refused as a second one on its GPU.
  void ReapClosedConnectionsOf(pid_t pid);

  const std::string path_;
  Node& node_;
  const DeliverFn deliver_;
  const size_t max_connections_;
  const size_t max_per_uid_;
  const RefusedFn refused_;
  common::UniqueFd listener_;
  std::thread acceptor_;

  mutable std::mutex mu_;
  bool stopping_ = false;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SIDE_CHANNEL_H_
