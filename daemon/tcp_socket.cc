#include "daemon/tcp_socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace deltad::daemon {

namespace {

// An address as /proc/net/tcp{,6} prints it: each 32-bit word of the
// address as the machine reads it, in hex, then the port.
std::string ProcAddress(const sockaddr_storage& a) {
  char out[64];
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    std::snprintf(out, sizeof(out), "%08X:%04X",
                  static_cast<unsigned>(in.sin_addr.s_addr),
                  static_cast<unsigned>(ntohs(in.sin_port)));
    return out;
  }
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
  uint32_t words[4];
  std::memcpy(words, &in6.sin6_addr, sizeof(words));
  std::snprintf(out, sizeof(out), "%08X%08X%08X%08X:%04X", words[0], words[1],
                words[2], words[3],
                static_cast<unsigned>(ntohs(in6.sin6_port)));
  return out;
}

// The same address as the other family shows it: an IPv4 one as IPv6's
// mapped ::ffff:a.b.c.d, a mapped IPv6 one as IPv4; false when there is
// none. A dual-stack IPv6 client socket connected to an IPv4 address is
// listed in tcp6, mapped.
bool OtherFamily(const sockaddr_storage& a, sockaddr_storage& out) {
  out = {};
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    auto& in6 = reinterpret_cast<sockaddr_in6&>(out);
    in6.sin6_family = AF_INET6;
    in6.sin6_port = in.sin_port;
    in6.sin6_addr.s6_addr[10] = 0xff;
    in6.sin6_addr.s6_addr[11] = 0xff;
    std::memcpy(&in6.sin6_addr.s6_addr[12], &in.sin_addr, 4);
    return true;
  }
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
  if (!IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) return false;
  auto& in = reinterpret_cast<sockaddr_in&>(out);
  in.sin_family = AF_INET;
  in.sin_port = in6.sin6_port;
  std::memcpy(&in.sin_addr, &in6.sin6_addr.s6_addr[12], 4);
  return true;
}

// The uid column of the line of `table` whose local and remote addresses
// are these; NotFound when no line is.
absl::StatusOr<uid_t> OwnerIn(const std::string& table,
                              const std::string& want_local,
                              const std::string& want_remote) {
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local_address, remote_address, state, queues, timer,
        retransmits, uid;
    fields >> slot >> local_address >> remote_address >> state >> queues >>
        timer >> retransmits >> uid;
    if (local_address != want_local || remote_address != want_remote) {
      continue;
    }
    uint32_t value;
    if (!absl::SimpleAtoi(uid, &value)) break;
    return static_cast<uid_t>(value);
  }
  return absl::NotFoundError("not listed");
}

}  // namespace

absl::StatusOr<TcpListeners> ListenTcp(absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("not host:port: '", host_port, "'"));
  }
  std::string host(host_port.substr(0, colon));
  const std::string port(host_port.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const bool any = host.empty() || host == "*";
  if (int rc = ::getaddrinfo(any ? nullptr : host.c_str(), port.c_str(), &hints,
                             &found);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host_port, "': ", ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> own(found, ::freeaddrinfo);
  bool has_v4 = false;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    has_v4 |= a->ai_family == AF_INET;
  }
  TcpListeners out;
  std::string errors;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    common::UniqueFd fd(
        ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) {
      absl::StrAppend(&errors, " socket: ", std::strerror(errno), ";");
      continue;
    }
    const int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (a->ai_family == AF_INET6 && has_v4) {
      // The IPv4 addresses have sockets of their own.
      (void)::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one,
                         sizeof(one));
    }
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    if (out.port != 0) {
      // Port 0: the one the first address got, for every address.
      const uint16_t p = htons(static_cast<uint16_t>(out.port));
      if (addr.ss_family == AF_INET) {
        reinterpret_cast<sockaddr_in&>(addr).sin_port = p;
      } else {
        reinterpret_cast<sockaddr_in6&>(addr).sin6_port = p;
      }
    }
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), a->ai_addrlen) !=
            0 ||
        ::listen(fd.get(), SOMAXCONN) != 0) {
      absl::StrAppend(&errors, " ", std::strerror(errno), ";");
      continue;
    }
    if (out.port == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) !=
          0) {
        return absl::ErrnoToStatus(errno, "getsockname");
      }
      out.port = ntohs(bound.ss_family == AF_INET
                           ? reinterpret_cast<sockaddr_in&>(bound).sin_port
                           : reinterpret_cast<sockaddr_in6&>(bound).sin6_port);
    }
    out.fds.push_back(std::move(fd));
  }
  if (out.fds.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", host_port, ":", errors));
  }
  return out;
}

absl::StatusOr<uid_t> LocalTcpPeerUid(int fd, const std::string& proc_net) {
  sockaddr_storage local{}, peer{};
  socklen_t llen = sizeof(local), plen = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) {
    return absl::ErrnoToStatus(errno, "the connection's addresses");
  }
  if (local.ss_family != peer.ss_family ||
      (local.ss_family != AF_INET && local.ss_family != AF_INET6)) {
    return absl::NotFoundError("not a TCP connection");
  }
  // The client's socket: its local address is our peer, its remote ours,
  // in its own family's table (which may be the other family's, mapped).
  auto table = [&](const sockaddr_storage& a) {
    return absl::StrCat(proc_net, a.ss_family == AF_INET ? "/tcp" : "/tcp6");
  };
  auto owner = OwnerIn(table(local), ProcAddress(peer), ProcAddress(local));
  if (owner.ok()) return owner;
  sockaddr_storage peer2, local2;
  if (OtherFamily(peer, peer2) && OtherFamily(local, local2)) {
    owner = OwnerIn(table(local2), ProcAddress(peer2), ProcAddress(local2));
    if (owner.ok()) return owner;
  }
  return absl::NotFoundError("the peer is not a process of this machine");
}

}  // namespace deltad::daemon
