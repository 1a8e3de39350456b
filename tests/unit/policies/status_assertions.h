#ifndef DELTAD_TESTS_UNIT_POLICIES_STATUS_ASSERTIONS_H_
#define DELTAD_TESTS_UNIT_POLICIES_STATUS_ASSERTIONS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace deltad::policy::testing_util {

inline testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.ToString();
}

// The status has `code` and its message contains every one of `parts`.
inline testing::AssertionResult IsError(const absl::Status& s,
                                        absl::StatusCode code,
                                        std::vector<std::string> parts = {}) {
  if (s.code() != code) {
    return testing::AssertionFailure()
           << "expected code " << absl::StatusCodeToString(code) << ", got "
           << s.ToString();
  }
  const std::string message(s.message());
  for (const std::string& p : parts) {
    if (message.find(p) == std::string::npos) {
      return testing::AssertionFailure()
             << "message \"" << message << "\" lacks \"" << p << "\"";
    }
  }
  return testing::AssertionSuccess();
}

}  // namespace deltad::policy::testing_util

#endif  // DELTAD_TESTS_UNIT_POLICIES_STATUS_ASSERTIONS_H_
