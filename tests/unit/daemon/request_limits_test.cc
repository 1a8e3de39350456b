#include "daemon/request_limits.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

TEST(RequestLimits, ALabelOverTheLimitIsRefusedNamingFieldAndLimit) {
  RequestLimits limits;
  limits.max_label_bytes = 16;
  v1::OpenSessionRequest r;
  r.set_label(std::string(16, 'a'));
  EXPECT_TRUE(Validate(r, limits).ok());
  r.set_label(std::string(17, 'a'));
  const absl::Status s = Validate(r, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("OpenSessionRequest.label"));
  EXPECT_THAT(s.message(), HasSubstr("limits.max_label_bytes"));
}

TEST(RequestLimits, ALabelWithControlCharactersIsRefused) {
  v1::OpenSessionRequest r;
  r.set_label("job\x1b[2Jrank 0");
  const absl::Status s = Validate(r, RequestLimits{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("control character"));
}

TEST(RequestLimits, ARequestPastMaxMessageBytesIsResourceExhausted) {
  RequestLimits limits;
  limits.max_message_bytes = 1000;
  EXPECT_TRUE(CheckMessageBytes(1000, limits).ok());
  const absl::Status s = CheckMessageBytes(1001, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("1001 bytes"));
  EXPECT_THAT(s.message(), HasSubstr("limits.max_message_bytes"));
}

TEST(RequestLimits, RequestsWithoutStringsOfTheirOwnPass) {
  v1::ReleaseRequest release;
  release.set_session_token(std::string(4000, 'x'));  // the Node's to refuse
  EXPECT_TRUE(Validate(release, RequestLimits{}).ok());
}

}  // namespace
}  // namespace deltad::daemon
