#include "tools/call_retry.h"

#include <vector>

#include "gtest/gtest.h"

namespace deltad::tools {
namespace {

// A clock that moves only when the retry loop waits.
struct FakeClock {
  absl::Time now = absl::UnixEpoch();
  std::vector<absl::Duration> waits;
  absl::Time Now() const { return now; }
  void Wait(absl::Duration d) {
    waits.push_back(d);
    now += d;
  }
};

grpc::Status CallFailing(FakeClock& clock, absl::Duration budget,
                         int unavailable, grpc::StatusCode then,
                         int* attempts) {
  *attempts = 0;
  return CallWithRetries(
      clock.now + budget,
      [&](absl::Time) {
        return ++*attempts <= unavailable
                   ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                  "GOAWAY received")
                   : grpc::Status(then, "");
      },
      RetryPolicy{}, [&] { return clock.Now(); },
      [&](absl::Duration d) { clock.Wait(d); });
}

TEST(CallWithRetries, RepeatsACallEndedUnavailableUntilItIsAnswered) {
  FakeClock clock;
  int attempts = 0;
  const grpc::Status s =
      CallFailing(clock, absl::Seconds(10), 2, grpc::StatusCode::OK, &attempts);
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(attempts, 3);
  EXPECT_EQ(clock.waits,
            (std::vector<absl::Duration>{absl::Milliseconds(100),
                                         absl::Milliseconds(200)}));
}

TEST(CallWithRetries, GivesUpAfterItsRetriesWithTheLastStatus) {
  FakeClock clock;
  int attempts = 0;
  const grpc::Status s = CallFailing(clock, absl::Seconds(10), 100,
                                     grpc::StatusCode::OK, &attempts);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(attempts, 4);  // the first and 3 retries
  EXPECT_EQ(clock.now - absl::UnixEpoch(), absl::Milliseconds(700));
}

TEST(CallWithRetries, RepeatsNothingButUnavailable) {
  FakeClock clock;
  int attempts = 0;
  for (grpc::StatusCode code :
       {grpc::StatusCode::DEADLINE_EXCEEDED, grpc::StatusCode::NOT_FOUND,
        grpc::StatusCode::RESOURCE_EXHAUSTED}) {
    const grpc::Status s =
        CallFailing(clock, absl::Seconds(10), 0, code, &attempts);
    EXPECT_EQ(s.error_code(), code);
    EXPECT_EQ(attempts, 1);
  }
  EXPECT_TRUE(clock.waits.empty());
}

TEST(CallWithRetries, StartsNoWaitThatWouldEndPastTheDeadline) {
  FakeClock clock;
  int attempts = 0;
  // 100 ms fits in 250; the next wait, 200 ms, would end past it.
  const grpc::Status s = CallFailing(clock, absl::Milliseconds(250), 100,
                                     grpc::StatusCode::OK, &attempts);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(attempts, 2);
  EXPECT_EQ(clock.waits,
            (std::vector<absl::Duration>{absl::Milliseconds(100)}));
}

}  // namespace
}  // namespace deltad::tools
