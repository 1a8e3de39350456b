#include "daemon/grpc_listener.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_posix.h"

namespace deltad::daemon {

namespace {

// HTTP/2 (RFC 9113): what a refused connection is sent, so that its client
// reads why rather than a bare reset.
constexpr uint8_t kSettingsFrame = 0x4;
constexpr uint8_t kGoawayFrame = 0x7;
constexpr uint32_t kEnhanceYourCalm = 0xb;

void PutBigEndian32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

// A frame on stream 0 with no flags.
std::string Frame(uint8_t type, const std::string& payload) {
  std::string frame;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  frame.push_back(static_cast<char>((n >> 16) & 0xff));
  frame.push_back(static_cast<char>((n >> 8) & 0xff));
  frame.push_back(static_cast<char>(n & 0xff));
  frame.push_back(static_cast<char>(type));
  frame.push_back(0);        // flags
  PutBigEndian32(frame, 0);  // stream 0
  return frame + payload;
}

std::string Goaway(const std::string& why) {
  std::string payload;
  PutBigEndian32(payload, 0);  // no stream was processed
  PutBigEndian32(payload, kEnhanceYourCalm);
  // The frame's debug data; a client shows it with its error.
  payload += why.substr(0, 1024);
  return Frame(kSettingsFrame, "") + Frame(kGoawayFrame, payload);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Start(
    grpc::Server* server, Options options) {
  auto listener = common::ListenUnix(options.path, options.mode);
  if (!listener.ok()) return listener.status();
  // Accepted until EAGAIN on each wake, never blocking the sweeps.
  const int flags = ::fcntl(listener->get(), F_GETFL);
  if (flags < 0 || ::fcntl(listener->get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return absl::ErrnoToStatus(errno, "making the gRPC socket non-blocking");
  }
  common::UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::ErrnoToStatus(errno, "eventfd");
  std::unique_ptr<GrpcListener> l(new GrpcListener(
      server, std::move(options), std::move(*listener), std::move(wake)));
  l->thread_ = std::thread([raw = l.get()] { raw->Loop(); });
  return l;
}

GrpcListener::GrpcListener(grpc::Server* server, Options options,
                           common::UniqueFd listener, common::UniqueFd wake)
    : server_(server),
      options_(std::move(options)),
      listener_(std::move(listener)),
      wake_(std::move(wake)) {}

GrpcListener::~GrpcListener() { Stop(); }

void GrpcListener::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  ::unlink(options_.path.c_str());
}

void GrpcListener::Loop() {
  const int timeout_ms =
      static_cast<int>(absl::ToInt64Milliseconds(options_.sweep_every));
  absl::Time last_sweep = absl::Now();
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    const int ready = ::poll(fds, 2, timeout_ms);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
    }
    if (ready > 0 && (fds[0].revents & POLLIN) != 0) Accept();
    const absl::Time now = absl::Now();
    if (now - last_sweep >= options_.sweep_every) {
      Sweep(now);
      last_sweep = now;
    }
  }
}

void GrpcListener::Accept() {
  for (;;) {
    common::UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr,
                                  SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // EAGAIN: all taken. EMFILE and the like: the next wake tries again
      // (the poll's timeout keeps that from spinning).
      return;
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) continue;
    auto cred = common::PeerCredentials(fd.get());
    const int64_t uid = cred.ok() ? static_cast<int64_t>(cred->uid) : -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A number accepted again was closed by gRPC since the last sweep.
      std::erase_if(connections_,
                    [&](const Connection& c) { return c.fd == fd.get(); });
      if (connections_.size() >= options_.max_connections) {
        Refuse(std::move(fd), "max_grpc_connections",
               absl::StrCat("deltad serves at most ", options_.max_connections,
                            " gRPC connections at a time"));
        continue;
      }
      size_t of_uid = 0;
      for (const Connection& c : connections_) of_uid += c.uid == uid;
      if (uid >= 0 && of_uid >= options_.max_connections_per_uid) {
        Refuse(std::move(fd), "max_grpc_connections_per_uid",
               absl::StrCat("uid ", uid, " already has the maximum of ",
                            options_.max_connections_per_uid,
                            " gRPC connections open "
                            "(limits.max_grpc_connections_per_uid)"));
        continue;
      }
      connections_.push_back({fd.get(), st.st_ino, uid, 0, absl::Now(), false});
    }
    grpc::AddInsecureChannelFromFd(server_, fd.release());
  }
}

void GrpcListener::Refuse(common::UniqueFd fd, const char* limit,
                          const std::string& why) {
  const std::string goaway = Goaway(why);
  (void)::send(fd.get(), goaway.data(), goaway.size(),
               MSG_DONTWAIT | MSG_NOSIGNAL);
  // What the client sent first (its preface) is read, so that closing
  // does not turn into a reset that could overtake the GOAWAY.
  char drain[256];
  while (::recv(fd.get(), drain, sizeof(drain), MSG_DONTWAIT) > 0) {
  }
  if (options_.refused) options_.refused(limit);
  int64_t held_back = 0;
  if (refused_log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: refused a gRPC connection: %s (%lld more held "
                 "back before this line)\n",
                 why.c_str(), static_cast<long long>(held_back));
  }
}

void GrpcListener::Sweep(absl::Time now) {
  int64_t shut = 0;
  int64_t shut_uid = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(connections_, [](const Connection& c) {
      struct stat st;
      return ::fstat(c.fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
             st.st_ino != c.inode;
    });
    for (Connection& c : connections_) {
      if (c.shut) continue;
      int unread = 0;
      if (::ioctl(c.fd, SIOCOUTQ, &unread) != 0) continue;
      if (unread == 0 || unread != c.unread) {
        c.unread = unread;
        c.unread_since = now;
        continue;
      }
      if (now - c.unread_since < options_.unread_for) continue;
      // The descriptor still names this connection (checked above, under
      // the lock, and gRPC does not close a connection whose write waits).
      ::shutdown(c.fd, SHUT_RDWR);
      c.shut = true;
      ++shut;
      shut_uid = c.uid;
      if (options_.refused) options_.refused("unread_connection");
    }
  }
  int64_t held_back = 0;
  if (shut == 0 || !unread_log_.Allow(&held_back)) return;
  std::fprintf(
      stderr,
      "deltad: shut down %lld gRPC connection(s) (the last of uid "
      "%lld) whose clients left the daemon's bytes unread for %lld "
      "s (keepalive_time_ms + keepalive_timeout_ms; %lld such lines "
      "held back before this one)\n",
      static_cast<long long>(shut), static_cast<long long>(shut_uid),
      static_cast<long long>(absl::ToInt64Seconds(options_.unread_for)),
      static_cast<long long>(held_back));
}

}  // namespace deltad::daemon
