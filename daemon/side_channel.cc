#include "daemon/side_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/side_protocol.h"
#include "daemon/process_end.h"

namespace deltad::daemon {

namespace side = common::side;

absl::StatusOr<std::unique_ptr<SideChannel>> SideChannel::Start(
    const std::string& path, mode_t mode, Node& node, DeliverFn deliver,
    size_t max_connections, size_t max_per_uid, RefusedFn refused) {
  auto listener = common::ListenUnix(path, mode);
  if (!listener.ok()) return listener.status();
  std::unique_ptr<SideChannel> channel(
      new SideChannel(path, node, std::move(deliver), max_connections,
                      max_per_uid, std::move(refused), std::move(*listener)));
  channel->acceptor_ = std::thread([c = channel.get()] { c->AcceptLoop(); });
  return channel;
}

SideChannel::~SideChannel() { Stop(); }

void SideChannel::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    // Wakes accept() and every blocked recv(); the threads then see
    // stopping_ or a closed socket and end.
    ::shutdown(listener_.get(), SHUT_RDWR);
    for (auto& [id, c] : connections_) ::shutdown(c->fd.get(), SHUT_RDWR);
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::map<uint64_t, std::unique_ptr<Connection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(connections_);
  }
  for (auto& [id, c] : all) {
    if (c->thread.joinable()) c->thread.join();
  }
  ::unlink(path_.c_str());
}

void SideChannel::JoinFinished() {
  std::vector<std::unique_ptr<Connection>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->second->done) {
        finished.push_back(std::move(it->second));
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : finished) c->thread.join();
}

void SideChannel::AcceptLoop() {
  for (;;) {
    common::UniqueFd fd(
        ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      // EMFILE and the like: back off rather than spin, then go on.
      ::usleep(10000);
      continue;
    }
    JoinFinished();
    // Read here, before a thread is spent on it.
    auto cred = common::PeerCredentials(fd.get());
    const int64_t uid = cred.ok() ? static_cast<int64_t>(cred->uid) : -1;
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (connections_.size() >= max_connections_) {
      Refuse(fd.get(), "max_side_connections",
             absl::StrCat("deltad serves at most ", max_connections_,
                          " processes at a time"));
      continue;
    }
    size_t of_uid = 0;
    for (const auto& [other, c] : connections_) {
      if (!c->done && c->uid == uid) ++of_uid;
    }
    if (uid >= 0 && of_uid >= max_per_uid_) {
      Refuse(fd.get(), "max_side_connections_per_uid",
             absl::StrCat("uid ", uid, " already has the maximum of ",
                          max_per_uid_,
                          " side-socket connections open "
                          "(limits.max_side_connections_per_uid)"));
      continue;
    }
    const uint64_t id = next_id_++;
    auto c = std::make_unique<Connection>();
    c->fd = std::move(fd);
    c->uid = uid;
    const int raw = c->fd.get();
    c->thread = std::thread([this, id, raw] { Serve(id, raw); });
    connections_[id] = std::move(c);
  }
}

void SideChannel::Refuse(int fd, const char* limit, const std::string& why) {
  (void)common::SendFds(fd, side::kError, {}, why);
  if (refused_) refused_(limit);
}

void SideChannel::Serve(uint64_t id, int fd) {
  std::string peer_token;
  if (auto cred = common::PeerCredentials(fd); cred.ok()) {
    ReapClosedConnectionsOf(cred->pid);
    auto token = node_.registry().RegisterPeer(
        {cred->pid, cred->uid, cred->gid, ProcessStartTime(cred->pid)});
    if (token.ok()) {
      // Known before the process has it, so that its next connection
      // finds this one.
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = connections_.find(id); it != connections_.end()) {
        it->second->pid = cred->pid;
        it->second->peer_token = *token;
      }
    }
    if (token.ok() && common::SendFds(fd, side::kPeerToken, {}, *token).ok()) {
      peer_token = std::move(*token);
    } else if (token.ok()) {
      node_.registry().ForgetPeer(*token);
    }
  }
  if (!peer_token.empty()) {
    for (;;) {
      auto message = common::RecvFds(fd, 0, side::kMaxMessageBytes);
      if (!message.ok() || !Answer(fd, peer_token, *message)) break;
    }
    // The process is gone (or broke the protocol): its sessions go with it.
    const OrdersBySession others = node_.PeerGone(peer_token);
    if (deliver_) deliver_(others);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = connections_.find(id);
  if (it != connections_.end()) {
    // Closed here, not at join, so the process sees its lifeline end now.
    it->second->fd.reset();
    it->second->done = true;
  }
}

void SideChannel::ReapClosedConnectionsOf(pid_t pid) {
  std::vector<std::string> closed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, c] : connections_) {
      if (c->done || c->pid != pid || c->peer_token.empty() || !c->fd.valid()) {
        continue;
      }
      pollfd p{c->fd.get(), POLLRDHUP, 0};
      if (::poll(&p, 1, 0) == 1 &&
          (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        closed.push_back(c->peer_token);
      }
    }
  }
  // Its own thread reclaims too once it sees the close; the second finds
  // nothing left.
  for (const std::string& token : closed) {
    const OrdersBySession others = node_.PeerGone(token);
    if (deliver_) deliver_(others);
  }
}

bool SideChannel::Answer(int fd, const std::string& peer_token,
                         const common::ReceivedFds& message) {
  // A request that carries descriptors is not one of ours; they were
  // closed with `message`.
  auto error = [fd](const absl::Status& s) {
    return common::SendFds(fd, side::kError, {}, s.ToString()).ok();
  };
  switch (message.tag) {
    case side::kSlabsWanted: {
      auto slabs = node_.HostSlabs(message.payload, peer_token);
      if (!slabs.ok()) return error(slabs.status());
      for (const side::Grant& slab : *slabs) {
        const int slab_fd = slab.fd.get();
        if (!common::SendFds(fd, side::kSlab, {&slab_fd, 1},
                             side::EncodeRecord({slab.id, slab.bytes}))
                 .ok()) {
          return false;
        }
      }
      return common::SendFds(fd, side::kSlabsDone, {}).ok();
    }
    case side::kChunksWanted: {
      auto wanted = side::DecodeChunksWanted(message.payload);
      if (!wanted.has_value()) {
        return error(absl::InvalidArgumentError(
            "malformed chunk request: want a non-negative byte count and a "
            "session token"));
      }
      auto chunks = node_.GrantChunks(wanted->session_token, peer_token,
                                      wanted->target_bytes);
      if (!chunks.ok()) return error(chunks.status());
      if (!chunks->others.empty() && deliver_) deliver_(chunks->others);
      for (const side::Grant& chunk : chunks->chunks) {
        const int chunk_fd = chunk.fd.get();
        if (!common::SendFds(fd, side::kChunk, {&chunk_fd, 1},
                             side::EncodeRecord({chunk.id, chunk.bytes}))
                 .ok()) {
          return false;  // the process is gone; PeerGone takes them back
        }
      }
      return common::SendFds(fd, side::kChunksDone, {}).ok();
    }
    case side::kChunksReturned: {
      auto returned = side::DecodeChunksReturned(message.payload);
      if (!returned.has_value()) {
        return error(absl::InvalidArgumentError(
            "malformed chunk return: want a session token and chunk ids"));
      }
      absl::Status s = node_.ReturnChunks(returned->session_token, peer_token,
                                          returned->chunk_ids);
      if (!s.ok()) return error(s);
      return common::SendFds(fd, side::kChunksDone, {}).ok();
    }
    default:
      (void)error(absl::InvalidArgumentError(
          absl::StrCat("unknown side-socket message tag ", message.tag)));
      return false;
  }
}

}  // namespace deltad::daemon
