#include "daemon/request_parser.h"

#include <string>

#include "deltad/v1/memory_manager.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

// The wire bytes of a message whose string field `number` holds `bytes`,
// which protobuf's own serializer would refuse to write when not UTF-8.
std::string WithRawString(std::string wire, int number,
                          const std::string& bytes) {
  wire.push_back(static_cast<char>((number << 3) | 2));
  wire.push_back(static_cast<char>(bytes.size()));  // under 128 here
  return wire + bytes;
}

TEST(ParseRequest, AValidRequestParses) {
  v1::OpenSessionRequest sent;
  sent.set_gpu(3);
  sent.set_label("job 7 rank 0 \xc3\xa9t\xc3\xa9");
  v1::OpenSessionRequest got;
  ASSERT_TRUE(ParseRequest(sent.SerializeAsString(), got).ok());
  EXPECT_EQ(got.gpu(), 3);
  EXPECT_EQ(got.label(), sent.label());
}

TEST(ParseRequest, InvalidUtf8IsInvalidArgumentNamingTheField) {
  v1::OpenSessionRequest base;
  base.set_gpu(1);
  const std::string wire =
      WithRawString(base.SerializeAsString(), 5, "bad \xff label");
  v1::OpenSessionRequest got;
  const absl::Status s = ParseRequest(wire, got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("OpenSessionRequest.label"));
  EXPECT_THAT(s.message(), HasSubstr("UTF-8"));
}

TEST(ParseRequest, InvalidUtf8AfterANestedBatchIsFound) {
  v1::SessionMessage base;
  base.mutable_batch()->add_created()->set_tensor_id(1);
  const std::string wire =
      WithRawString(base.SerializeAsString(), 1, "\xc0\xaf");  // overlong
  v1::SessionMessage got;
  const absl::Status s = ParseRequest(wire, got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("SessionMessage.session_token"));
}

TEST(ParseRequest, BytesThatAreNoMessageAreInvalidArgumentNamingTheType) {
  v1::ReleaseRequest got;
  // A length-delimited field that claims more bytes than there are.
  const absl::Status s = ParseRequest(std::string("\x1a\x7f\x01", 3), got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("deltad.v1.ReleaseRequest"));
}

TEST(IsValidUtf8, AcceptsWellFormedAndRefusesMalformedSequences) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("\xc3\xa9"));          // U+00E9
  EXPECT_TRUE(IsValidUtf8("\xe2\x82\xac"));      // U+20AC
  EXPECT_TRUE(IsValidUtf8("\xf0\x9f\x98\x80"));  // U+1F600
  EXPECT_TRUE(IsValidUtf8("\xf4\x8f\xbf\xbf"));  // U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xff"));
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // truncated
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xe0\x80\xaf"));      // overlong
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xe2\x28\xa1"));      // bad continuation
}

}  // namespace
}  // namespace deltad::daemon
