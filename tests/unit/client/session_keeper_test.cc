// The SessionKeeper's order of work, without a daemon: hooks that record
// what they were asked and answer as each test says.
#include "client/session_keeper.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::client {
namespace {

using std::chrono::milliseconds;
using ::testing::ElementsAre;

// Records the hooks' calls; `end_answers` and `attach_answers` are used up
// in order, and the last one stays.
class FakeSession {
 public:
  SessionKeeper::Hooks Hooks() {
    return {[this] {
              std::lock_guard<std::mutex> lock(mu_);
              calls_.push_back("end");
              return Next(end_answers_);
            },
            [this]() -> absl::StatusOr<std::string> {
              std::lock_guard<std::mutex> lock(mu_);
              calls_.push_back("attach");
              if (!Next(attach_answers_)) {
                return absl::UnavailableError("no daemon");
              }
              return std::string("session 1");
            },
            [this] { ++checks_; }};
  }
  void Answers(std::vector<bool> end, std::vector<bool> attach) {
    std::lock_guard<std::mutex> lock(mu_);
    end_answers_ = std::move(end);
    attach_answers_ = std::move(attach);
  }
  std::vector<std::string> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  // Waits (up to 10 s) until `n` calls were made.
  bool Calls(size_t n) {
    for (int i = 0; i < 1000; ++i) {
      if (calls().size() >= n) return true;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return false;
  }
  std::atomic<int> checks_{0};

 private:
  static bool Next(std::vector<bool>& answers) {
    if (answers.empty()) return true;
    const bool a = answers.front();
    if (answers.size() > 1) answers.erase(answers.begin());
    return a;
  }
  std::mutex mu_;
  std::vector<std::string> calls_;
  std::vector<bool> end_answers_;
  std::vector<bool> attach_answers_;
};

SessionKeeper::Options Fast() {
  SessionKeeper::Options o;
  o.first_retry = milliseconds(5);
  o.max_retry = milliseconds(20);
  o.check_every = milliseconds(5);
  return o;
}

TEST(SessionKeeper, ALostSessionIsEndedBeforeANewOneIsOpened) {
  FakeSession fake;
  SessionKeeper keeper(Fast(), fake.Hooks());
  keeper.Start(absl::OkStatus());
  keeper.Lost("the stream ended");
  ASSERT_TRUE(fake.Calls(2));
  std::this_thread::sleep_for(milliseconds(50));  // and nothing more
  EXPECT_THAT(fake.calls(), ElementsAre("end", "attach"));
  EXPECT_EQ(keeper.stats().sessions_lost, 1);
  EXPECT_EQ(keeper.stats().attach_failures, 0);
}

TEST(SessionKeeper, FailedAttemptsAreRetriedUntilOneAttaches) {
  FakeSession fake;
  fake.Answers({true}, {false, false, false, true});
  SessionKeeper keeper(Fast(), fake.Hooks());
  keeper.Start(absl::UnavailableError("no daemon at start"));
  ASSERT_TRUE(fake.Calls(4));
  std::this_thread::sleep_for(milliseconds(50));
  // Nothing was lost, so nothing is ended; attached, it stops trying.
  EXPECT_THAT(fake.calls(),
              ElementsAre("attach", "attach", "attach", "attach"));
  EXPECT_EQ(keeper.stats().attach_failures, 4);  // the start's and 3
  EXPECT_EQ(keeper.stats().sessions_lost, 0);
}

TEST(SessionKeeper, NoNewSessionOpensWhileTheLostOneCannotBeEnded) {
  FakeSession fake;
  fake.Answers({false, false, true}, {true});
  SessionKeeper keeper(Fast(), fake.Hooks());
  keeper.Start(absl::OkStatus());
  keeper.Lost("a Release call failed");
  ASSERT_TRUE(fake.Calls(4));
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_THAT(fake.calls(), ElementsAre("end", "end", "end", "attach"));
}

TEST(SessionKeeper, EachLossEndsItsSessionAndOpensAnother) {
  FakeSession fake;
  SessionKeeper keeper(Fast(), fake.Hooks());
  keeper.Start(absl::OkStatus());
  keeper.Lost("first");
  ASSERT_TRUE(fake.Calls(2));
  keeper.Lost("second");
  ASSERT_TRUE(fake.Calls(4));
  EXPECT_THAT(fake.calls(), ElementsAre("end", "attach", "end", "attach"));
  EXPECT_EQ(keeper.stats().sessions_lost, 2);
}

TEST(SessionKeeper, WithoutReattachingALostSessionIsStillEnded) {
  FakeSession fake;
  SessionKeeper::Options o = Fast();
  o.reattach = false;
  SessionKeeper keeper(o, fake.Hooks());
  keeper.Start(absl::OkStatus());
  keeper.Lost("the stream ended");
  ASSERT_TRUE(fake.Calls(1));
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_THAT(fake.calls(), ElementsAre("end"));
}

TEST(SessionKeeper, ChecksRunOnlyWhileAttached) {
  FakeSession fake;
  fake.Answers({true}, {false});
  SessionKeeper keeper(Fast(), fake.Hooks());
  keeper.Start(absl::UnavailableError("no daemon at start"));
  ASSERT_TRUE(fake.Calls(3));
  EXPECT_EQ(fake.checks_.load(), 0);
  fake.Answers({true}, {true});
  for (int i = 0; i < 1000 && fake.checks_.load() < 3; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_GE(fake.checks_.load(), 3);
  keeper.Stop();
  keeper.Stop();  // idempotent
}

}  // namespace
}  // namespace deltad::client
