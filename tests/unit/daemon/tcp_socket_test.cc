#include "daemon/tcp_socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

common::UniqueFd ConnectLoopback(int port) {
  common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0)
      << std::strerror(errno);
  return fd;
}

common::UniqueFd AcceptOne(int listening) {
  pollfd p = {listening, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 5000), 1);
  return common::UniqueFd(::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC));
}

TEST(TcpSocket, PortZeroListensOnAPortChosenForIt) {
  auto l = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->fds.size(), 1u);
  EXPECT_GT(l->port, 0);
  common::UniqueFd client = ConnectLoopback(l->port);
  EXPECT_TRUE(AcceptOne(l->fds[0].get()).valid());
}

TEST(TcpSocket, APortInUseOrAnAddressThatIsNoneIsAnError) {
  auto first = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = ListenTcp("127.0.0.1:" + std::to_string(first->port));
  ASSERT_FALSE(again.ok());
  EXPECT_THAT(again.status().message(), HasSubstr("cannot listen"));
  EXPECT_FALSE(ListenTcp("no-colon").ok());
  EXPECT_FALSE(ListenTcp("host.invalid:80").ok());
}

TEST(TcpSocket, TheUserOfALocalPeerIsItsSocketsOwner) {
  auto l = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  common::UniqueFd client = ConnectLoopback(l->port);
  common::UniqueFd accepted = AcceptOne(l->fds[0].get());
  ASSERT_TRUE(accepted.valid());
  auto uid = LocalTcpPeerUid(accepted.get());
  ASSERT_TRUE(uid.ok()) << uid.status();
  EXPECT_EQ(*uid, ::getuid());
}

// What gRPC's client does: an IPv6 socket (dual stack) connected to an
// IPv4 address, listed in tcp6 with the address mapped.
TEST(TcpSocket, TheUserOfADualStackPeerOfAnIpv4PortIsFoundToo) {
  auto l = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  common::UniqueFd client(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!client.valid()) GTEST_SKIP() << "no IPv6 here";
  const int zero = 0;
  (void)::setsockopt(client.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero,
                     sizeof(zero));
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_port = htons(static_cast<uint16_t>(l->port));
  ASSERT_EQ(::inet_pton(AF_INET6, "::ffff:127.0.0.1", &a.sin6_addr), 1);
  if (::connect(client.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) !=
      0) {
    GTEST_SKIP() << "no mapped IPv4 here: " << std::strerror(errno);
  }
  common::UniqueFd accepted = AcceptOne(l->fds[0].get());
  ASSERT_TRUE(accepted.valid());
  auto uid = LocalTcpPeerUid(accepted.get());
  ASSERT_TRUE(uid.ok()) << uid.status();
  EXPECT_EQ(*uid, ::getuid());
}

TEST(TcpSocket, APeerTheKernelDoesNotListIsNotFound) {
  auto l = ListenTcp("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  common::UniqueFd client = ConnectLoopback(l->port);
  common::UniqueFd accepted = AcceptOne(l->fds[0].get());
  ASSERT_TRUE(accepted.valid());
  // A /proc/net without the client's socket: a peer on another machine.
  char dir[] = "/tmp/deltad-proc-net-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string tcp = std::string(dir) + "/tcp";
  FILE* f = std::fopen(tcp.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(
      "  sl  local_address rem_address   st tx_queue rx_queue tr "
      "tm->when retrnsmt   uid  timeout inode\n",
      f);
  std::fclose(f);
  auto uid = LocalTcpPeerUid(accepted.get(), dir);
  EXPECT_EQ(uid.status().code(), absl::StatusCode::kNotFound);
  ::unlink(tcp.c_str());
  ::rmdir(dir);
}

}  // namespace
}  // namespace deltad::daemon
