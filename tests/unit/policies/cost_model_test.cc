#include "policies/cost_model.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "policies/tensor.h"
#include "policies/tensor_table.h"

namespace deltad::policy {
namespace {

using S = TensorState;

testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.ToString();
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

void ExpectBandwidth(const CostModel& costs, GpuId gpu, double d2h,
                     double h2d) {
  const LinkBandwidth bw = costs.Bandwidth(gpu);
  EXPECT_EQ(bw.d2h_bytes_per_s, d2h) << "GPU " << gpu;
  EXPECT_EQ(bw.h2d_bytes_per_s, h2d) << "GPU " << gpu;
}

// --- Bandwidth
// ----------------------------------------------------------------

TEST(CostModel, DefaultBandwidthIsPcie4AtPaperEfficiency) {
  // 64 GB/s nominal at the ~35% the DELTA paper measured: 11.2 GB/s.
  EXPECT_EQ(CostModel::kDefaultBandwidth.d2h_bytes_per_s, 11.2e9);
  EXPECT_EQ(CostModel::kDefaultBandwidth.h2d_bytes_per_s, 11.2e9);
  CostModel costs;
  ExpectBandwidth(costs, 0, 11.2e9, 11.2e9);
  ExpectBandwidth(costs, 7, 11.2e9, 11.2e9);
}

TEST(CostModel, SetBandwidthIsPerGpu) {
  CostModel costs;
  ASSERT_TRUE(IsOk(costs.SetBandwidth(
      1, {.d2h_bytes_per_s = 20e9, .h2d_bytes_per_s = 25e9})));
  ExpectBandwidth(costs, 1, 20e9, 25e9);
  ExpectBandwidth(costs, 0, 11.2e9, 11.2e9);
  ExpectBandwidth(costs, 2, 11.2e9, 11.2e9);
  // A new measurement replaces the old one.
  ASSERT_TRUE(IsOk(
      costs.SetBandwidth(1, {.d2h_bytes_per_s = 5e9, .h2d_bytes_per_s = 6e9})));
  ExpectBandwidth(costs, 1, 5e9, 6e9);
}

TEST(CostModel, SetBandwidthRejectsNonPositiveOrNonFiniteValues) {
  const std::vector<double> bad = {0.0, -0.0, -1.0, -11.2e9, kNaN, kInf, -kInf};
  for (double v : bad) {
    for (bool d2h : {true, false}) {
      SCOPED_TRACE(testing::Message() << (d2h ? "d2h=" : "h2d=") << v);
      CostModel costs;
      ASSERT_TRUE(IsOk(costs.SetBandwidth(
          0, {.d2h_bytes_per_s = 1e9, .h2d_bytes_per_s = 2e9})));
      LinkBandwidth bw{.d2h_bytes_per_s = 3e9, .h2d_bytes_per_s = 3e9};
      (d2h ? bw.d2h_bytes_per_s : bw.h2d_bytes_per_s) = v;
      const absl::Status s = costs.SetBandwidth(0, bw);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(std::string(s.message()).find("positive and finite"),
                std::string::npos)
          << s;
      // The earlier measurement stays.
      ExpectBandwidth(costs, 0, 1e9, 2e9);
      // And an unmeasured GPU is not given the bad value either.
      const absl::Status s3 = costs.SetBandwidth(3, bw);
      EXPECT_EQ(s3.code(), absl::StatusCode::kInvalidArgument);
      ExpectBandwidth(costs, 3, 11.2e9, 11.2e9);
    }
  }
}

TEST(CostModel, SetBandwidthRejectsNegativeGpu) {
  CostModel costs;
  const absl::Status s =
      costs.SetBandwidth(-1, {.d2h_bytes_per_s = 1e9, .h2d_bytes_per_s = 1e9});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("negative GPU index -1"),
            std::string::npos)
      << s;
  ExpectBandwidth(costs, -1, 11.2e9, 11.2e9);
}

// --- Copy times
// -----------------------------------------------------------------

TEST(CostModel, OffloadAndReloadTimesAreBytesOverBandwidth) {
  CostModel costs;
  ASSERT_TRUE(IsOk(
      costs.SetBandwidth(1, {.d2h_bytes_per_s = 1e9, .h2d_bytes_per_s = 4e9})));
  // 1 GB/s: one byte per ns.
  EXPECT_EQ(costs.OffloadNs(1, 1000), 1000);
  EXPECT_EQ(costs.OffloadNs(1, int64_t{8} << 30), int64_t{8} << 30);
  // 4 GB/s: four bytes per ns.
  EXPECT_EQ(costs.ReloadNs(1, 1000), 250);
  EXPECT_EQ(costs.ReloadNs(1, int64_t{8} << 30), int64_t{2} << 30);
  EXPECT_EQ(costs.OffloadNs(1, 0), 0);
  EXPECT_EQ(costs.ReloadNs(1, 0), 0);
  // Unmeasured GPU: 11.2 GB/s each way.
  EXPECT_EQ(costs.OffloadNs(0, 11'200'000'000), 1'000'000'000);
  EXPECT_EQ(costs.ReloadNs(0, 112'000), 10'000);
}

TEST(CostModel, ACopysLatencyIsAddedOnceEachWay) {
  CostModel costs;
  ASSERT_TRUE(IsOk(costs.SetBandwidth(1, {.d2h_bytes_per_s = 1e9,
                                          .h2d_bytes_per_s = 4e9,
                                          .copy_latency_ns = 8000})));
  EXPECT_EQ(costs.OffloadNs(1, 1000), 9000);
  EXPECT_EQ(costs.ReloadNs(1, 1000), 8250);
  // A few bytes are not free to move: no tensor is priced at nothing.
  EXPECT_EQ(costs.ReloadNs(1, 8), 8002);
  Tensor t;
  t.gpu = 1;
  t.bytes = 1000;
  EXPECT_EQ(costs.SwapNs(t), 9000 + 8250);
  t.flags.host_copy = true;
  EXPECT_EQ(costs.SwapNs(t), 8250);
}

TEST(CostModel, SetBandwidthRejectsANegativeLatency) {
  CostModel costs;
  const absl::Status s = costs.SetBandwidth(
      0,
      {.d2h_bytes_per_s = 1e9, .h2d_bytes_per_s = 1e9, .copy_latency_ns = -1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("latency -1 ns"), std::string::npos)
      << s;
  ExpectBandwidth(costs, 0, 11.2e9, 11.2e9);
}

TEST(CostModel, SwapNsCountsBothDirectionsOnTheTensorsGpu) {
  CostModel costs;
  ASSERT_TRUE(IsOk(
      costs.SetBandwidth(2, {.d2h_bytes_per_s = 1e9, .h2d_bytes_per_s = 2e9})));
  Tensor t;
  t.gpu = 2;
  t.bytes = 4000;
  EXPECT_EQ(costs.SwapNs(t), 4000 + 2000);
  t.gpu = 0;  // default bandwidth both ways
  t.bytes = 11'200;
  EXPECT_EQ(costs.SwapNs(t), 1000 + 1000);
  EXPECT_EQ(costs.SwapNs(t),
            costs.OffloadNs(0, t.bytes) + costs.ReloadNs(0, t.bytes));
}

// --- Recompute costs
// --------------------------------------------------------------

class RecomputeCosts : public testing::Test {
 protected:
  void Add(TensorId id, int64_t cost, std::vector<TensorId> parents = {},
           int64_t bytes = 8) {
    TensorSpec s;
    s.id = id;
    s.session = 1;
    s.bytes = bytes;
    s.compute_cost_ns = cost;
    s.parents = std::move(parents);
    ASSERT_TRUE(IsOk(table_.Add(s, 0)));
  }
  void Evict(TensorId id) {
    ASSERT_TRUE(IsOk(table_.SetState(id, S::kEvicted)));
  }
  int64_t Recompute(TensorId id) const {
    return RecomputeNs(table_, table_.SlotOf(id));
  }
  int64_t Eq(TensorId id) const {
    return NeighbourhoodNsEq(table_, table_.SlotOf(id));
  }
  int64_t Exact(TensorId id) const {
    return NeighbourhoodNsExact(table_, table_.SlotOf(id));
  }
  TensorTable table_;
};

TEST_F(RecomputeCosts, OwnCostWhenNothingIsEvicted) {
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  for (auto [id, cost] :
       {std::pair<TensorId, int64_t>{1, 1}, {2, 10}, {3, 100}}) {
    EXPECT_EQ(Recompute(id), cost) << id;
    EXPECT_EQ(Eq(id), cost) << id;
    EXPECT_EQ(Exact(id), cost) << id;
  }
}

TEST_F(RecomputeCosts, RecomputeNsCountsEvictedParentsNotChildren) {
  // 1 -> 2 -> 3
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Evict(1);
  Evict(3);
  EXPECT_EQ(Recompute(2), 11);
  EXPECT_EQ(Eq(2), 111);
  EXPECT_EQ(Exact(2), 111);
}

TEST_F(RecomputeCosts, OffloadedParentIsNotRecomputed) {
  Add(1, 1);
  Add(2, 10, {1});
  ASSERT_TRUE(IsOk(table_.SetState(1, S::kOffloading)));
  EXPECT_EQ(Recompute(2), 10);
  ASSERT_TRUE(IsOk(table_.SetState(1, S::kOffloaded)));
  EXPECT_EQ(Recompute(2), 10);
  EXPECT_EQ(Exact(2), 10);
}

TEST_F(RecomputeCosts, PricedOffloadedAncestorsCountTheirRestoreInTheEq) {
  // 1 (offloaded) -> 2 (evicted) -> 3; 4 (offloaded) -> 3. A rebuild of 3
  // brings 4 back and rebuilds 2, which brings 1 back.
  // At the default bandwidth, 11,200 bytes take 1000 ns each way.
  constexpr int64_t kBytes = 11'200;
  Add(1, 1, {}, kBytes);
  Add(2, 10, {1}, kBytes);
  Add(4, 5, {}, kBytes);
  Add(3, 100, {2, 4}, kBytes);
  for (TensorId id : {1, 4}) {
    ASSERT_TRUE(IsOk(table_.SetState(id, S::kOffloading)));
    ASSERT_TRUE(IsOk(table_.SetState(id, S::kOffloaded)));
  }
  Evict(2);
  CostModel costs;  // prices them by default, restored by reload
  const int64_t reload = costs.ReloadNs(0, kBytes);
  ASSERT_EQ(reload, 1000);
  const uint32_t slot = table_.SlotOf(3);
  EXPECT_EQ(NeighbourhoodNsEq(table_, slot, &costs), 100 + 10 + 2 * reload);
  // Without a cost model, or with pricing off, they are free.
  EXPECT_EQ(Eq(3), 100 + 10);
  costs.SetPriceOffloadedAncestors(false, false);
  EXPECT_EQ(NeighbourhoodNsEq(table_, slot, &costs), 100 + 10);
  // Where restores may rebuild, the cheaper of reload and rebuild.
  costs.SetPriceOffloadedAncestors(true, true);
  EXPECT_EQ(NeighbourhoodNsEq(table_, slot, &costs), 100 + 10 + 1 + 5);
}

TEST_F(RecomputeCosts, ExactCountsOnlyAncestorsAndDescendants) {
  // 1 -> {2, 3}; 2 -> 4. With 1 and 3 evicted, 4's rebuild needs 2 only if
  // 2 is evicted; 3 is 2's sibling, not an ancestor of 2.
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {1});
  Add(4, 1000, {2});
  Evict(1);
  Evict(3);
  // Eq counts the whole component {1, 3}; Exact only the ancestor 1.
  EXPECT_EQ(Recompute(2), 10 + 1 + 100);
  EXPECT_EQ(Eq(2), 10 + 1 + 100);
  EXPECT_EQ(Exact(2), 10 + 1);
  EXPECT_EQ(Exact(4), 1000);
  Evict(2);
  EXPECT_EQ(Recompute(4), 1000 + 111);
  EXPECT_EQ(Exact(4), 1000 + 10 + 1);
}

TEST_F(RecomputeCosts, ExactStopsAtTensorsThatNeedNoRebuild) {
  // 1 -> 2 -> 3 -> 4 -> 5 with 1, 3 and 5 evicted, 2 and 4 resident.
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Add(4, 1000, {3});
  Add(5, 10000, {4});
  Evict(1);
  Evict(3);
  Evict(5);
  EXPECT_EQ(Exact(4), 1000 + 100 + 10000);
  EXPECT_EQ(Eq(4), 1000 + 100 + 10000);
  EXPECT_EQ(Recompute(4), 1000 + 100);
  EXPECT_EQ(Exact(2), 10 + 1 + 100);
}

TEST_F(RecomputeCosts, ExactFollowsEvictedChainsBothWays) {
  // 1 -> 2 -> 3 -> 4 -> 5, all but 3 evicted.
  Add(1, 1);
  Add(2, 10, {1});
  Add(3, 100, {2});
  Add(4, 1000, {3});
  Add(5, 10000, {4});
  for (TensorId id : {1, 2, 4, 5}) Evict(id);
  EXPECT_EQ(Exact(3), 11111);
  EXPECT_EQ(Eq(3), 11111);
  EXPECT_EQ(Recompute(3), 111);
}

}  // namespace
}  // namespace deltad::policy
