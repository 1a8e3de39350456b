#ifndef DELTAD_TESTS_INTEGRATION_BAD_INPUT_FIXTURE_H_
#define DELTAD_TESTS_INTEGRATION_BAD_INPUT_FIXTURE_H_

#include "absl/strings/str_cat.h"
#include "tests/integration/daemon_test.h"

namespace deltad::testing_util {

// The limits BadInputTest's daemon runs with.
inline constexpr int kMaxBatchEvents = 8;
inline constexpr int kMaxMessageBytes = 64 * 1024;

// Bad input against the real deltad process: every malformed, forged,
// oversized or out-of-order request gets a specific status code and a
// message that says what was wrong, never touches another session, and
// leaves the daemon serving. Each test starts its own daemon (two
// simulated 8 GiB GPUs, a 1 GiB host pool of 64 MiB slabs, and low limits
// from a config file) and ends by checking that it is still up and that
// SIGTERM stops it cleanly (exit 0: no crash, and under ASan no leak).
class BadInputTest : public DaemonTest {
 protected:
  void SetUp() override {
    StartDaemonWithLimits(
        absl::StrCat("max_batch_events: ", kMaxBatchEvents,
                     " max_message_bytes: ", kMaxMessageBytes));
  }
};

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_BAD_INPUT_FIXTURE_H_
