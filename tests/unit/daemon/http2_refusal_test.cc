#include "daemon/http2_refusal.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                  const std::string& payload) {
  std::string f;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  f.push_back(static_cast<char>(n >> 16));
  f.push_back(static_cast<char>(n >> 8));
  f.push_back(static_cast<char>(n));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  for (int shift = 24; shift >= 0; shift -= 8) {
    f.push_back(static_cast<char>(stream >> shift));
  }
  return f + payload;
}

// The frames of `bytes`: (type, flags, stream, payload).
struct Parsed {
  uint8_t type;
  uint8_t flags;
  uint32_t stream;
  std::string payload;
};
std::vector<Parsed> Frames(const std::string& bytes) {
  std::vector<Parsed> out;
  size_t at = 0;
  while (bytes.size() - at >= 9) {
    const auto b = [&](size_t i) {
      return static_cast<uint8_t>(bytes[at + i]);
    };
    const size_t n = (size_t{b(0)} << 16) | (size_t{b(1)} << 8) | b(2);
    const uint32_t stream = (uint32_t{b(5)} << 24 | uint32_t{b(6)} << 16 |
                             uint32_t{b(7)} << 8 | b(8)) &
                            0x7fffffff;
    out.push_back({b(3), b(4), stream, bytes.substr(at + 9, n)});
    at += 9 + n;
  }
  EXPECT_EQ(at, bytes.size()) << "a partial frame";
  return out;
}

// What a gRPC client sends for one call: preface, settings, a window
// update and the call's headers (their HPACK content does not matter).
std::string ClientCall(uint32_t stream) {
  return std::string(kPreface) + Frame(0x4, 0, 0, "") +
         Frame(0x8, 0, 0, std::string("\0\0\x10\0", 4)) +
         Frame(0x1, 0x4, stream, "\x83\x86some-hpack");
}

TEST(Http2Refusal, ACallIsAnsweredWithResourceExhaustedNamingTheLimit) {
  Http2Refusal refusal("uid 7 already has the maximum (limits.x_per_uid)");
  auto reply = refusal.Feed(ClientCall(1));
  ASSERT_TRUE(reply.ok()) << reply.status();
  const auto frames = Frames(*reply);
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(frames[0].type, 0x4);   // SETTINGS
  EXPECT_EQ(frames[0].flags, 0x1);  // ACK
  EXPECT_EQ(frames[1].type, 0x1);   // HEADERS
  EXPECT_EQ(frames[1].flags, 0x5);  // END_STREAM | END_HEADERS
  EXPECT_EQ(frames[1].stream, 1u);
  EXPECT_THAT(frames[1].payload, HasSubstr("grpc-status\x01"
                                           "8"));
  EXPECT_THAT(frames[1].payload, HasSubstr("limits.x_per_uid"));
  EXPECT_EQ(refusal.answered(), 1);
  const auto goaway = Frames(refusal.Goaway());
  ASSERT_EQ(goaway.size(), 1u);
  EXPECT_EQ(goaway[0].type, 0x7);
  EXPECT_EQ(goaway[0].payload.substr(0, 4), std::string("\0\0\0\x01", 4))
      << "the last stream answered";
  EXPECT_THAT(goaway[0].payload, HasSubstr("limits.x_per_uid"));
}

TEST(Http2Refusal, BytesThatArriveOneByOneGetTheSameAnswer) {
  Http2Refusal whole("why"), piecewise("why");
  const std::string call = ClientCall(3);
  std::string a = *whole.Feed(call);
  std::string b;
  for (char c : call) {
    auto r = piecewise.Feed(std::string(1, c));
    ASSERT_TRUE(r.ok()) << r.status();
    b += *r;
  }
  EXPECT_EQ(a, b);
  EXPECT_EQ(piecewise.answered(), 1);
}

TEST(Http2Refusal, EachNewCallIsAnsweredOnceAndOldStreamsNotAgain) {
  Http2Refusal refusal("why");
  ASSERT_TRUE(refusal.Feed(ClientCall(1)).ok());
  auto more = refusal.Feed(Frame(0x1, 0x4, 1, "x") + Frame(0x1, 0x4, 3, "x") +
                           Frame(0x1, 0x4, 2, "x"));  // even: not a client's
  ASSERT_TRUE(more.ok());
  const auto frames = Frames(*more);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0].stream, 3u);
  EXPECT_EQ(refusal.answered(), 2);
}

TEST(Http2Refusal, WhatIsNotHttp2IsAnError) {
  Http2Refusal refusal("why");
  EXPECT_FALSE(refusal.Feed("GET / HTTP/1.1\r\n").ok());
  Http2Refusal huge("why");
  // A frame header announcing 16 MiB - 1: never buffered.
  EXPECT_FALSE(huge.Feed(std::string(kPreface) +
                         Frame(0x0, 0, 1, "").replace(0, 3, "\xff\xff\xff"))
                   .ok());
}

TEST(Http2Refusal, AMessageOutsidePrintableAsciiIsPercentEncoded) {
  Http2Refusal refusal("50% of \xc3\xa9");
  auto reply = refusal.Feed(ClientCall(1));
  ASSERT_TRUE(reply.ok());
  EXPECT_THAT(*reply, HasSubstr("50%25 of %C3%A9"));
}

}  // namespace
}  // namespace deltad::daemon
