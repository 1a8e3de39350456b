#include "daemon/session_leases.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

constexpr int64_t kMs = 1000 * 1000;

using Change = SessionLeases::Change;

LeaseOptions Options(int64_t lease_ms, int64_t end_after_ms = 0) {
  LeaseOptions o;
  o.lease_ns = lease_ms * kMs;
  o.end_after_ns = end_after_ms * kMs;
  o.max_tick_credit_ns = 500 * kMs;
  return o;
}

// Every process is stopped, unless a test says otherwise.
bool Stopped(SessionId) { return true; }

// Ticks every 100 ms from `from` up to `to` (ms), returning every change.
std::vector<Change> TickEvery100Ms(SessionLeases& leases, int64_t from,
                                   int64_t to) {
  std::vector<Change> all;
  for (int64_t t = from; t <= to; t += 100) {
    for (const Change& c : leases.Tick(t * kMs, Stopped)) all.push_back(c);
  }
  return all;
}

TEST(SessionLeases, ASessionHeardWithinItsLeaseStaysResponsive) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  for (int64_t t = 0; t <= 10000; t += 100) {
    if (t % 500 == 0) leases.Heard(1);
    EXPECT_TRUE(leases.Tick(t * kMs, Stopped).empty()) << "at " << t << " ms";
  }
  EXPECT_EQ(leases.UnresponsiveFor(1), 0);
}

TEST(SessionLeases, ASilentSessionIsMarkedOnceWhenItsLeasePasses) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  leases.Add(2, 0);
  std::vector<Change> changes;
  for (int64_t t = 0; t <= 3000; t += 100) {
    leases.Heard(2);
    for (const Change& c : leases.Tick(t * kMs, Stopped)) changes.push_back(c);
  }
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].session, 1u);
  EXPECT_EQ(changes[0].kind, Change::kUnresponsive);
  EXPECT_GT(changes[0].silent_ns, 1000 * kMs);
  EXPECT_LE(changes[0].silent_ns, 1100 * kMs);
  EXPECT_GE(leases.UnresponsiveFor(1), 2900 * kMs);
  EXPECT_EQ(leases.UnresponsiveFor(2), 0);
}

TEST(SessionLeases, ASessionHeardAgainIsReportedAnsweredAndHoldsANewLease) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  ASSERT_EQ(TickEvery100Ms(leases, 0, 2000).size(), 1u);
  leases.Heard(1);
  const std::vector<Change> answered = leases.Tick(2100 * kMs, Stopped);
  ASSERT_EQ(answered.size(), 1u);
  EXPECT_EQ(answered[0].kind, Change::kAnswered);
  EXPECT_EQ(answered[0].silent_ns, 2100 * kMs);
  EXPECT_EQ(leases.UnresponsiveFor(1), 0);
  // A new lease from then on: silent again, marked again.
  const std::vector<Change> again = TickEvery100Ms(leases, 2200, 3300);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].kind, Change::kUnresponsive);
}

TEST(SessionLeases, ADaemonStallCountsOnlyOneTickCredit) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  leases.Heard(1);
  EXPECT_TRUE(leases.Tick(100 * kMs, Stopped).empty());
  // The daemon was stopped for 30 s: nobody listened, so the silence is
  // not the process's; only the tick credit of 500 ms counts.
  EXPECT_TRUE(leases.Tick(30100 * kMs, Stopped).empty());
  EXPECT_EQ(leases.UnresponsiveFor(1), 0);
  // Heard once the daemon runs again (what the process sent meanwhile).
  leases.Heard(1);
  EXPECT_TRUE(TickEvery100Ms(leases, 30200, 31000).empty());
}

TEST(SessionLeases, TimeTheDaemonSpendsOnAMessageIsNotSilence) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  leases.Busy(1, true);  // e.g. waiting for a GPU's lock under load
  EXPECT_TRUE(TickEvery100Ms(leases, 0, 5000).empty());
  leases.Busy(1, false);
  EXPECT_TRUE(TickEvery100Ms(leases, 5100, 6000).empty());
  // Silent from then on: marked a lease later.
  const std::vector<Change> changes = TickEvery100Ms(leases, 6100, 6300);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].kind, Change::kUnresponsive);
}

TEST(SessionLeases, AProcessThatLooksAliveGetsThreeLeases) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  std::vector<Change> changes;
  for (int64_t t = 0; t <= 3000; t += 100) {
    for (const Change& c : leases.Tick(t * kMs, nullptr)) changes.push_back(c);
  }
  EXPECT_TRUE(changes.empty());
  changes = leases.Tick(3100 * kMs, nullptr);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].kind, Change::kUnresponsive);
  EXPECT_GT(changes[0].silent_ns, 3000 * kMs);
}

TEST(SessionLeases, TheEndIsReportedOnceAfterTheConfiguredTime) {
  SessionLeases leases(Options(1000, 2000));
  leases.Add(1, 0);
  const std::vector<Change> changes = TickEvery100Ms(leases, 0, 10000);
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].kind, Change::kUnresponsive);
  EXPECT_EQ(changes[1].kind, Change::kEnd);
  EXPECT_GT(changes[1].silent_ns, 3000 * kMs);
  EXPECT_LE(changes[1].silent_ns, 3100 * kMs);
}

TEST(SessionLeases, NoEndIsReportedWhenEndingIsOff) {
  SessionLeases leases(Options(1000, 0));
  leases.Add(1, 0);
  const std::vector<Change> changes = TickEvery100Ms(leases, 0, 60000);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].kind, Change::kUnresponsive);
}

TEST(SessionLeases, ARemovedSessionReportsNothing) {
  SessionLeases leases(Options(1000, 1000));
  leases.Add(1, 0);
  leases.Remove(1);
  leases.Heard(1);  // a late message of a stream that ended
  EXPECT_TRUE(TickEvery100Ms(leases, 0, 5000).empty());
  EXPECT_EQ(leases.UnresponsiveFor(1), 0);
}

TEST(SessionLeases, ASessionAddedLateGetsItsWholeLease) {
  SessionLeases leases(Options(1000));
  leases.Add(1, 0);
  for (int64_t t = 0; t <= 5000; t += 100) {
    leases.Heard(1);
    (void)leases.Tick(t * kMs, Stopped);
  }
  leases.Remove(1);
  leases.Add(2, 5000 * kMs);
  EXPECT_TRUE(TickEvery100Ms(leases, 5100, 6000).empty());
  const std::vector<Change> changes = TickEvery100Ms(leases, 6100, 6200);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].session, 2u);
}

}  // namespace
}  // namespace deltad::daemon
