#include "daemon/library_log.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Lines(std::FILE* f) {
  std::rewind(f);
  std::string all;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) all.append(buf, n);
  std::vector<std::string> out = absl::StrSplit(all, '\n', absl::SkipEmpty());
  return out;
}

TEST(LibraryLog, ALineNamesTheLibrarySeverityAndPlace) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  LibraryLog log(f);
  log.Write("grpc", "error", "chttp2_transport.cc", 1234,
            "too_many_pings: GOAWAY sent");
  const std::vector<std::string> lines = Lines(f);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0],
            "deltad: grpc error: too_many_pings: GOAWAY sent "
            "(chttp2_transport.cc:1234)");
  std::fclose(f);
}

TEST(LibraryLog, AFloodIsHeldBackAndCounted) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  LibraryLog log(f);
  for (int i = 0; i < 10'000; ++i) {
    log.Write("protobuf", "error", "wire_format_lite.cc", 581,
              "String field contains invalid UTF-8 data");
  }
  const std::vector<std::string> lines = Lines(f);
  // A burst gets through, the rest of the window's lines do not.
  EXPECT_EQ(lines.size(), static_cast<size_t>(LibraryLog::kBurst));
  std::fclose(f);
}

// The lines gRPC 1.51's chttp2 writes for the GOAWAYs of
// grpc_chttp2_add_ping_strike and of its memory reclaimer, and others it
// writes that are no refusal.
TEST(LibraryLog, OnlyTheGoawayLinesOfALimitAreTakenForOne) {
  EXPECT_STREQ(GoawayLimit("unix:/run/deltad/deltad.sock: Sending goaway "
                           "err=UNKNOWN:too_many_pings {http2_error:11, "
                           "created_time:\"2024-01-01\"}"),
               "max_ping_strikes");
  EXPECT_STREQ(GoawayLimit("fd:31: Sending goaway err=UNKNOWN:Buffers full "
                           "{http2_error:11, created_time:\"2024-01-01\"}"),
               "grpc_memory_bytes");
  EXPECT_EQ(GoawayLimit("unix:/run/deltad/deltad.sock: Sending goaway "
                        "err=UNKNOWN:Server shutdown {created_time:\"2024\"}"),
            nullptr);
  EXPECT_EQ(GoawayLimit("unix:/tmp/s: Received a GOAWAY with error code "
                        "ENHANCE_YOUR_CALM and debug data equal to "
                        "\"too_many_pings\""),
            nullptr);
  // The text of a limit before the GOAWAY (in a peer's name) is not one.
  EXPECT_EQ(GoawayLimit("unix:/tmp/Buffers full: Sending goaway "
                        "err=UNKNOWN:Server shutdown {}"),
            nullptr);
}

}  // namespace
}  // namespace deltad::daemon
