#include "common/unix_socket.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace deltad::common {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  // close() is not retried on EINTR: on Linux the descriptor is gone either
  // way, and retrying could close one another thread just opened.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::StatusOr<PeerCred> PeerCredentials(int fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("getsockopt(SO_PEERCRED) on fd ", fd));
  }
  if (len != sizeof(cred)) {
    return absl::InternalError(absl::StrCat("getsockopt(SO_PEERCRED) on fd ",
                                            fd, " returned ", len,
                                            " bytes, expected ", sizeof(cred)));
  }
  PeerCred out;
  out.pid = cred.pid;
  out.uid = cred.uid;
  out.gid = cred.gid;
  return out;
}

absl::Status SendFds(int socket, uint64_t tag, absl::Span<const int> fds,
                     absl::string_view payload) {
  if (fds.size() > static_cast<size_t>(kMaxFdsPerMessage)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot send ", fds.size(), " descriptors in one message",
                     ", the most is ", kMaxFdsPerMessage));
  }
  for (int fd : fds) {
    if (fd < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot send invalid descriptor ", fd));
    }
  }
  if (payload.size() > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot send a payload of ", payload.size(),
                     " bytes, the most is ", kMaxPayloadBytes));
  }
  // Header and payload go as one buffer, so a short write is finished by
  // the same loop.
  const std::string wire = EncodeMessage(tag, payload);
  ssize_t sent = SendWithFds(socket, wire, fds);
  if (sent < 0) {
    return absl::ErrnoToStatus(
        errno,
        absl::StrCat("sendmsg of ", fds.size(), " descriptors on fd ", socket));
  }
  // A short write (possible on a stream socket) leaves only bytes.
  size_t done = static_cast<size_t>(sent);
  while (done < wire.size()) {
    sent = SendWithFds(socket, absl::string_view(wire).substr(done), {});
    if (sent < 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("send of a message on fd ", socket));
    }
    done += static_cast<size_t>(sent);
  }
  return absl::OkStatus();
}

std::string EncodeMessage(uint64_t tag, absl::string_view payload) {
  std::string wire(kHeaderBytes + payload.size(), '\0');
  const uint32_t length = static_cast<uint32_t>(payload.size());
  std::memcpy(wire.data(), &tag, sizeof(tag));
  std::memcpy(wire.data() + sizeof(tag), &length, sizeof(length));
  // memcpy from an empty view's null data() is undefined, even for 0 bytes.
  if (!payload.empty()) {
    std::memcpy(wire.data() + kHeaderBytes, payload.data(), payload.size());
  }
  return wire;
}

ssize_t SendWithFds(int socket, absl::string_view bytes,
                    absl::Span<const int> fds, int flags) {
  struct iovec iov;
  iov.iov_base = const_cast<char*>(bytes.data());
  iov.iov_len = bytes.size();
  // Aligned storage for the largest control message we may send.
  alignas(
      struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    if (fds.size() > static_cast<size_t>(kMaxFdsPerMessage)) {
      errno = EINVAL;
      return -1;
    }
    const size_t data_len = sizeof(int) * fds.size();
    std::memset(control, 0, CMSG_SPACE(data_len));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(data_len);
    struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(data_len);
    std::memcpy(CMSG_DATA(cmsg), fds.data(), data_len);
  }
  // MSG_NOSIGNAL: a peer that went away must be an error, not a SIGPIPE
  // that kills the sender.
  ssize_t sent;
  do {
    sent = ::sendmsg(socket, &msg, flags | MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  return sent;
}

namespace {

// Every SCM_RIGHTS descriptor in a received message, in order.
std::vector<int> FdsIn(struct msghdr* msg) {
  std::vector<int> fds;
  for (struct cmsghdr* cmsg = CMSG_FIRSTHDR(msg); cmsg != nullptr;
       cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) {
      continue;
    }
    const size_t n = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  return fds;
}

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
}

// Reads into buffer[done..size), the rest of a message `part` that a
// stream socket may deliver in pieces.
absl::Status RecvRest(int socket, char* buffer, size_t done, size_t size,
                      absl::string_view part) {
  while (done < size) {
    ssize_t n = ::recv(socket, buffer + done, size - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {
      return absl::UnavailableError(
          absl::StrCat("peer closed the socket on fd ", socket, " after ", done,
                       " of ", size, " ", part, " bytes"));
    }
    if (n < 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("recv of a message ", part, " on fd ", socket));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ReceivedFds> RecvFds(int socket, int max_fds,
                                    size_t max_payload) {
  if (max_fds < 0 || max_fds > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_fds ", max_fds, " is outside 0..", kMaxFdsPerMessage));
  }
  char payload[kHeaderBytes];
  struct iovec iov;
  iov.iov_base = payload;
  iov.iov_len = sizeof(payload);
  // CMSG_SPACE(0) still leaves room for a header, so that even with
  // max_fds == 0 an unexpected descriptor shows up as MSG_CTRUNC.
  alignas(
      struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * max_fds);

  ssize_t got;
  do {
    got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("recvmsg on fd ", socket));
  }
  // Take ownership of whatever arrived before looking at anything else, so
  // every error below closes it.
  ReceivedFds out;
  out.fds = FdsIn(&msg);
  // CMSG_SPACE rounds the buffer up, so one descriptor more than asked can
  // arrive without MSG_CTRUNC: refuse it the same way.
  if ((msg.msg_flags & MSG_CTRUNC) ||
      out.fds.size() > static_cast<size_t>(max_fds)) {
    CloseAll(out.fds);
    return absl::ResourceExhaustedError(
        absl::StrCat("descriptors received on fd ", socket,
                     " were truncated: the peer sent more than ", max_fds,
                     ", or this process is out of descriptors; the ",
                     out.fds.size(), " that arrived were closed"));
  }
  if (got == 0) {
    CloseAll(out.fds);
    return absl::UnavailableError(
        absl::StrCat("peer closed the socket on fd ", socket));
  }
  if (absl::Status s = RecvRest(socket, payload, static_cast<size_t>(got),
                                sizeof(payload), "header");
      !s.ok()) {
    CloseAll(out.fds);
    return s;
  }
  std::memcpy(&out.tag, payload, sizeof(out.tag));
  uint32_t length;
  std::memcpy(&length, payload + sizeof(out.tag), sizeof(length));
  if (length > std::min(max_payload, kMaxPayloadBytes)) {
    CloseAll(out.fds);
    return absl::ResourceExhaustedError(
        absl::StrCat("message on fd ", socket, " announces a payload of ",
                     length, " bytes, the most accepted is ",
                     std::min(max_payload, kMaxPayloadBytes)));
  }
  out.payload.resize(length);
  if (absl::Status s =
          RecvRest(socket, out.payload.data(), 0, length, "payload");
      !s.ok()) {
    CloseAll(out.fds);
    return s;
  }
  return out;
}

namespace {

absl::StatusOr<struct sockaddr_un> UnixAddress(absl::string_view path) {
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.empty()) {
    return absl::InvalidArgumentError("Unix socket path is empty");
  }
  if (path.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Unix socket path \"", absl::CEscape(path), "\" contains a NUL byte"));
  }
  // sun_path must keep a terminating NUL for the path-based calls below.
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unix socket path \"", path, "\" is ", path.size(),
                     " bytes, the most is ", sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

std::string DirectoryOf(absl::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::StatusOr<UniqueFd> NewStreamSocket() {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::ErrnoToStatus(errno, "socket(AF_UNIX, SOCK_STREAM)");
  }
  return fd;
}

// Connects `fd` to `addr`, retrying on EINTR. Returns errno, 0 on success.
int ConnectErrno(int fd, const struct sockaddr_un& addr) {
  bool interrupted = false;
  while (::connect(fd, reinterpret_cast<const struct sockaddr*>(&addr),
                   sizeof(addr)) != 0) {
    // An interrupted connect may complete anyway; the retry then says so.
    if (interrupted && errno == EISCONN) return 0;
    if (errno != EINTR) return errno;
    interrupted = true;
  }
  return 0;
}

// File modes read best in octal, as chmod(1) takes them.
std::string Octal(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0%o", static_cast<unsigned>(mode));
  return buf;
}

// Removes a socket file nobody listens on (left by a daemon that died), and
// refuses to touch anything else at `path`.
absl::Status RemoveStaleSocket(absl::string_view path,
                               const struct sockaddr_un& addr) {
  struct stat st;
  if (::lstat(addr.sun_path, &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::ErrnoToStatus(errno, absl::StrCat("lstat of ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; not replacing it"));
  }
  absl::StatusOr<UniqueFd> probe = NewStreamSocket();
  if (!probe.ok()) return probe.status();
  const int err = ConnectErrno(probe->get(), addr);
  if (err == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another process is listening on ", path, "; not replacing it"));
  }
  // Only ECONNREFUSED proves nobody listens. Anything else (EACCES, ...)
  // leaves it undecided, and a live daemon's socket must never be removed.
  if (err != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot tell whether a process listens on ", path, " (",
                     std::strerror(err), "); not replacing it"));
  }
  if (::unlink(addr.sun_path) != 0 && errno != ENOENT) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("removing stale socket file ", path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RemoveStaleSocket(absl::string_view path) {
  absl::StatusOr<struct sockaddr_un> addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  return RemoveStaleSocket(path, *addr);
}

absl::StatusOr<UniqueFd> ListenUnix(absl::string_view path, mode_t mode) {
  if ((mode & ~static_cast<mode_t>(07777)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket file mode ", Octal(mode), " has bits outside 07777"));
  }
  absl::StatusOr<struct sockaddr_un> addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();

  const std::string dir = DirectoryOf(path);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat(
          "directory ", dir, " of socket path ", path, " does not exist"));
    }
    return absl::ErrnoToStatus(
        errno, absl::StrCat("stat of directory ", dir, " of socket ", path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " (directory of socket path ", path, ") is not a directory"));
  }
  if (absl::Status s = RemoveStaleSocket(path, *addr); !s.ok()) return s;

  // The socket is bound under a private name, given its mode, made to
  // listen, and only then linked under `path`: a client that sees the file
  // can connect at once (a file bound in place refuses connections until
  // listen(), and clients wait for the file). link() does not replace a
  // file, so of two daemons started together on one path, one fails.
  const std::string private_path = absl::StrCat(path, ".", ::getpid(), ".new");
  absl::StatusOr<struct sockaddr_un> private_addr = UnixAddress(private_path);
  const bool in_place = !private_addr.ok();  // too long: bind `path` itself
  const struct sockaddr_un& bound = in_place ? *addr : *private_addr;
  if (!in_place) ::unlink(bound.sun_path);  // ours, left by a crash

  absl::StatusOr<UniqueFd> fd = NewStreamSocket();
  if (!fd.ok()) return fd.status();
  if (::bind(fd->get(), reinterpret_cast<const struct sockaddr*>(&bound),
             sizeof(bound)) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("bind to ", path));
  }
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::unlink(bound.sun_path);
    return absl::ErrnoToStatus(err, what);
  };
  // chmod before listen(): until listen() every connect() is refused, so no
  // client can slip in while the file still has the umask's mode.
  if (::chmod(bound.sun_path, mode) != 0) {
    return fail(absl::StrCat("chmod ", Octal(mode), " of socket ", path));
  }
  if (::listen(fd->get(), SOMAXCONN) != 0) {
    return fail(absl::StrCat("listen on ", path));
  }
  if (!in_place) {
    if (::link(bound.sun_path, addr->sun_path) != 0) {
      if (errno == EEXIST) {
        ::unlink(bound.sun_path);
        return absl::AlreadyExistsError(
            absl::StrCat("another process created socket ", path,
                         " while this one started"));
      }
      return fail(absl::StrCat("link of socket ", path));
    }
    ::unlink(bound.sun_path);
  }
  return fd;
}

absl::StatusOr<UniqueFd> ConnectUnix(absl::string_view path) {
  absl::StatusOr<struct sockaddr_un> addr = UnixAddress(path);
  if (!addr.ok()) return addr.status();
  absl::StatusOr<UniqueFd> fd = NewStreamSocket();
  if (!fd.ok()) return fd.status();
  const int err = ConnectErrno(fd->get(), *addr);
  if (err == ENOENT || err == ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(
        "nothing listens on ", path,
        err == ENOENT ? " (no such file)" : " (connection refused)"));
  }
  if (err != 0) {
    return absl::ErrnoToStatus(err, absl::StrCat("connect to ", path));
  }
  return fd;
}

}  // namespace deltad::common
