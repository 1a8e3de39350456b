// HTTP/2 as a hostile client speaks it to the daemon's gRPC socket (RFC
// 9113): frames a gRPC client library would never send (PING floods), and
// reading the GOAWAY the daemon or gRPC answers with. For the hostile
// connection tests.
#ifndef DELTAD_TESTS_INTEGRATION_RAW_HTTP2_H_
#define DELTAD_TESTS_INTEGRATION_RAW_HTTP2_H_

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/unix_socket.h"

namespace deltad::testing_util {

// HTTP/2 as the ping flood speaks it (RFC 9113): a gRPC client library
// would never send these PINGs, so the test writes the frames itself.
inline constexpr absl::string_view kHttp2Preface =
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
inline constexpr uint8_t kSettingsFrame = 0x4;
inline constexpr uint8_t kPingFrame = 0x6;
inline constexpr uint8_t kGoawayFrame = 0x7;
inline constexpr uint32_t kEnhanceYourCalm = 0xb;
inline constexpr size_t kFrameHeaderBytes = 9;

inline constexpr uint8_t kHeadersFrame = 0x1;
inline constexpr uint8_t kEndHeaders = 0x4;
inline constexpr uint8_t kAckFlag = 0x1;

// A frame: 24-bit length, type, flags, 31-bit stream id, payload.
inline std::string Http2Frame(uint8_t type, uint8_t flags, uint32_t stream,
                              absl::string_view payload) {
  const size_t n = payload.size();
  std::string frame(kFrameHeaderBytes, '\0');
  frame[0] = static_cast<char>(n >> 16);
  frame[1] = static_cast<char>(n >> 8);
  frame[2] = static_cast<char>(n);
  frame[3] = static_cast<char>(type);
  frame[4] = static_cast<char>(flags);
  for (int i = 0; i < 4; ++i) {
    frame[5 + i] = static_cast<char>(stream >> (24 - 8 * i));
  }
  return frame.append(payload.data(), payload.size());
}

// A frame on stream 0 with no flags.
inline std::string Http2Frame(uint8_t type, absl::string_view payload) {
  return Http2Frame(type, 0, 0, payload);
}

// A client's first bytes: the preface, its SETTINGS, and the
// acknowledgement of the daemon's, sent ahead (the daemon hands a
// connection to gRPC only once it has it: daemon/http2_gate.h).
inline std::string ClientHello() {
  return std::string(kHttp2Preface) + Http2Frame(kSettingsFrame, "") +
         Http2Frame(kSettingsFrame, kAckFlag, 0, "");
}

inline uint32_t BigEndian32(absl::string_view bytes) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(bytes[i]);
  return v;
}

// What one flooding connection saw of the daemon.
struct PingFlood {
  int64_t bytes_sent = 0;
  bool goaway = false;
  uint32_t goaway_error = 0;
  std::string goaway_debug;
  bool closed = false;  // the daemon closed the connection
};

// The first GOAWAY among the frames in `received`, into `flood`.
inline void ReadGoaway(const std::string& received, PingFlood& flood) {
  // The frames: 24-bit length, type, flags, 31-bit stream id, payload.
  for (size_t at = 0; at + kFrameHeaderBytes <= received.size();) {
    const absl::string_view rest = absl::string_view(received).substr(at);
    const size_t length = BigEndian32(rest) >> 8;
    if (rest.size() < kFrameHeaderBytes + length) break;
    const absl::string_view payload = rest.substr(kFrameHeaderBytes, length);
    if (static_cast<uint8_t>(rest[3]) == kGoawayFrame && length >= 8 &&
        !flood.goaway) {
      flood.goaway = true;
      flood.goaway_error = BigEndian32(payload.substr(4));
      flood.goaway_debug = std::string(payload.substr(8));
    }
    at += kFrameHeaderBytes + length;
  }
}

// Connects to the gRPC socket and sends PINGs until the daemon closes the
// connection, `max_bytes` are sent, or `timeout` passes. With
// `read_replies` it reads whenever the daemon has sent something and keeps
// the first GOAWAY (SETTINGS, their ACKs and PING ACKs are skipped);
// without, it never reads, as the cheapest hostile client would not.
inline PingFlood FloodWithPings(const std::string& socket_path,
                                int64_t max_bytes, absl::Duration timeout,
                                bool read_replies) {
  PingFlood flood;
  auto fd = common::ConnectUnix(socket_path);
  if (!fd.ok()) return flood;
  std::string burst = ClientHello() + Http2Frame(kPingFrame, "flood-00");
  size_t unsent = burst.size();
  const std::string pings = [] {
    std::string many;
    for (int i = 0; i < 1024; ++i) many += Http2Frame(kPingFrame, "flood-01");
    return many;
  }();
  std::string received;
  const absl::Time deadline = absl::Now() + timeout;
  bool writable = true;
  bool eof = false;
  while (!eof && absl::Now() < deadline) {
    if (writable && !flood.closed && flood.bytes_sent < max_bytes) {
      if (unsent == 0) {
        burst = pings;
        unsent = burst.size();
      }
      const ssize_t n = ::send(fd->get(), burst.data() + burst.size() - unsent,
                               unsent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        flood.bytes_sent += n;
        unsent -= static_cast<size_t>(n);
        continue;
      }
      // EPIPE or ECONNRESET: the daemon closed it; what it sent before
      // is still there to read.
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        flood.closed = true;
      }
    }
    pollfd p = {fd->get(), static_cast<short>(read_replies ? POLLIN : 0), 0};
    if (!flood.closed && flood.bytes_sent < max_bytes) p.events |= POLLOUT;
    const int ready = ::poll(&p, 1, 100);
    writable = ready > 0 && (p.revents & POLLOUT) != 0;
    if (!read_replies) {
      if (ready > 0 && (p.revents & (POLLHUP | POLLERR)) != 0) {
        flood.closed = eof = true;
      }
      continue;
    }
    if (ready <= 0 || (p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
      continue;
    }
    char buf[16384];
    const ssize_t n = ::recv(fd->get(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      flood.closed = eof = true;
    }
    if (n > 0) received.append(buf, static_cast<size_t>(n));
  }
  ReadGoaway(received, flood);
  return flood;
}

// Sends `bytes` on a fresh connection to the daemon's gRPC socket and reads
// what the daemon sends for `wait`, or until it closes it: the GOAWAY's
// debug data, empty if none.
inline std::string GoawayAfter(int fd, const std::string& bytes,
                               absl::Duration wait) {
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string received;
  const absl::Time deadline = absl::Now() + wait;
  while (absl::Now() < deadline) {
    pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    received.append(buf, static_cast<size_t>(n));
  }
  PingFlood seen;
  ReadGoaway(received, seen);
  return seen.goaway_debug;
}

// GoawayAfter a client's first bytes (ClientHello).
inline std::string GoawayWithin(int fd, absl::Duration wait) {
  return GoawayAfter(fd, ClientHello(), wait);
}

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_RAW_HTTP2_H_
