#include "daemon/side_channel.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/side_protocol.h"
#include "daemon/process_end.h"

namespace deltad::daemon {

namespace side = common::side;

namespace {

// Connections accepted in one turn of the loop, so that a burst of them
// does not keep the open ones waiting.
constexpr int kAcceptsPerTurn = 64;
// How long the listener rests when accept() runs out of descriptors or
// memory: it stays readable, and retrying at once would spin.
constexpr int kAcceptBackoffMs = 10;

bool WouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

uint32_t PayloadLength(const std::string& header) {
  uint32_t length;
  std::memcpy(&length, header.data() + sizeof(uint64_t), sizeof(length));
  return length;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SideChannel>> SideChannel::Start(
    const std::string& path, mode_t mode, Node& node, DeliverFn deliver,
    size_t max_connections, size_t max_per_uid, RefusedFn refused) {
  common::UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::ErrnoToStatus(errno, "eventfd");
  auto listener = common::ListenUnix(path, mode);
  if (!listener.ok()) return listener.status();
  const int flags = ::fcntl(listener->get(), F_GETFL);
  if (flags < 0 || ::fcntl(listener->get(), F_SETFL, flags | O_NONBLOCK) < 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("O_NONBLOCK on ", path));
  }
  std::unique_ptr<SideChannel> channel(new SideChannel(
      path, node, std::move(deliver), max_connections, max_per_uid,
      std::move(refused), std::move(*listener), std::move(wake)));
  channel->loop_ = std::thread([c = channel.get()] { c->Loop(); });
  return channel;
}

SideChannel::~SideChannel() { Stop(); }

void SideChannel::Stop() {
  if (stopping_.exchange(true)) return;
  // An eventfd write only fails when the counter would overflow, and then
  // the loop has a wake-up pending anyway.
  (void)::eventfd_write(wake_.get(), 1);
  if (loop_.joinable()) loop_.join();
  ::unlink(path_.c_str());
}

void SideChannel::Loop() {
  std::vector<pollfd> polled;
  bool listener_resting = false;
  while (!stopping_.load()) {
    polled.clear();
    polled.push_back({wake_.get(), POLLIN, 0});
    // poll() skips a negative descriptor.
    polled.push_back({listener_resting ? -1 : listener_.get(), POLLIN, 0});
    // A connection with an answer waiting is not read: a process that
    // never reads holds one answer here, not a growing pile of them.
    for (const auto& [fd, c] : connections_) {
      polled.push_back(
          {fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
    }
    const int n = ::poll(polled.data(), polled.size(),
                         listener_resting ? kAcceptBackoffMs : -1);
    listener_resting = false;
    if (n < 0) {
      // EINTR, or ENOMEM: nothing was reported, try again shortly.
      if (errno != EINTR) ::usleep(kAcceptBackoffMs * 1000);
      continue;
    }
    for (size_t i = 2; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      // Accepts come after this pass, so a closed connection's number is
      // not yet another connection's here.
      auto it = connections_.find(polled[i].fd);
      if (it != connections_.end()) Serve(it);
    }
    if (polled[1].revents != 0) listener_resting = !AcceptAll();
  }
  // Stop(): every process loses its lifeline as if the daemon were gone.
  while (!connections_.empty()) Close(connections_.begin());
}

bool SideChannel::AcceptAll() {
  for (int i = 0; i < kAcceptsPerTurn; ++i) {
    common::UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr,
                                  SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd.valid()) {
      Admit(std::move(fd));
    } else if (WouldBlock(errno)) {
      return true;
    } else if (errno != EINTR && errno != ECONNABORTED) {
      return false;  // EMFILE and the like
    }
  }
  return true;
}

void SideChannel::Admit(common::UniqueFd fd) {
  auto cred = common::PeerCredentials(fd.get());
  const int64_t uid = cred.ok() ? static_cast<int64_t>(cred->uid) : -1;
  if (connections_.size() >= max_connections_) {
    Refuse(fd.get(), "max_side_connections",
           absl::StrCat("deltad serves at most ", max_connections_,
                        " processes at a time"));
    return;
  }
  size_t of_uid = 0;
  for (const auto& [other, c] : connections_) {
    if (c.uid == uid) ++of_uid;
  }
  if (uid >= 0 && of_uid >= max_per_uid_) {
    Refuse(
        fd.get(), "max_side_connections_per_uid",
        absl::StrCat("uid ", uid, " already has the maximum of ", max_per_uid_,
                     " side-socket connections open "
                     "(limits.max_side_connections_per_uid)"));
    return;
  }
  if (!cred.ok()) return;
  ReapClosedConnectionsOf(cred->pid);
  auto token = node_.registry().RegisterPeer(
      {cred->pid, cred->uid, cred->gid, ProcessStartTime(cred->pid)});
  if (!token.ok()) return;
  Connection c;
  c.fd = std::move(fd);
  c.pid = cred->pid;
  c.uid = uid;
  c.peer_token = *token;
  Queue(c, side::kPeerToken, *token);
  if (!Flush(c)) {
    node_.registry().ForgetPeer(*token);
    return;
  }
  const int raw = c.fd.get();
  connections_.emplace(raw, std::move(c));
}

void SideChannel::Refuse(int fd, const char* limit, const std::string& why) {
  // Into an empty socket buffer: the non-blocking send does not fail for
  // want of room.
  (void)common::SendFds(fd, side::kError, {}, why);
  if (refused_) refused_(limit);
}

void SideChannel::ReapClosedConnectionsOf(pid_t pid) {
  // Still needed with one thread: accept() takes connections made after
  // the poll() that woke it, and the close of the old one may be just as
  // recent, unseen until the next turn.
  for (auto it = connections_.begin(); it != connections_.end();) {
    const auto next = std::next(it);
    if (it->second.pid == pid) {
      pollfd p{it->first, POLLRDHUP, 0};
      if (::poll(&p, 1, 0) == 1 &&
          (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        Close(it);
      }
    }
    it = next;
  }
}

void SideChannel::Serve(Connections::iterator it) {
  Connection& c = it->second;
  bool keep = c.out.empty() ? ReadRequest(c) : Flush(c);
  if (keep && c.out.empty() && c.close_when_sent) keep = false;
  if (!keep) Close(it);
}

bool SideChannel::ReadRequest(Connection& c) {
  char buffer[common::kHeaderBytes + side::kMaxMessageBytes];
  // Only what this request still lacks is read, so one request never runs
  // into the next, and the first bytes of each go through recvmsg() to see
  // descriptors, as common::RecvFds does. Bounded: each pass takes at
  // least a byte of a request of at most sizeof(buffer).
  for (;;) {
    const size_t have = c.request.size();
    const size_t whole = have < common::kHeaderBytes
                             ? common::kHeaderBytes
                             : common::kHeaderBytes + PayloadLength(c.request);
    ssize_t got;
    if (have == 0) {
      iovec iov{buffer, common::kHeaderBytes};
      // Room for as many descriptors as a message may carry, so that all
      // of them arrive here and are closed.
      alignas(cmsghdr) char
          control[CMSG_SPACE(sizeof(int) * common::kMaxFdsPerMessage)];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      got = ::recvmsg(c.fd.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      bool carried_fds = (msg.msg_flags & MSG_CTRUNC) != 0;
      for (cmsghdr* cmsg = got >= 0 ? CMSG_FIRSTHDR(&msg) : nullptr;
           cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) {
          continue;
        }
        const size_t fds = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < fds; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(fd));
          ::close(fd);
          carried_fds = true;
        }
      }
      // A request that carries descriptors is not one of ours.
      if (carried_fds) return false;
    } else {
      got = ::recv(c.fd.get(), buffer, whole - have, MSG_DONTWAIT);
    }
    if (got < 0) return errno == EINTR || WouldBlock(errno);
    if (got == 0) return false;  // the process closed its end
    c.request.append(buffer, static_cast<size_t>(got));
    if (c.request.size() == common::kHeaderBytes &&
        PayloadLength(c.request) > side::kMaxMessageBytes) {
      return false;
    }
    if (c.request.size() >= common::kHeaderBytes &&
        c.request.size() == common::kHeaderBytes + PayloadLength(c.request)) {
      break;
    }
  }
  uint64_t tag;
  std::memcpy(&tag, c.request.data(), sizeof(tag));
  const std::string request = std::move(c.request);
  c.request.clear();
  if (!Answer(c, tag,
              absl::string_view(request).substr(common::kHeaderBytes))) {
    c.close_when_sent = true;
  }
  return Flush(c);
}

void SideChannel::Queue(Connection& c, uint64_t tag, absl::string_view payload,
                        common::UniqueFd fd) {
  c.out.push_back({common::EncodeMessage(tag, payload), std::move(fd)});
}

// The socket takes what fits and the rest waits for POLLOUT: closing the
// connection instead would break honest processes, as a chunk grant is a
// message per chunk, thousands for a large GPU, more than a socket buffer
// holds however fast the process reads.
bool SideChannel::Flush(Connection& c) {
  while (!c.out.empty()) {
    Outgoing& m = c.out.front();
    // The descriptor goes with the first byte; the rest of a short write
    // is only bytes.
    const int fd = m.fd.get();
    const ssize_t n = common::SendWithFds(
        c.fd.get(), absl::string_view(m.wire).substr(m.sent),
        m.sent == 0 && m.fd.valid() ? absl::Span<const int>(&fd, 1)
                                    : absl::Span<const int>(),
        MSG_DONTWAIT);
    if (n < 0) return WouldBlock(errno);
    m.sent += static_cast<size_t>(n);
    if (m.sent == m.wire.size()) c.out.pop_front();
  }
  return true;
}

void SideChannel::Close(Connections::iterator it) {
  const OrdersBySession others = node_.PeerGone(it->second.peer_token);
  if (deliver_) deliver_(others);
  // Closed after the reclaim, so that a process that sees its lifeline end
  // finds its sessions gone.
  connections_.erase(it);
}

bool SideChannel::Answer(Connection& c, uint64_t tag,
                         absl::string_view payload) {
  auto error = [&c](const absl::Status& s) {
    Queue(c, side::kError, s.ToString());
    return true;
  };
  switch (tag) {
    case side::kSlabsWanted: {
      auto slabs = node_.HostSlabs(payload, c.peer_token);
      if (!slabs.ok()) return error(slabs.status());
      for (side::Grant& slab : *slabs) {
        Queue(c, side::kSlab, side::EncodeRecord({slab.id, slab.bytes}),
              std::move(slab.fd));
      }
      Queue(c, side::kSlabsDone);
      return true;
    }
    case side::kChunksWanted: {
      auto wanted = side::DecodeChunksWanted(payload);
      if (!wanted.has_value()) {
        return error(absl::InvalidArgumentError(
            "malformed chunk request: want a non-negative byte count and a "
            "session token"));
      }
      auto chunks = node_.GrantChunks(wanted->session_token, c.peer_token,
                                      wanted->target_bytes);
      if (!chunks.ok()) return error(chunks.status());
      if (!chunks->others.empty() && deliver_) deliver_(chunks->others);
      // Should the process go before taking them all, PeerGone takes them
      // back.
      for (side::Grant& chunk : chunks->chunks) {
        Queue(c, side::kChunk, side::EncodeRecord({chunk.id, chunk.bytes}),
              std::move(chunk.fd));
      }
      Queue(c, side::kChunksDone);
      return true;
    }
    case side::kChunksReturned: {
      auto returned = side::DecodeChunksReturned(payload);
      if (!returned.has_value()) {
        return error(absl::InvalidArgumentError(
            "malformed chunk return: want a session token and chunk ids"));
      }
      absl::Status s = node_.ReturnChunks(returned->session_token, c.peer_token,
                                          returned->chunk_ids);
      if (!s.ok()) return error(s);
      Queue(c, side::kChunksDone);
      return true;
    }
    default:
      (void)error(absl::InvalidArgumentError(
          absl::StrCat("unknown side-socket message tag ", tag)));
      return false;
  }
}

}  // namespace deltad::daemon
