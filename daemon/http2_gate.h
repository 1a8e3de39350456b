#ifndef DELTAD_DAEMON_HTTP2_GATE_H_
#define DELTAD_DAEMON_HTTP2_GATE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace deltad::daemon {

// What a new gRPC connection sent before it acknowledged the daemon's
// SETTINGS, read before gRPC takes the connection.
//
// gRPC (1.51) holds a client to limits.max_concurrent_streams only once
// the client has acknowledged the SETTINGS that announce it, and sets no
// deadline for that: a client that never acknowledges them may open as
// many calls as it likes, and each buffers what it sends (bench/
// stream_flood.py: +346 MiB). So the listener sends a SETTINGS of its own
// (empty) as soon as it accepts a connection and reads, without taking
// them, the client's first bytes: a client that acknowledges it with at
// most `max_calls` calls opened before is handed to gRPC, whose own
// SETTINGS are out by the time gRPC reads that acknowledgement, which it
// takes for theirs (an acknowledgement carries no id): from there on gRPC
// holds the client to its limit. A client that opens more calls first,
// or sends a buffer's worth without acknowledging, is refused. Parses only
// frame headers. Not thread safe.
class Http2Gate {
 public:
  // At most this much is read before the acknowledgement: the preface, a
  // SETTINGS, a window update, the headers of `max_calls` calls and
  // 65,535 bytes of their data (the most HTTP/2 lets a client send before
  // the server opens its window) fit several times over.
  static constexpr size_t kMostBytes = 256 << 10;

  explicit Http2Gate(size_t max_calls) : max_calls_(max_calls) {}

  // The SETTINGS frame the daemon sends first (empty).
  static std::string Settings();

  enum class Verdict {
    kWait,    // not acknowledged yet: read again when more came
    kPass,    // acknowledged within the limit, or not HTTP/2 (gRPC's)
    kRefuse,  // too many calls, or too many bytes, first (why())
  };
  // Looks at all the client sent so far (peeked: the bytes stay in the
  // socket for gRPC), from its first byte.
  Verdict Look(absl::string_view sent);

  // Why the connection was refused, and the limit's name:
  // "max_concurrent_streams" (calls) or "settings_ack_ms" (bytes).
  const std::string& why() const { return why_; }
  const char* limit() const { return limit_; }

 private:
  size_t max_calls_;
  std::string why_;
  const char* limit_ = "";
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_HTTP2_GATE_H_
