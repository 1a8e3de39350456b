#include "daemon/release_replies.h"

#include <chrono>
#include <future>
#include <thread>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using Clock = std::chrono::system_clock;

Clock::time_point Soon() { return Clock::now() + std::chrono::seconds(5); }

// An answer that says which application it came from.
ReleaseReplies::Outcome Answer(int* applied) {
  v1::ReleaseResponse r;
  r.set_bytes(++*applied);
  return {r};
}

TEST(ReleaseReplies, ACallSentAgainGetsTheFirstAnswerAndIsNotAppliedTwice) {
  ReleaseReplies replies;
  int applied = 0;
  auto first = replies.Run(1, 1, Soon(), [&] { return Answer(&applied); });
  auto again = replies.Run(1, 1, Soon(), [&] { return Answer(&applied); });
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(applied, 1);
  EXPECT_EQ(again->bytes(), first->bytes());
  auto next = replies.Run(1, 2, Soon(), [&] { return Answer(&applied); });
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(applied, 2);
  EXPECT_EQ(next->bytes(), 2);
}

TEST(ReleaseReplies, AnErrorIsAnsweredAgainToo) {
  ReleaseReplies replies;
  int applied = 0;
  auto fail = [&]() -> ReleaseReplies::Outcome {
    ++applied;
    return {absl::InvalidArgumentError("batch refused")};
  };
  EXPECT_EQ(replies.Run(1, 1, Soon(), fail).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(replies.Run(1, 1, Soon(), fail).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(applied, 1);
}

TEST(ReleaseReplies, ACallThatChangedNothingIsAppliedWhenSentAgain) {
  ReleaseReplies replies;
  int applied = 0;
  auto not_yet = replies.Run(1, 1, Soon(), [] {
    return ReleaseReplies::Outcome{absl::DeadlineExceededError("waiting"),
                                   /*applied=*/false};
  });
  EXPECT_EQ(not_yet.status().code(), absl::StatusCode::kDeadlineExceeded);
  auto now = replies.Run(1, 1, Soon(), [&] { return Answer(&applied); });
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(applied, 1);
}

TEST(ReleaseReplies, AnOlderNumberIsRefusedAndUnnumberedCallsAlwaysApply) {
  ReleaseReplies replies;
  int applied = 0;
  ASSERT_TRUE(replies.Run(1, 5, Soon(), [&] { return Answer(&applied); }).ok());
  EXPECT_EQ(replies.Run(1, 4, Soon(), [&] { return Answer(&applied); })
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(replies.Run(1, 0, Soon(), [&] { return Answer(&applied); }).ok());
  ASSERT_TRUE(replies.Run(1, 0, Soon(), [&] { return Answer(&applied); }).ok());
  EXPECT_EQ(applied, 3);
}

TEST(ReleaseReplies, SessionsAreNumberedApartAndForgotten) {
  ReleaseReplies replies;
  int applied = 0;
  ASSERT_TRUE(replies.Run(1, 1, Soon(), [&] { return Answer(&applied); }).ok());
  ASSERT_TRUE(replies.Run(2, 1, Soon(), [&] { return Answer(&applied); }).ok());
  EXPECT_EQ(applied, 2);
  replies.Forget(1);
  ASSERT_TRUE(replies.Run(1, 1, Soon(), [&] { return Answer(&applied); }).ok());
  EXPECT_EQ(applied, 3);
}

TEST(ReleaseReplies, ACallWaitsForTheSessionsRunningOneUntilItsDeadline) {
  ReleaseReplies replies;
  std::promise<void> entered, finish;
  auto running = std::async(std::launch::async, [&] {
    return replies.Run(1, 1, Soon(), [&] {
      entered.set_value();
      finish.get_future().wait();
      int applied = 0;
      return Answer(&applied);
    });
  });
  entered.get_future().wait();
  int applied = 0;
  auto blocked = replies.Run(1, 1, Clock::now() + std::chrono::milliseconds(50),
                             [&] { return Answer(&applied); });
  EXPECT_EQ(blocked.status().code(), absl::StatusCode::kDeadlineExceeded);
  finish.set_value();
  ASSERT_TRUE(running.get().ok());
  // Once it ended, the same call gets its answer.
  auto again = replies.Run(1, 1, Soon(), [&] { return Answer(&applied); });
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(applied, 0);
}

}  // namespace
}  // namespace deltad::daemon
