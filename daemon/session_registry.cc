#include "daemon/session_registry.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace deltad::daemon {

namespace {

// Equal length and equal bytes, looking at every byte either way.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> SessionRegistry::NewToken() {
  char bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("getrandom failed: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(bytes, sizeof bytes));
}

template <typename Map>
typename Map::const_iterator SessionRegistry::FindToken(
    const Map& map, absl::string_view token) {
  // A linear scan so that timing does not depend on where the token sorts;
  // registries hold at most a few hundred entries.
  auto found = map.end();
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (ConstantTimeEquals(it->first, token)) found = it;
  }
  return found;
}

absl::Status SessionRegistry::UnknownPeer() {
  return absl::UnauthenticatedError(
      "unknown peer token: connect to the side socket first and present the "
      "token it gives");
}

absl::StatusOr<std::string> SessionRegistry::RegisterPeer(
    const PeerIdentity& peer) {
  auto token = NewToken();
  if (!token.ok()) return token.status();
  std::lock_guard<std::mutex> lock(mu_);
  peers_[*token] = peer;
  return token;
}

absl::StatusOr<SessionInfo> SessionRegistry::Open(absl::string_view peer_token,
                                                  int gpu, uint32_t priority,
                                                  std::string label,
                                                  SessionLimit* refused_at) {
  auto token = NewToken();
  if (!token.ok()) return token.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto peer = FindToken(peers_, peer_token);
  if (peer == peers_.end()) {
    return UnknownPeer();
  }
  size_t on_gpu = 0;
  size_t of_uid = 0;
  for (const auto& [t, s] : sessions_) {
    if (s.peer.uid == peer->second.uid) ++of_uid;
    if (s.gpu != gpu) continue;
    ++on_gpu;
    if (s.peer.pid == peer->second.pid) {
      return absl::AlreadyExistsError(absl::StrCat("process ", s.peer.pid,
                                                   " already has session ",
                                                   s.id, " on GPU ", gpu));
    }
  }
  // One user's processes must not take every session of the node.
  if (of_uid >= static_cast<size_t>(max_sessions_per_uid_)) {
    if (refused_at != nullptr) *refused_at = SessionLimit::kPerUid;
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", peer->second.uid, " already has the maximum of ",
        max_sessions_per_uid_, " sessions (limits.max_sessions_per_uid)"));
  }
  if (on_gpu >= static_cast<size_t>(max_sessions_per_gpu_)) {
    if (refused_at != nullptr) *refused_at = SessionLimit::kPerGpu;
    return absl::ResourceExhaustedError(
        absl::StrCat("GPU ", gpu, " already has the maximum of ",
                     max_sessions_per_gpu_, " sessions"));
  }
  SessionInfo info;
  info.id = next_id_++;
  info.token = *token;
  info.peer = peer->second;
  info.peer_token = peer->first;
  info.gpu = gpu;
  info.priority = std::max<uint32_t>(1, priority);
  info.label = std::move(label);
  sessions_[info.token] = info;
  peer_sessions_[peer->first].push_back(info.token);
  return info;
}

absl::StatusOr<SessionInfo> SessionRegistry::Authorize(
    absl::string_view session_token) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = FindToken(sessions_, session_token);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError("unknown or closed session token");
  }
  return it->second;
}

absl::StatusOr<SessionInfo> SessionRegistry::AuthorizeForPeer(
    absl::string_view session_token, absl::string_view peer_token) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = FindToken(sessions_, session_token);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError("unknown or closed session token");
  }
  auto peer = FindToken(peer_sessions_, peer_token);
  if (peer == peer_sessions_.end() ||
      std::find(peer->second.begin(), peer->second.end(), it->first) ==
          peer->second.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat("session ", it->second.id, " belongs to another process"));
  }
  return it->second;
}

absl::StatusOr<PeerIdentity> SessionRegistry::PeerOf(
    absl::string_view peer_token) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto peer = FindToken(peers_, peer_token);
  if (peer == peers_.end()) {
    return UnknownPeer();
  }
  return peer->second;
}

absl::StatusOr<SessionInfo> SessionRegistry::Close(
    absl::string_view session_token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = FindToken(sessions_, session_token);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError("unknown or closed session token");
  }
  SessionInfo info = it->second;
  sessions_.erase(it);
  for (auto& [peer, tokens] : peer_sessions_) {
    tokens.erase(std::remove(tokens.begin(), tokens.end(), info.token),
                 tokens.end());
  }
  return info;
}

std::vector<SessionInfo> SessionRegistry::ForgetPeer(
    absl::string_view peer_token) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionInfo> closed;
  auto peer = FindToken(peers_, peer_token);
  if (peer == peers_.end()) return closed;
  const std::string key = peer->first;
  for (const std::string& t : peer_sessions_[key]) {
    auto it = sessions_.find(t);
    if (it == sessions_.end()) continue;
    closed.push_back(it->second);
    sessions_.erase(it);
  }
  peer_sessions_.erase(key);
  peers_.erase(key);
  return closed;
}

std::vector<SessionInfo> SessionRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionInfo> out;
  for (const auto& [t, s] : sessions_) out.push_back(s);
  std::sort(
      out.begin(), out.end(),
      [](const SessionInfo& a, const SessionInfo& b) { return a.id < b.id; });
  return out;
}

size_t SessionRegistry::sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

size_t SessionRegistry::SessionsOnGpu(int gpu) const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::count_if(sessions_.begin(), sessions_.end(),
                       [&](const auto& e) { return e.second.gpu == gpu; });
}

}  // namespace deltad::daemon
