#ifndef DELTAD_DAEMON_SIDE_CHANNEL_H_
#define DELTAD_DAEMON_SIDE_CHANNEL_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
// One thread serves the listener and every connection. Connections are one
// per training process and idle nearly all its life, and each request is
// answered at once from the Node, so a thread each bought nothing but a
// stack and a malloc arena per process. That thread never waits on one
// connection: it reads only what has arrived, and an answer the socket will
// not take yet waits in memory until the process reads it. Does not own the
// Node, which must outlive it. Thread safe.
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
  // and waits for the thread. Idempotent.
  void Stop();

 private:
  // One message of common::SendFds' framing on its way out.
  struct Outgoing {
    std::string wire;     // header and payload
    common::UniqueFd fd;  // rides with the first byte; may be empty
    size_t sent = 0;      // bytes the socket has taken
  };
  struct Connection {
    common::UniqueFd fd;  // non-blocking
    pid_t pid = 0;
    int64_t uid = -1;        // from SO_PEERCRED
    std::string peer_token;  // secret
    std::string request;     // the part of the next request read so far
    std::deque<Outgoing> out;
    bool close_when_sent = false;
  };
  // By descriptor, which poll() reports.
  using Connections = std::map<int, Connection>;

  SideChannel(std::string path, Node& node, DeliverFn deliver,
              size_t max_connections, size_t max_per_uid, RefusedFn refused,
              common::UniqueFd listener, common::UniqueFd wake)
      : path_(std::move(path)),
        node_(node),
        deliver_(std::move(deliver)),
        max_connections_(max_connections),
        max_per_uid_(max_per_uid),
        refused_(std::move(refused)),
        listener_(std::move(listener)),
        wake_(std::move(wake)) {}
  void Loop();
  // False when out of descriptors or memory: the listener rests a moment.
  bool AcceptAll();
  void Admit(common::UniqueFd fd);
  // Closes `fd` with an error message; counts the refusal.
  void Refuse(int fd, const char* limit, const std::string& why);
  // What poll() reported for `it`: reads, answers, or sends what waits.
  void Serve(Connections::iterator it);
  // False when the connection should close.
  bool ReadRequest(Connection& c);
  bool Flush(Connection& c);
  // Queues the answer to one request; false when the connection should
  // close once it is sent.
  bool Answer(Connection& c, uint64_t tag, absl::string_view payload);
  static void Queue(Connection& c, uint64_t tag, absl::string_view payload = {},
                    common::UniqueFd fd = {});
  // The process is gone (or broke the protocol): its sessions go with it.
  void Close(Connections::iterator it);
  // Closes `pid`'s connections that the process has closed but this loop
  // has not seen yet. A process that gives up a session and opens another
  // closes the old connection first; without this its new session could
  // race the old one's reclaim and be refused as a second one on its GPU.
  void ReapClosedConnectionsOf(pid_t pid);

  const std::string path_;
  Node& node_;
  const DeliverFn deliver_;
  const size_t max_connections_;
  const size_t max_per_uid_;
  const RefusedFn refused_;
  const common::UniqueFd listener_;  // non-blocking
  const common::UniqueFd wake_;      // eventfd: Stop() wakes the loop
  std::thread loop_;
  std::atomic<bool> stopping_{false};
  Connections connections_;  // the loop's alone
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_SIDE_CHANNEL_H_
