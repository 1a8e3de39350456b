#include "daemon/gpu_arbiter.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

GpuArbiter Make(int64_t budget, int64_t min_session) {
  auto a = GpuArbiter::Create(0, budget, min_session);
  EXPECT_TRUE(a.ok()) << a.status();
  return std::move(*a);
}

TEST(GpuArbiter, RejectsBadConfiguration) {
  EXPECT_EQ(GpuArbiter::Create(0, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuArbiter::Create(0, kGiB, 2 * kGiB).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuArbiter::Create(0, kGiB, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GpuArbiter, ASessionAloneGetsTheWholeBudget) {
  GpuArbiter a = Make(80 * kGiB, kGiB);
  auto changes = a.AddSession(1, 1, 0);
  ASSERT_TRUE(changes.ok()) << changes.status();
  ASSERT_EQ(changes->size(), 1u);
  EXPECT_EQ((*changes)[0].session, 1u);
  EXPECT_EQ((*changes)[0].budget_bytes, 80 * kGiB);
}

TEST(GpuArbiter, EqualWeightsSplitEvenlyAndReportWhoChanged) {
  GpuArbiter a = Make(80 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  auto changes = a.AddSession(2, 1, 0);
  ASSERT_TRUE(changes.ok());
  // The newcomer's grant comes first, then the session that shrank.
  ASSERT_EQ(changes->size(), 2u);
  EXPECT_EQ((*changes)[0].session, 2u);
  EXPECT_EQ((*changes)[1].session, 1u);
  EXPECT_EQ(a.BudgetOf(1), 40 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 40 * kGiB);
}

TEST(GpuArbiter, WeightsSplitProportionally) {
  GpuArbiter a = Make(80 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 3, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  // Floors of 1 GiB each, the remaining 78 GiB by 3:1.
  EXPECT_EQ(a.BudgetOf(1), kGiB + 78 * kGiB * 3 / 4);
  EXPECT_EQ(a.BudgetOf(2), kGiB + 78 * kGiB / 4);
  EXPECT_EQ(a.granted_bytes(), 80 * kGiB);
}

TEST(GpuArbiter, ASmallRequestIsCappedAndItsSurplusGoesToTheOthers) {
  GpuArbiter a = Make(80 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 10 * kGiB).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(3, 1, 0).ok());
  EXPECT_EQ(a.BudgetOf(1), 10 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 35 * kGiB);
  EXPECT_EQ(a.BudgetOf(3), 35 * kGiB);
}

TEST(GpuArbiter, GuaranteedMinimumHoldsForALowWeight) {
  GpuArbiter a = Make(10 * kGiB, 2 * kGiB);
  ASSERT_TRUE(a.AddSession(1, 100, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  // By weight alone session 2 would get 0.1 GiB.
  EXPECT_GE(a.BudgetOf(2), 2 * kGiB);
  EXPECT_EQ(a.granted_bytes(), 10 * kGiB);
}

TEST(GpuArbiter, RefusesASessionWhoseFloorWouldNotFit) {
  GpuArbiter a = Make(10 * kGiB, 4 * kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  const int64_t before1 = a.BudgetOf(1);
  auto third = a.AddSession(3, 1, 0);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("guaranteed minimum"));
  EXPECT_EQ(a.sessions(), 2u);
  EXPECT_EQ(a.BudgetOf(1), before1);
  // A session asking for less than the minimum needs only that much.
  EXPECT_TRUE(a.AddSession(4, 1, kGiB).ok());
}

TEST(GpuArbiter, ANewcomerIsRefusedRatherThanCutARunningJobsDeclaredFloor) {
  GpuArbiter a = Make(10 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0, 6 * kGiB).ok());
  auto refused = a.AddSession(2, 1, 0, 5 * kGiB);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("without cutting a running job below its floor"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("this session needs 5368709120"));
  EXPECT_EQ(a.BudgetOf(1), 10 * kGiB);  // nothing changed
  ASSERT_TRUE(a.AddSession(2, 100, 0, 4 * kGiB).ok());
  // Weight 100 would take nearly all of it; the floor holds.
  EXPECT_EQ(a.BudgetOf(1), 6 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 4 * kGiB);
}

TEST(GpuArbiter, ALastIterationsPeakIsKeptAsTheFloorUpToTheBudget) {
  GpuArbiter a = Make(10 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.SetIterationPeak(1, 7 * kGiB).ok());
  EXPECT_EQ(a.FloorOf(1), 7 * kGiB);
  // A newcomer of the same weight would halve it; it gets what is left.
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  EXPECT_EQ(a.BudgetOf(1), 7 * kGiB + kGiB);
  EXPECT_EQ(a.BudgetOf(2), kGiB + kGiB);
  EXPECT_EQ(a.AddSession(3, 1, 0, 3 * kGiB).status().code(),
            absl::StatusCode::kResourceExhausted);
  // The last iteration counts, not the largest: a smaller peak lowers it.
  ASSERT_TRUE(a.SetIterationPeak(1, 3 * kGiB).ok());
  EXPECT_EQ(a.FloorOf(1), 3 * kGiB);
  // Memory lent past the budget is not kept as a floor.
  ASSERT_TRUE(a.SetIterationPeak(1, 20 * kGiB).ok());
  EXPECT_EQ(a.FloorOf(1), a.BudgetOf(1));
  EXPECT_EQ(a.SetIterationPeak(9, kGiB).code(), absl::StatusCode::kNotFound);
}

TEST(GpuArbiter, ADeclaredFloorAboveTheRequestOrTheGpuIsInvalid) {
  GpuArbiter a = Make(10 * kGiB, kGiB);
  EXPECT_EQ(a.AddSession(1, 1, 2 * kGiB, 3 * kGiB).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.AddSession(1, 1, 0, 11 * kGiB).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.AddSession(1, 1, 0, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.sessions(), 0u);
}

TEST(GpuArbiter, RemovingASessionGivesItsShareBack) {
  GpuArbiter a = Make(90 * kGiB, kGiB);
  for (SessionId s : {1, 2, 3}) ASSERT_TRUE(a.AddSession(s, 1, 0).ok());
  EXPECT_EQ(a.BudgetOf(1), 30 * kGiB);
  auto grew = a.RemoveSession(2);
  ASSERT_TRUE(grew.ok());
  EXPECT_EQ(grew->size(), 2u);
  EXPECT_EQ(a.BudgetOf(1), 45 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 0);
  EXPECT_EQ(a.RemoveSession(2).status().code(), absl::StatusCode::kNotFound);
}

TEST(GpuArbiter, RejectsDuplicateAndNegativeRequests) {
  GpuArbiter a = Make(10 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  EXPECT_EQ(a.AddSession(1, 1, 0).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(a.AddSession(2, 1, -5).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Random admissions, departures and iteration peaks: the grants never
// exceed the budget, every floor (declared, peak or guaranteed) holds, no
// session gets more than it asked, and when some session is left wanting the
// whole budget is handed out.
TEST(GpuArbiter, RandomChurnKeepsEveryInvariant) {
  std::mt19937_64 rng(7);
  const int64_t budget = 64 * kGiB;
  const int64_t min = 2 * kGiB;
  GpuArbiter a = Make(budget, min);
  std::map<SessionId, int64_t> requested;
  std::map<SessionId, int64_t> floors;  // declared or guaranteed
  for (int step = 0; step < 2000; ++step) {
    const SessionId id = rng() % 40;
    if (requested.contains(id)) {
      ASSERT_TRUE(a.RemoveSession(id).ok());
      requested.erase(id);
      floors.erase(id);
    } else {
      const int64_t req = rng() % 3 == 0 ? 0 : int64_t(rng() % (40 * kGiB));
      const int64_t declared =
          rng() % 4 == 0 ? int64_t(rng() % (req > 0 ? req : 8 * kGiB)) : 0;
      if (a.AddSession(id, 1 + rng() % 8, req, declared).ok()) {
        requested[id] = req;
        floors[id] = std::max(declared, req > 0 ? std::min(req, min) : min);
      }
    }
    if (!requested.empty() && rng() % 2 == 0) {
      // A running session reports an iteration's peak.
      auto it = requested.begin();
      std::advance(it, rng() % requested.size());
      ASSERT_TRUE(
          a.SetIterationPeak(it->first, int64_t(rng() % (12 * kGiB))).ok());
    }
    int64_t sum = 0;
    bool someone_wants_more = false;
    for (const auto& [s, req] : requested) {
      const int64_t b = a.BudgetOf(s);
      sum += b;
      ASSERT_GE(a.FloorOf(s), floors[s]) << "step " << step;
      ASSERT_GE(b, a.FloorOf(s)) << "step " << step;
      if (req > 0) {
        ASSERT_LE(b, req) << "step " << step;
      }
      if (req == 0 || b < req) someone_wants_more = true;
    }
    ASSERT_LE(sum, budget) << "step " << step;
    if (someone_wants_more && !requested.empty()) {
      ASSERT_EQ(sum, budget) << "step " << step;
    }
  }
}

int64_t BudgetIn(const std::vector<BudgetChange>& changes, SessionId id) {
  for (const BudgetChange& c : changes) {
    if (c.session == id) return c.budget_bytes;
  }
  return -1;
}

TEST(GpuArbiter,
     AnUnresponsiveSessionKeepsWhatItHoldsAndTheOthersShareTheRest) {
  GpuArbiter a = Make(90 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(3, 1, 0).ok());
  ASSERT_EQ(a.BudgetOf(1), 30 * kGiB);
  // Session 1 was lent memory past its share and stopped answering.
  auto frozen = a.Freeze(1, 50 * kGiB);
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  EXPECT_TRUE(a.Frozen(1));
  EXPECT_EQ(a.BudgetOf(1), 50 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 20 * kGiB);
  EXPECT_EQ(a.BudgetOf(3), 20 * kGiB);
  EXPECT_EQ(BudgetIn(*frozen, 2), 20 * kGiB);
  EXPECT_EQ(a.granted_bytes(), 90 * kGiB);

  auto thawed = a.Thaw(1);
  ASSERT_TRUE(thawed.ok()) << thawed.status();
  EXPECT_FALSE(a.Frozen(1));
  EXPECT_EQ(BudgetIn(*thawed, 1), 30 * kGiB);
  EXPECT_EQ(a.BudgetOf(2), 30 * kGiB);
  EXPECT_EQ(a.BudgetOf(3), 30 * kGiB);
  // Thawing one that answers changes nothing.
  auto again = a.Thaw(1);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->empty());
}

TEST(GpuArbiter, FloorsTheRestCannotHoldAreCutInProportion) {
  GpuArbiter a = Make(100 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0, 20 * kGiB).ok());
  ASSERT_TRUE(a.AddSession(3, 1, 0, 10 * kGiB).ok());
  ASSERT_TRUE(a.Freeze(1, 85 * kGiB).ok());
  // 15 GiB left for floors of 20 and 10: two thirds and one third.
  EXPECT_EQ(a.BudgetOf(2), 10 * kGiB);
  EXPECT_EQ(a.BudgetOf(3), 5 * kGiB);
  EXPECT_LE(a.granted_bytes(), 100 * kGiB);
  // Holding more than the whole budget leaves the others nothing, never
  // less.
  ASSERT_TRUE(a.Freeze(1, 120 * kGiB).ok());
  EXPECT_EQ(a.BudgetOf(2), 0);
  EXPECT_EQ(a.BudgetOf(3), 0);
  ASSERT_TRUE(a.Thaw(1).ok());
  EXPECT_GE(a.BudgetOf(2), 20 * kGiB);
  EXPECT_GE(a.BudgetOf(3), 10 * kGiB);
}

TEST(GpuArbiter, ANewcomerIsAdmittedOnlyBesideWhatAnUnresponsiveSessionHolds) {
  GpuArbiter a = Make(100 * kGiB, kGiB);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.Freeze(1, 95 * kGiB).ok());
  auto refused = a.AddSession(2, 1, 0, 10 * kGiB);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  auto admitted = a.AddSession(3, 1, 0, 5 * kGiB);
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_EQ(a.BudgetOf(3), 5 * kGiB);
  EXPECT_EQ(a.Freeze(9, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a.Thaw(9).status().code(), absl::StatusCode::kNotFound);
}

constexpr int64_t kChunk = int64_t{2} << 20;

GpuArbiter MakeInChunks(int64_t chunks, int64_t min_session) {
  auto a = GpuArbiter::Create(0, chunks * kChunk, min_session, kChunk);
  EXPECT_TRUE(a.ok()) << a.status();
  return std::move(*a);
}

TEST(GpuArbiter, BudgetsAreWholeChunksAndTheChunksAreAllGiven) {
  GpuArbiter a = MakeInChunks(10, kChunk);
  ASSERT_TRUE(a.AddSession(1, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0).ok());
  ASSERT_TRUE(a.AddSession(3, 1, 0).ok());
  int64_t sum = 0;
  for (SessionId id : {1, 2, 3}) {
    EXPECT_EQ(a.BudgetOf(id) % kChunk, 0) << "session " << id;
    EXPECT_GE(a.BudgetOf(id), 3 * kChunk);
    sum += a.BudgetOf(id);
  }
  EXPECT_EQ(sum, 10 * kChunk);
  // Weights and a capped request: still whole chunks, all of them given.
  ASSERT_TRUE(a.AddSession(4, 3, 0).ok());
  ASSERT_TRUE(a.AddSession(5, 1, kChunk / 2).ok());  // half a chunk asked
  sum = 0;
  for (SessionId id : {1, 2, 3, 4, 5}) {
    EXPECT_EQ(a.BudgetOf(id) % kChunk, 0) << "session " << id;
    sum += a.BudgetOf(id);
  }
  EXPECT_EQ(a.BudgetOf(5), kChunk);  // the request, in whole chunks
  EXPECT_EQ(sum, 10 * kChunk);
}

TEST(GpuArbiter, FloorsCountInWholeChunksAtAdmission) {
  GpuArbiter a = MakeInChunks(10, 0);
  // 4.5 and 4.6 chunks: five each.
  ASSERT_TRUE(a.AddSession(1, 1, 0, 9 * kChunk / 2).ok());
  ASSERT_TRUE(a.AddSession(2, 1, 0, 46 * kChunk / 10).ok());
  EXPECT_EQ(a.FloorOf(1), 5 * kChunk);
  EXPECT_EQ(a.FloorOf(2), 5 * kChunk);
  // Half a chunk more fits the bytes (9.6 of 10 chunks) but not the chunks.
  auto refused = a.AddSession(3, 1, 0, kChunk / 2);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("in whole chunks of"));
  EXPECT_EQ(a.BudgetOf(1), 5 * kChunk);
  EXPECT_EQ(a.BudgetOf(2), 5 * kChunk);
}

TEST(GpuArbiter, RandomChurnInChunksKeepsBudgetsWholeAndWithinTheGpu) {
  GpuArbiter a = MakeInChunks(37, kChunk);
  std::mt19937_64 rng(7);
  std::vector<SessionId> live;
  SessionId next = 1;
  for (int step = 0; step < 2000; ++step) {
    if (live.empty() || (live.size() < 12 && rng() % 3 != 0)) {
      const int64_t requested =
          rng() % 2 == 0 ? 0 : static_cast<int64_t>(rng() % (20 * kChunk));
      if (a.AddSession(next, 1 + rng() % 4, requested).ok()) {
        live.push_back(next);
      }
      ++next;
    } else {
      const size_t i = rng() % live.size();
      ASSERT_TRUE(a.RemoveSession(live[i]).ok());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    int64_t sum = 0;
    for (SessionId id : live) {
      ASSERT_EQ(a.BudgetOf(id) % kChunk, 0) << "step " << step;
      sum += a.BudgetOf(id);
    }
    ASSERT_LE(sum, 37 * kChunk) << "step " << step;
  }
}

TEST(GpuArbiter, AUnitOutsideOneToTheBudgetIsRefused) {
  EXPECT_EQ(GpuArbiter::Create(0, kGiB, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuArbiter::Create(0, kGiB, 0, 2 * kGiB).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deltad::daemon
