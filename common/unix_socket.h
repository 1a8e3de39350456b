#ifndef DELTAD_COMMON_UNIX_SOCKET_H_
#define DELTAD_COMMON_UNIX_SOCKET_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

// Small helpers around Unix-domain sockets: owning file descriptors, peer
// credentials, passing descriptors (SCM_RIGHTS), listening and connecting.
// Linux only.

namespace deltad::common {

// Owns one file descriptor and closes it on destruction, so that no error
// path leaks one. -1 means empty.
//
// Move-only. Not thread safe: one owner at a time, like the descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd` (may be -1).
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing; the caller must close the result.
  int release();
  // Closes the descriptor held, if any, and takes ownership of `fd`.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Who is at the other end of a connected Unix socket, as the kernel recorded
// it when the connection was made (connect() or socketpair()): it cannot be
// forged by the peer, which is why sessions are bound to it.
struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// SO_PEERCRED of a connected Unix socket.
absl::StatusOr<PeerCred> PeerCredentials(int fd);

// The most descriptors one message may carry (the kernel's SCM_MAX_FD).
inline constexpr int kMaxFdsPerMessage = 253;

// The largest payload one message may carry. Messages on the side socket
// are small (tokens, slab tables); the bound keeps a peer from making the
// other end allocate without limit.
inline constexpr size_t kMaxPayloadBytes = size_t{64} << 10;
// Bytes before the payload: the tag and the payload's length.
inline constexpr size_t kHeaderBytes = sizeof(uint64_t) + sizeof(uint32_t);

// One message of SendFds: an application tag, its payload and the
// descriptors it carried.
struct ReceivedFds {
  uint64_t tag = 0;
  std::string payload;
  // New descriptors, owned by the caller, each with FD_CLOEXEC set.
  std::vector<int> fds;
};

// One message of SendFds as it goes on the wire, descriptors aside: the
// header (`tag`, the payload's length) and `payload`. The caller keeps
// `payload` within kMaxPayloadBytes.
std::string EncodeMessage(uint64_t tag, absl::string_view payload);

// One sendmsg(2) of `bytes` with `fds` attached (SCM_RIGHTS; none when
// empty), retried on EINTR, MSG_NOSIGNAL added to `flags`: the bytes sent,
// or -1 with errno set. The descriptors go with the first byte sent, so a
// caller finishing a short write passes none. For a socket that must not
// block (MSG_DONTWAIT), where SendFds would wait.
ssize_t SendWithFds(int socket, absl::string_view bytes,
                    absl::Span<const int> fds, int flags = 0);

// Sends one message over a connected Unix socket: `tag` and the length of
// `payload` (host byte order: both ends are on one machine), then
// `payload` (at most kMaxPayloadBytes), with `fds` attached (SCM_RIGHTS).
// The descriptors stay owned by the caller; the receiver gets duplicates.
// At most kMaxFdsPerMessage. A closed peer is an error, never SIGPIPE.
absl::Status SendFds(int socket, uint64_t tag, absl::Span<const int> fds,
                     absl::string_view payload = {});

// Receives one message of SendFds, accepting at most `max_fds` descriptors
// (0..kMaxFdsPerMessage) and `max_payload` payload bytes. More than
// `max_fds` sent is an error (RESOURCE_EXHAUSTED), and the ones that did
// arrive are closed so that a peer cannot fill the descriptor table; so is
// a longer payload. UNAVAILABLE when the peer closed.
absl::StatusOr<ReceivedFds> RecvFds(int socket, int max_fds,
                                    size_t max_payload = kMaxPayloadBytes);

// A listening SOCK_STREAM socket at `path` whose file has mode `mode` (for
// example 0660: connecting needs write permission on the file). A stale
// socket file (nobody listening) is removed first; a live one, or a path
// that is not a socket, is an error rather than being taken over. NOT_FOUND
// when the directory is missing.
absl::StatusOr<UniqueFd> ListenUnix(absl::string_view path, mode_t mode);

// Removes a socket file at `path` that nobody listens on (left by a process
// that died); nothing at `path` is fine too. FAILED_PRECONDITION, touching
// nothing, for a file that is not a socket, a socket a process listens on,
// or one where that cannot be told. For servers that bind the path
// themselves (gRPC); ListenUnix does this already.
absl::Status RemoveStaleSocket(absl::string_view path);

// A SOCK_STREAM socket connected to `path`. UNAVAILABLE when nothing listens
// there (no file, or a stale one).
absl::StatusOr<UniqueFd> ConnectUnix(absl::string_view path);

}  // namespace deltad::common

#endif  // DELTAD_COMMON_UNIX_SOCKET_H_
