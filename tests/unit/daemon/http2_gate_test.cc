#include "daemon/http2_gate.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/raw_http2.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;
using testing_util::Http2Frame;
using testing_util::kAckFlag;
using testing_util::kEndHeaders;
using testing_util::kHeadersFrame;
using testing_util::kHttp2Preface;
using testing_util::kSettingsFrame;

// What a gRPC client sends first: the preface and its SETTINGS.
std::string Hello() {
  return std::string(kHttp2Preface) + Http2Frame(kSettingsFrame, "");
}

std::string Calls(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    out += Http2Frame(kHeadersFrame, kEndHeaders, 1 + 2 * i, "headers");
  }
  return out;
}

const std::string kAck = Http2Frame(kSettingsFrame, kAckFlag, 0, "");

TEST(Http2Gate, TheDaemonsSettingsAreAnEmptySettingsFrame) {
  EXPECT_EQ(Http2Gate::Settings(), Http2Frame(kSettingsFrame, ""));
}

TEST(Http2Gate, AClientWaitsUntilItAcknowledgesAndThenPasses) {
  Http2Gate gate(4);
  EXPECT_EQ(gate.Look(""), Http2Gate::Verdict::kWait);
  EXPECT_EQ(gate.Look(std::string(kHttp2Preface).substr(0, 10)),
            Http2Gate::Verdict::kWait);
  EXPECT_EQ(gate.Look(Hello()), Http2Gate::Verdict::kWait);
  // A frame cut short is waited for too.
  EXPECT_EQ(gate.Look(Hello() + kAck.substr(0, 5)), Http2Gate::Verdict::kWait);
  EXPECT_EQ(gate.Look(Hello() + kAck), Http2Gate::Verdict::kPass);
}

TEST(Http2Gate, CallsUpToTheLimitBeforeTheAcknowledgementPass) {
  Http2Gate gate(4);
  EXPECT_EQ(gate.Look(Hello() + Calls(4)), Http2Gate::Verdict::kWait);
  EXPECT_EQ(gate.Look(Hello() + Calls(4) + kAck), Http2Gate::Verdict::kPass);
  // After it, gRPC counts: the gate looks no further.
  EXPECT_EQ(gate.Look(Hello() + kAck + Calls(100)), Http2Gate::Verdict::kPass);
}

TEST(Http2Gate, MoreCallsBeforeTheAcknowledgementAreRefusedNamingTheLimit) {
  Http2Gate gate(4);
  EXPECT_EQ(gate.Look(Hello() + Calls(5) + kAck), Http2Gate::Verdict::kRefuse);
  EXPECT_THAT(gate.why(), HasSubstr("more than 4 calls"));
  EXPECT_THAT(gate.why(), HasSubstr("limits.max_concurrent_streams"));
  EXPECT_STREQ(gate.limit(), "max_concurrent_streams");
}

TEST(Http2Gate, ABuffersWorthWithoutAnAcknowledgementIsRefused) {
  Http2Gate gate(4);
  std::string sent = Hello();
  while (sent.size() < Http2Gate::kMostBytes) {
    sent += Http2Frame(/*PING*/ 0x6, "12345678");
  }
  EXPECT_EQ(gate.Look(sent), Http2Gate::Verdict::kRefuse);
  EXPECT_THAT(gate.why(), HasSubstr("without acknowledging"));
  EXPECT_THAT(gate.why(), HasSubstr("limits.settings_ack_ms"));
  EXPECT_STREQ(gate.limit(), "settings_ack_ms");
}

TEST(Http2Gate, WhatIsNotHttp2IsLeftToGrpc) {
  Http2Gate gate(4);
  EXPECT_EQ(gate.Look("GET / HTTP/1.1\r\n\r\n"), Http2Gate::Verdict::kPass);
}

}  // namespace
}  // namespace deltad::daemon
