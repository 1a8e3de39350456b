#include "daemon/http2_refusal.h"

#include <utility>

namespace deltad::daemon {

namespace {

// RFC 9113 and RFC 7541 (HPACK), as far as a refusal needs them.
constexpr absl::string_view kClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kFrameHeader = 9;
// A refused client sends its preface, settings, a window update and the
// calls' headers: frames of a few hundred bytes. More is not a client
// worth reading.
constexpr size_t kMaxPending = 64 << 10;
constexpr uint8_t kHeaders = 0x1;
constexpr uint8_t kSettings = 0x4;
constexpr uint8_t kGoaway = 0x7;
constexpr uint8_t kEndStream = 0x1;
constexpr uint8_t kAck = 0x1;
constexpr uint8_t kEndHeaders = 0x4;
constexpr uint32_t kEnhanceYourCalm = 0xb;
// gRPC's RESOURCE_EXHAUSTED.
constexpr absl::string_view kResourceExhausted = "8";

void PutBigEndian32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

uint32_t BigEndian(absl::string_view b, size_t at, size_t n) {
  uint32_t v = 0;
  for (size_t i = 0; i < n; ++i) {
    v = (v << 8) | static_cast<uint8_t>(b[at + i]);
  }
  return v;
}

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                  absl::string_view payload) {
  std::string frame;
  PutBigEndian32(frame, static_cast<uint32_t>(payload.size()) << 8 | type);
  frame.push_back(static_cast<char>(flags));
  PutBigEndian32(frame, stream & 0x7fffffff);
  frame.append(payload.data(), payload.size());
  return frame;
}

// An HPACK integer with an `prefix`-bit prefix, the first byte's other
// bits being `high`.
void PutHpackInt(std::string& out, uint8_t high, int prefix, size_t v) {
  const size_t max = (size_t{1} << prefix) - 1;
  if (v < max) {
    out.push_back(static_cast<char>(high | v));
    return;
  }
  out.push_back(static_cast<char>(high | max));
  v -= max;
  while (v >= 128) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// A literal header field without indexing, new name, no Huffman coding.
void PutHeader(std::string& out, absl::string_view name,
               absl::string_view value) {
  out.push_back(0);
  PutHpackInt(out, 0, 7, name.size());
  out.append(name.data(), name.size());
  PutHpackInt(out, 0, 7, value.size());
  out.append(value.data(), value.size());
}

// grpc-message's encoding: percent-encoded outside printable ASCII.
std::string PercentEncoded(absl::string_view s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (char c : s) {
    const auto u = static_cast<uint8_t>(c);
    if (u >= 0x20 && u <= 0x7e && c != '%') {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 0xf]);
    }
  }
  return out;
}

}  // namespace

Http2Refusal::Http2Refusal(std::string why) : why_(std::move(why)) {}

std::string Http2Refusal::Preface() { return Frame(kSettings, 0, 0, ""); }

std::string Http2Refusal::Refusal(uint32_t stream) const {
  std::string block;
  block.push_back(static_cast<char>(0x88));  // :status 200 (static index 8)
  PutHeader(block, "content-type", "application/grpc");
  PutHeader(block, "grpc-status", kResourceExhausted);
  PutHeader(block, "grpc-message", PercentEncoded(why_.substr(0, 1024)));
  return Frame(kHeaders, kEndStream | kEndHeaders, stream, block);
}

absl::StatusOr<std::string> Http2Refusal::Feed(absl::string_view bytes) {
  pending_.append(bytes.data(), bytes.size());
  std::string out;
  size_t at = 0;
  if (!preface_seen_) {
    const size_t n = std::min(pending_.size(), kClientPreface.size());
    if (absl::string_view(pending_).substr(0, n) !=
        kClientPreface.substr(0, n)) {
      return absl::InvalidArgumentError("not an HTTP/2 client preface");
    }
    if (n < kClientPreface.size()) return out;
    preface_seen_ = true;
    at = kClientPreface.size();
  }
  while (pending_.size() - at >= kFrameHeader) {
    const absl::string_view p(pending_);
    const size_t length = BigEndian(p, at, 3);
    const auto type = static_cast<uint8_t>(p[at + 3]);
    const auto flags = static_cast<uint8_t>(p[at + 4]);
    const uint32_t stream = BigEndian(p, at + 5, 4) & 0x7fffffff;
    if (kFrameHeader + length > kMaxPending) {
      return absl::ResourceExhaustedError("an HTTP/2 frame too large");
    }
    if (pending_.size() - at < kFrameHeader + length) break;
    if (type == kSettings && (flags & kAck) == 0) {
      out += Frame(kSettings, kAck, 0, "");
    } else if (type == kHeaders && stream > last_stream_ && (stream & 1) == 1) {
      // A call: refused whatever it asks (its headers need no decoding).
      last_stream_ = stream;
      out += Refusal(stream);
      ++answered_;
    }
    at += kFrameHeader + length;
  }
  pending_.erase(0, at);
  if (pending_.size() > kMaxPending) {
    return absl::ResourceExhaustedError("too much unparsed HTTP/2");
  }
  return out;
}

std::string Http2Refusal::Goaway() const {
  std::string payload;
  PutBigEndian32(payload, last_stream_);
  PutBigEndian32(payload, kEnhanceYourCalm);
  // The frame's debug data; a client may show it with its error.
  payload += why_.substr(0, 1024);
  return Frame(kGoaway, 0, 0, payload);
}

}  // namespace deltad::daemon
