#include "daemon/grpc_listener.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/http2_refusal.h"
#include "daemon/tcp_socket.h"
#include "grpcpp/server_posix.h"

namespace deltad::daemon {
namespace {

// How often a connection at the gate is looked at, at most.
constexpr absl::Duration kGateLookEvery = absl::Milliseconds(10);

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
  TcpListeners tcp;
  if (!options.tcp_address.empty()) {
    auto listening = ListenTcp(options.tcp_address);
    if (!listening.ok()) {
      ::unlink(options.path.c_str());
      return absl::Status(
          listening.status().code(),
          absl::StrCat("tcp_address: ", listening.status().message()));
    }
    tcp = std::move(*listening);
  }
  common::UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::ErrnoToStatus(errno, "eventfd");
  std::unique_ptr<GrpcListener> l(new GrpcListener(
      server, std::move(options), std::move(*listener), std::move(wake)));
  l->tcp_ = std::move(tcp.fds);
  l->tcp_port_ = tcp.port;
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
  std::vector<pollfd> fds;
  for (;;) {
    fds.assign({{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}});
    for (const common::UniqueFd& t : tcp_) fds.push_back({t.get(), POLLIN, 0});
    for (const Lingering& l : lingering_) {
      fds.push_back({l.fd.get(), POLLIN, 0});
    }
    // Lingering connections are woken for at least every 25 ms, so that
    // each gets its GOAWAY and is closed close to when it is due; those at
    // the gate as often as they are looked at (their bytes stay in the
    // socket, which polls readable until gRPC reads them).
    int wait_ms = timeout_ms;
    if (!lingering_.empty()) wait_ms = std::min(wait_ms, 25);
    if (!gate_.empty()) {
      wait_ms = std::min(
          wait_ms, static_cast<int>(absl::ToInt64Milliseconds(kGateLookEvery)));
    }
    const int ready = ::poll(fds.data(), fds.size(), wait_ms);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
    }
    const absl::Time now = absl::Now();
    if (!lingering_.empty()) DrainLingering(now);
    if (ready > 0) {
      if ((fds[0].revents & POLLIN) != 0) Accept(listener_.get(), false);
      for (size_t i = 0; i < tcp_.size(); ++i) {
        if ((fds[2 + i].revents & POLLIN) != 0) Accept(tcp_[i].get(), true);
      }
    }
    if (!gate_.empty()) ServeGate(now);
    if (now - last_sweep >= options_.sweep_every) {
      Sweep(now);
      last_sweep = now;
    }
  }
}

void GrpcListener::Accept(int listening, bool tcp) {
  for (;;) {
    common::UniqueFd fd(
        ::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // EAGAIN: all taken. EMFILE and the like: the next wake tries again
      // (the poll's timeout keeps that from spinning).
      return;
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) continue;
    // The user: the Unix socket's peer credentials, or the owner of a TCP
    // client's socket on this machine. -1 (a TCP client elsewhere): all
    // such count as one user.
    int64_t uid = -1;
    if (tcp) {
      const int one = 1;
      (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto owner = LocalTcpPeerUid(fd.get());
      if (owner.ok()) uid = static_cast<int64_t>(*owner);
    } else {
      auto cred = common::PeerCredentials(fd.get());
      if (cred.ok()) uid = static_cast<int64_t>(cred->uid);
    }
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
      if (of_uid >= options_.max_connections_per_uid) {
        Refuse(std::move(fd), "max_grpc_connections_per_uid",
               absl::StrCat("uid ", uid, " already has the maximum of ",
                            options_.max_connections_per_uid,
                            " gRPC connections open "
                            "(limits.max_grpc_connections_per_uid)"));
        continue;
      }
      connections_.push_back({fd.get(), st.st_ino, uid, 0, absl::Now(), false});
    }
    const std::string settings = Http2Gate::Settings();
    (void)::send(fd.get(), settings.data(), settings.size(),
                 MSG_DONTWAIT | MSG_NOSIGNAL);
    gate_.push_back({std::move(fd), absl::Now() + options_.ack_within,
                     Http2Gate(options_.max_calls_before_ack)});
  }
}

void GrpcListener::Forget(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(connections_, [&](const Connection& c) { return c.fd == fd; });
}

void GrpcListener::ServeGate(absl::Time now) {
  peeked_.resize(Http2Gate::kMostBytes);
  std::erase_if(gate_, [&](AtGate& g) {
    const int fd = g.fd.get();
    int queued = 0;
    if (::ioctl(fd, SIOCINQ, &queued) != 0) queued = -1;
    Http2Gate::Verdict verdict = Http2Gate::Verdict::kWait;
    if ((queued != g.seen || queued == 0) && now >= g.next_look) {
      g.next_look = now + kGateLookEvery;
      const ssize_t n =
          ::recv(fd, peeked_.data(), peeked_.size(), MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK &&
                     errno != EINTR)) {
        Forget(fd);  // the client left, or the socket failed
        return true;
      }
      if (n > 0) {
        g.seen = static_cast<int>(n);
        verdict = g.gate.Look(
            absl::string_view(peeked_.data(), static_cast<size_t>(n)));
      }
    }
    if (verdict == Http2Gate::Verdict::kPass) {
      grpc::AddInsecureChannelFromFd(server_, g.fd.release());
      return true;
    }
    if (verdict == Http2Gate::Verdict::kWait && now < g.until) return false;
    Forget(fd);
    if (verdict == Http2Gate::Verdict::kRefuse) {
      Refuse(std::move(g.fd), g.gate.limit(), g.gate.why());
    } else {
      Refuse(std::move(g.fd), "settings_ack_ms",
             absl::StrCat("a connection did not acknowledge the daemon's "
                          "SETTINGS within ",
                          absl::FormatDuration(options_.ack_within),
                          " (limits.settings_ack_ms)"));
    }
    return true;
  });
}

void GrpcListener::Refuse(common::UniqueFd fd, const char* limit,
                          const std::string& why) {
  const std::string preface = Http2Refusal::Preface();
  (void)::send(fd.get(), preface.data(), preface.size(),
               MSG_DONTWAIT | MSG_NOSIGNAL);
  // Kept open while the client writes its preface and its call, and reads
  // the answer (DrainLingering): closed at once, the client's first write
  // would fail with a broken pipe before it reads why.
  if (lingering_.size() >= options_.max_lingering) {
    lingering_.erase(lingering_.begin());  // the oldest
  }
  const absl::Time now = absl::Now();
  lingering_.push_back({std::move(fd), now + options_.linger,
                        now + options_.goaway_after, Http2Refusal(why)});
  if (options_.refused) options_.refused(limit);
  int64_t held_back = 0;
  if (refused_log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: refused a gRPC connection: %s (%lld more held "
                 "back before this line)\n",
                 why.c_str(), static_cast<long long>(held_back));
  }
}

void GrpcListener::DrainLingering(absl::Time now) {
  std::erase_if(lingering_, [&](Lingering& l) {
    const int fd = l.fd.get();
    auto send = [fd](const std::string& bytes) {
      (void)::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    };
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) return true;  // the client closed, or the socket failed
      auto reply =
          l.refusal.Feed(absl::string_view(buf, static_cast<size_t>(n)));
      if (!reply.ok()) {
        if (!l.goaway_sent) send(l.refusal.Goaway());
        return true;
      }
      send(*reply);
    }
    // The GOAWAY once a call has its answer, or when none came in time (a
    // client with no call waiting, or one that is not gRPC).
    if (!l.goaway_sent && (l.refusal.answered() > 0 || now >= l.goaway_at)) {
      send(l.refusal.Goaway());
      l.goaway_sent = true;
    }
    return now >= l.until;
  });
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
      // Counted first: whoever sees the connection end sees it counted.
      if (options_.refused) options_.refused("unread_connection");
      // The descriptor still names this connection (checked above, under
      // the lock, and gRPC does not close a connection whose write waits).
      ::shutdown(c.fd, SHUT_RDWR);
      c.shut = true;
      ++shut;
      shut_uid = c.uid;
    }
  }
  int64_t held_back = 0;
  if (shut == 0 || !unread_log_.Allow(&held_back)) return;
  std::fprintf(
      stderr,
      "deltad: shut down %lld gRPC connection(s) (the last of uid "
      "%lld) whose clients left the daemon's bytes unread for %lld "
      "s (keepalive_time_ms; %lld such lines "
      "held back before this one)\n",
      static_cast<long long>(shut), static_cast<long long>(shut_uid),
      static_cast<long long>(absl::ToInt64Seconds(options_.unread_for)),
      static_cast<long long>(held_back));
}

}  // namespace deltad::daemon
