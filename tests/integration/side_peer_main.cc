// A stand-in training process for the integration tests (PeerProcess in
// daemon_process.h): connects to the side socket named by argv[1], prints
// "token <peer token>" on stdout, and holds the connection until its stdin
// reaches EOF. Its pid is what the daemon binds the peer's sessions to,
// which is why it is a process of its own and not a thread of the test.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "common/side_protocol.h"
#include "common/unix_socket.h"

namespace side = deltad::common::side;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("error usage: %s SIDE_SOCKET_PATH\n", argv[0]);
    return 2;
  }
  auto fd = deltad::common::ConnectUnix(argv[1]);
  if (!fd.ok()) {
    std::printf("error %s\n", fd.status().ToString().c_str());
    return 1;
  }
  auto hello = deltad::common::RecvFds(fd->get(), 0, side::kMaxMessageBytes);
  if (!hello.ok() || hello->tag != side::kPeerToken) {
    std::printf("error no peer token: %s\n",
                hello.ok() ? "wrong tag" : hello.status().ToString().c_str());
    return 1;
  }
  std::printf("token %s\n", hello->payload.c_str());
  std::fflush(stdout);
  // Holds the lifeline until the test closes stdin (or kills this process).
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}
