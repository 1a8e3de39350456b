#include "daemon/http2_gate.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {
namespace {

constexpr absl::string_view kClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kFrameHeaderBytes = 9;
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kAck = 0x1;

}  // namespace

std::string Http2Gate::Settings() {
  return std::string("\0\0\0\x04\0\0\0\0\0", kFrameHeaderBytes);
}

Http2Gate::Verdict Http2Gate::Look(absl::string_view sent) {
  const size_t preface = std::min(sent.size(), kClientPreface.size());
  // Not HTTP/2: gRPC says so to the client.
  if (sent.substr(0, preface) != kClientPreface.substr(0, preface)) {
    return Verdict::kPass;
  }
  size_t calls = 0;
  size_t at = kClientPreface.size();
  while (at + kFrameHeaderBytes <= sent.size()) {
    const auto byte = [&](size_t i) {
      return static_cast<uint8_t>(sent[at + i]);
    };
    const size_t length =
        (size_t{byte(0)} << 16) | (size_t{byte(1)} << 8) | size_t{byte(2)};
    const uint8_t type = byte(3);
    const uint8_t flags = byte(4);
    if (type == kSettings && (flags & kAck) != 0) return Verdict::kPass;
    // A call is opened by its HEADERS (CONTINUATION and trailers aside:
    // counted as calls too, which only errs towards refusing sooner).
    if (type == kHeaders && ++calls > max_calls_) {
      limit_ = "max_concurrent_streams";
      why_ = absl::StrCat("a connection opened more than ", max_calls_,
                          " calls before it acknowledged the daemon's SETTINGS "
                          "(limits.max_concurrent_streams)");
      return Verdict::kRefuse;
    }
    at += kFrameHeaderBytes + length;
  }
  if (sent.size() >= kMostBytes) {
    limit_ = "settings_ack_ms";
    why_ = absl::StrCat("a connection sent ", kMostBytes,
                        " bytes without acknowledging the daemon's SETTINGS "
                        "(limits.settings_ack_ms)");
    return Verdict::kRefuse;
  }
  return Verdict::kWait;
}

}  // namespace deltad::daemon
