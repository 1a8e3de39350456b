// The client's side of the version handshake: what it makes of the
// protocol a daemon says it speaks (the daemon's side is tested in
// memory_manager_service_test).
#include "common/protocol_version.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::common {
namespace {

using ::testing::HasSubstr;

TEST(DaemonProtocolMismatch,
     ADaemonOfThisProtocolOrOneBeforeTheFieldIsAccepted) {
  EXPECT_EQ(DaemonProtocolMismatch("0.1.0", "0.1.0", kProtocolVersion), "");
  // 0: a daemon older than the field, which speaks protocol 1.
  static_assert(kProtocolVersion == 1,
                "a daemon that sends 0 speaks protocol 1: revisit this case");
  EXPECT_EQ(DaemonProtocolMismatch("0.1.0", "", 0), "");
}

TEST(DaemonProtocolMismatch,
     ADaemonOfAnotherProtocolIsRefusedNamingBothVersions) {
  const uint32_t other = kProtocolVersion + 1;
  const std::string why = DaemonProtocolMismatch("0.1.0", "0.9.0", other);
  EXPECT_THAT(why, HasSubstr("the client library 0.1.0 speaks protocol " +
                             std::to_string(kProtocolVersion)));
  EXPECT_THAT(
      why, HasSubstr("deltad 0.9.0 speaks protocol " + std::to_string(other)));
  EXPECT_THAT(why, HasSubstr("upgrade the older one"));
  // A daemon without a version string is still named.
  EXPECT_THAT(DaemonProtocolMismatch("0.1.0", "", other),
              HasSubstr("deltad (of a version before 0.1.0) speaks protocol"));
}

}  // namespace
}  // namespace deltad::common
