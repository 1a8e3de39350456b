#include "daemon/metrics.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/metrics_test_util.h"

namespace deltad::daemon {
namespace {

using metrics_testing::Gpu0;
using metrics_testing::kUuid0;
using metrics_testing::kUuid1;
using metrics_testing::Labels;
using metrics_testing::Sample;
using metrics_testing::Samples;
using metrics_testing::TwoGpus;
using metrics_testing::Value;
using ::testing::HasSubstr;
using ::testing::IsSubsetOf;
using ::testing::Not;
using ::testing::StartsWith;

// Exercises every method once, so that every series has a value.
void TouchEverything(Metrics& m, int gpu) {
  m.SetGpuBudget(gpu, 1);
  m.SetGpuUsed(gpu, 1);
  m.SetSessions(gpu, 1);
  m.SetUnresponsive(gpu, 1, 1);
  m.SetUnlisted(gpu, 1);
  m.SetHostPool(1, 1);
  m.AddTransferred(gpu, Direction::kDeviceToHost, 1);
  m.AddTransferred(gpu, Direction::kHostToDevice, 1);
  m.AddEviction(gpu);
  m.AddRecompute(gpu, 0.5);
  m.AddOrders(gpu, OrderKind::kOffload, 1);
  m.AddOrders(gpu, OrderKind::kEvict, 1);
  m.AddOrders(gpu, OrderKind::kPrefetch, 1);
  m.AddOrders(gpu, OrderKind::kBudget, 1);
  m.ObserveDecision(gpu, 1e-4);
}

struct Family {
  std::string name;
  std::string type;
  std::set<std::string> labels;  // label names of every sample
};

TEST(Metrics, EveryFamilyHasHelpTypeAndItsLabels) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  TouchEverything(*m, 0);
  const std::string scrape = m->Scrape();
  const std::set<std::string> per_gpu = {"gpu", "uuid"};
  const std::vector<Family> families = {
      {"deltad_gpu_memory_bytes", "gauge", per_gpu},
      {"deltad_gpu_budget_bytes", "gauge", per_gpu},
      {"deltad_gpu_used_bytes", "gauge", per_gpu},
      {"deltad_sessions", "gauge", per_gpu},
      {"deltad_unresponsive_sessions", "gauge", per_gpu},
      {"deltad_unresponsive_bytes", "gauge", per_gpu},
      {"deltad_unlisted_bytes", "gauge", per_gpu},
      {"deltad_host_pool_bytes", "gauge", {"state"}},
      {"deltad_transferred_bytes_total",
       "counter",
       {"gpu", "uuid", "direction"}},
      {"deltad_evictions_total", "counter", per_gpu},
      {"deltad_recomputes_total", "counter", per_gpu},
      {"deltad_recompute_seconds_total", "counter", per_gpu},
      {"deltad_orders_total", "counter", {"gpu", "uuid", "kind"}},
      {"deltad_release_decision_seconds", "histogram", per_gpu},
      {"deltad_build_info", "gauge", {"version", "backend"}},
      {"deltad_refused_total", "counter", {"limit"}},
      {"deltad_sessions_ended_total", "counter", {"reason"}},
      {"deltad_unresponsive_total", "counter", {"event"}},
  };
  const std::vector<Sample> samples = Samples(scrape);
  const std::string lines = "\n" + scrape;  // every line follows a newline
  for (const Family& f : families) {
    SCOPED_TRACE(f.name);
    EXPECT_THAT(lines, HasSubstr(absl::StrCat("\n# HELP ", f.name, " ")));
    EXPECT_THAT(
        lines, HasSubstr(absl::StrCat("\n# TYPE ", f.name, " ", f.type, "\n")));
    int seen = 0;
    for (const Sample& s : samples) {
      if (s.name == f.name || s.name == f.name + "_sum" ||
          s.name == f.name + "_count") {
        std::set<std::string> names;
        for (const auto& [k, v] : s.labels) names.insert(k);
        EXPECT_EQ(names, f.labels) << s.name;
        ++seen;
      } else if (s.name == f.name + "_bucket") {
        std::set<std::string> names;
        for (const auto& [k, v] : s.labels) names.insert(k);
        std::set<std::string> want = f.labels;
        want.insert("le");
        EXPECT_EQ(names, want) << s.name;
        ++seen;
      }
    }
    EXPECT_GT(seen, 0);
  }
  // Nothing else is exported: a new family must be added to this test.
  for (const Sample& s : samples) {
    EXPECT_THAT(s.name, StartsWith("deltad_"));
  }
}

TEST(Metrics, PerGpuSeriesExistForEveryGpuFromTheStart) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  const std::string scrape = m->Scrape();
  for (const auto& [index, uuid] :
       {std::pair<std::string, std::string>{"0", kUuid0}, {"1", kUuid1}}) {
    const Labels gpu = {{"gpu", index}, {"uuid", uuid}};
    EXPECT_EQ(Value(scrape, "deltad_gpu_budget_bytes", gpu), 0.0);
    EXPECT_EQ(Value(scrape, "deltad_evictions_total", gpu), 0.0);
    EXPECT_EQ(Value(scrape, "deltad_release_decision_seconds_count", gpu), 0.0);
  }
  EXPECT_EQ(Value(scrape, "deltad_gpu_memory_bytes", Gpu0()),
            static_cast<double>(int64_t{80} << 30));
  EXPECT_EQ(Value(scrape, "deltad_gpu_memory_bytes",
                  {{"gpu", "1"}, {"uuid", kUuid1}}),
            static_cast<double>(int64_t{40} << 30));
}

TEST(Metrics, BuildInfoIsOneWithVersionAndBackend) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(Value(m->Scrape(), "deltad_build_info",
                  {{"version", "1.2.3"}, {"backend", "sim"}}),
            1.0);
}

TEST(Metrics, GaugesHoldTheLastValueSet) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  m->SetGpuBudget(0, 1000);
  m->SetGpuBudget(0, 700);
  m->SetGpuUsed(0, 300);
  m->SetSessions(0, 3);
  m->SetSessions(0, 2);
  m->SetHostPool(int64_t{6} << 30, int64_t{2} << 30);
  const std::string scrape = m->Scrape();
  EXPECT_EQ(Value(scrape, "deltad_gpu_budget_bytes", Gpu0()), 700.0);
  EXPECT_EQ(Value(scrape, "deltad_gpu_used_bytes", Gpu0()), 300.0);
  EXPECT_EQ(Value(scrape, "deltad_sessions", Gpu0()), 2.0);
  EXPECT_EQ(Value(scrape, "deltad_host_pool_bytes", {{"state", "free"}}),
            static_cast<double>(int64_t{6} << 30));
  EXPECT_EQ(Value(scrape, "deltad_host_pool_bytes", {{"state", "granted"}}),
            static_cast<double>(int64_t{2} << 30));
  // The other GPU is untouched.
  EXPECT_EQ(Value(scrape, "deltad_gpu_budget_bytes",
                  {{"gpu", "1"}, {"uuid", kUuid1}}),
            0.0);
}

TEST(Metrics, CountersAddUpPerGpuDirectionAndKind) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  m->AddTransferred(0, Direction::kDeviceToHost, 100);
  m->AddTransferred(0, Direction::kDeviceToHost, 50);
  m->AddTransferred(0, Direction::kHostToDevice, 7);
  m->AddTransferred(1, Direction::kHostToDevice, 9);
  m->AddEviction(0);
  m->AddEviction(0);
  m->AddRecompute(0, 0.25);
  m->AddRecompute(0, 0.5);
  m->AddOrders(0, OrderKind::kOffload, 3);
  m->AddOrders(0, OrderKind::kOffload, 2);
  m->AddOrders(0, OrderKind::kEvict, 1);
  m->AddOrders(0, OrderKind::kBudget, 4);
  const std::string scrape = m->Scrape();
  EXPECT_EQ(Value(scrape, "deltad_transferred_bytes_total",
                  Gpu0({{"direction", "d2h"}})),
            150.0);
  EXPECT_EQ(Value(scrape, "deltad_transferred_bytes_total",
                  Gpu0({{"direction", "h2d"}})),
            7.0);
  EXPECT_EQ(Value(scrape, "deltad_transferred_bytes_total",
                  {{"gpu", "1"}, {"uuid", kUuid1}, {"direction", "h2d"}}),
            9.0);
  EXPECT_EQ(Value(scrape, "deltad_evictions_total", Gpu0()), 2.0);
  EXPECT_EQ(Value(scrape, "deltad_recomputes_total", Gpu0()), 2.0);
  EXPECT_EQ(Value(scrape, "deltad_recompute_seconds_total", Gpu0()), 0.75);
  EXPECT_EQ(Value(scrape, "deltad_orders_total", Gpu0({{"kind", "offload"}})),
            5.0);
  EXPECT_EQ(Value(scrape, "deltad_orders_total", Gpu0({{"kind", "evict"}})),
            1.0);
  EXPECT_EQ(Value(scrape, "deltad_orders_total", Gpu0({{"kind", "prefetch"}})),
            0.0);
  EXPECT_EQ(Value(scrape, "deltad_orders_total", Gpu0({{"kind", "budget"}})),
            4.0);
}

TEST(Metrics, RefusalsAreCountedByTheLimitFromTheStart) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(Value(m->Scrape(), "deltad_refused_total",
                  {{"limit", "max_queued_order_bytes"}}),
            0.0);
  for (const char* limit :
       {"admission", "max_sessions_per_uid", "max_sessions_per_gpu",
        "max_ping_strikes", "max_grpc_connections",
        "max_grpc_connections_per_uid", "unread_connection",
        "grpc_max_threads"}) {
    EXPECT_EQ(Value(m->Scrape(), "deltad_refused_total", {{"limit", limit}}),
              0.0)
        << limit;
  }
  m->AddRefusal(Refusal::kInvalidRequest);
  m->AddRefusal(Refusal::kInvalidRequest);
  m->AddRefusal(Refusal::kQueuedOrderBytes);
  m->AddRefusal(Refusal::kSessionsPerUid);
  const std::string scrape = m->Scrape();
  EXPECT_EQ(Value(scrape, "deltad_refused_total",
                  {{"limit", "max_sessions_per_uid"}}),
            1.0);
  EXPECT_EQ(
      Value(scrape, "deltad_refused_total", {{"limit", "invalid_request"}}),
      2.0);
  EXPECT_EQ(Value(scrape, "deltad_refused_total",
                  {{"limit", "max_queued_order_bytes"}}),
            1.0);
}

TEST(Metrics, SessionEndsAreCountedByReasonFromZero) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(Value(m->Scrape(), "deltad_sessions_ended_total",
                  {{"reason", "stream_broken"}}),
            0.0);
  m->AddSessionEnded(SessionEnd::kClosed);
  m->AddSessionEnded(SessionEnd::kStreamBroken);
  m->AddSessionEnded(SessionEnd::kStreamBroken);
  m->AddSessionEnded(SessionEnd::kProcessGone);
  const std::string scrape = m->Scrape();
  EXPECT_EQ(
      Value(scrape, "deltad_sessions_ended_total", {{"reason", "closed"}}),
      1.0);
  EXPECT_EQ(Value(scrape, "deltad_sessions_ended_total",
                  {{"reason", "stream_broken"}}),
            2.0);
  EXPECT_EQ(Value(scrape, "deltad_sessions_ended_total",
                  {{"reason", "process_gone"}}),
            1.0);
}

TEST(Metrics, LeaseEventsAndUnresponsiveHoldingsAreReported) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(
      Value(m->Scrape(), "deltad_unresponsive_total", {{"event", "ended"}}),
      0.0);
  m->AddLeaseEvent(LeaseEvent::kMarked);
  m->AddLeaseEvent(LeaseEvent::kMarked);
  m->AddLeaseEvent(LeaseEvent::kAnswered);
  m->SetUnresponsive(1, 1, 4096);
  m->SetUnresponsive(7, 1, 4096);  // no such GPU: ignored
  const std::string scrape = m->Scrape();
  EXPECT_EQ(Value(scrape, "deltad_unresponsive_total", {{"event", "marked"}}),
            2.0);
  EXPECT_EQ(Value(scrape, "deltad_unresponsive_total", {{"event", "answered"}}),
            1.0);
  EXPECT_EQ(Value(scrape, "deltad_unresponsive_sessions",
                  {{"gpu", "1"}, {"uuid", kUuid1}}),
            1.0);
  EXPECT_EQ(Value(scrape, "deltad_unresponsive_bytes",
                  {{"gpu", "1"}, {"uuid", kUuid1}}),
            4096.0);
  EXPECT_EQ(Value(scrape, "deltad_unresponsive_bytes",
                  {{"gpu", "0"}, {"uuid", kUuid0}}),
            0.0);
}

TEST(Metrics, NegativeOrNonFiniteAmountsLeaveCountersAlone) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  m->AddTransferred(0, Direction::kDeviceToHost, 10);
  m->ObserveDecision(0, 1e-3);
  const std::string before = m->Scrape();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  m->AddTransferred(0, Direction::kDeviceToHost, -5);
  m->AddOrders(0, OrderKind::kEvict, -1);
  m->AddRecompute(0, -1);
  m->AddRecompute(0, nan);
  m->AddRecompute(0, inf);
  m->ObserveDecision(0, nan);
  m->ObserveDecision(0, -1e-3);
  m->AddOrders(0, static_cast<OrderKind>(99), 1);
  EXPECT_EQ(m->Scrape(), before);
}

TEST(Metrics, DecisionHistogramCountsIntoTheRightBuckets) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  m->ObserveDecision(0, 0.5e-6);  // below the first bucket
  m->ObserveDecision(0, 3e-6);
  m->ObserveDecision(0, 3e-6);
  m->ObserveDecision(0, 2e-3);
  m->ObserveDecision(0, 1.0);  // past the last bucket
  const std::string scrape = m->Scrape();
  const std::string bucket = "deltad_release_decision_seconds_bucket";
  // Buckets are cumulative: le is "at most".
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "1e-06"}})), 1.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "2.5e-06"}})), 1.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "5e-06"}})), 3.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "0.001"}})), 3.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "0.0025"}})), 4.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "0.1"}})), 4.0);
  EXPECT_EQ(Value(scrape, bucket, Gpu0({{"le", "+Inf"}})), 5.0);
  EXPECT_EQ(Value(scrape, "deltad_release_decision_seconds_count", Gpu0()),
            5.0);
  EXPECT_NEAR(*Value(scrape, "deltad_release_decision_seconds_sum", Gpu0()),
              0.5e-6 + 6e-6 + 2e-3 + 1.0, 1e-12);

  // Buckets span 1 us to 100 ms, increasing, no more than 3 per decade.
  std::vector<double> bounds;
  for (const Sample& s : Samples(scrape)) {
    if (s.name == bucket && s.labels.at("gpu") == "0" &&
        s.labels.at("le") != "+Inf") {
      bounds.push_back(std::strtod(s.labels.at("le").c_str(), nullptr));
    }
  }
  ASSERT_FALSE(bounds.empty());
  EXPECT_DOUBLE_EQ(bounds.front(), 1e-6);
  EXPECT_DOUBLE_EQ(bounds.back(), 0.1);
  EXPECT_LE(bounds.size(), 16u);
  for (size_t i = 1; i < bounds.size(); ++i) {
    EXPECT_GT(bounds[i], bounds[i - 1]);
    EXPECT_LE(bounds[i] / bounds[i - 1], 2.5 + 1e-9);
  }
}

TEST(Metrics, UnknownGpuIsIgnored) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  TouchEverything(*m, 0);
  const std::string before = m->Scrape();
  for (int gpu : {2, -1, 1000, std::numeric_limits<int>::min()}) {
    TouchEverything(*m, gpu);
    m->SetHostPool(1, 1);  // not per GPU; restore what TouchEverything set
  }
  EXPECT_EQ(m->Scrape(), before);
  EXPECT_THAT(before, Not(HasSubstr("gpu=\"2\"")));
}

TEST(Metrics, NoLabelCarriesATensorIdAndSeriesDoNotGrow) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  const size_t series = Samples(m->Scrape()).size();
  for (int i = 0; i < 1000; ++i) TouchEverything(*m, i % 2);
  const std::string scrape = m->Scrape();
  const std::vector<Sample> samples = Samples(scrape);
  // Series are fixed at Create: no call, however many, adds one (which is
  // what a per-tensor label would do).
  EXPECT_EQ(samples.size(), series);
  std::set<std::string> label_names;
  for (const Sample& s : samples) {
    for (const auto& [k, v] : s.labels) {
      label_names.insert(k);
      EXPECT_THAT(absl::AsciiStrToLower(k), Not(HasSubstr("tensor")));
      EXPECT_THAT(absl::AsciiStrToLower(v), Not(HasSubstr("tensor")));
    }
  }
  EXPECT_THAT(label_names,
              IsSubsetOf(std::set<std::string>{
                  "gpu", "uuid", "direction", "kind", "state", "le", "version",
                  "backend", "limit", "reason", "event"}));
}

TEST(Metrics, CreateRejectsRepeatedOrNegativeGpuIndexes) {
  EXPECT_EQ(Metrics::Create({{0, kUuid0, 1}, {0, kUuid1, 1}}, "v", "sim")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Metrics::Create({{-1, kUuid0, 1}}, "v", "sim").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Metrics::Create({}, "v", "sim").ok());
}

TEST(Metrics, ConcurrentUpdatesAndScrapesLoseNothing) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  constexpr int kThreads = 4;
  constexpr int kIterations = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < kIterations; ++i) {
        m->AddTransferred(0, Direction::kDeviceToHost, 3);
        m->AddEviction(0);
        m->ObserveDecision(0, 1e-5);
        m->SetGpuUsed(0, t);
        if (i % 200 == 0) m->Scrape();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const std::string scrape = m->Scrape();
  EXPECT_EQ(Value(scrape, "deltad_transferred_bytes_total",
                  Gpu0({{"direction", "d2h"}})),
            3.0 * kThreads * kIterations);
  EXPECT_EQ(Value(scrape, "deltad_evictions_total", Gpu0()),
            1.0 * kThreads * kIterations);
  EXPECT_EQ(Value(scrape, "deltad_release_decision_seconds_count", Gpu0()),
            1.0 * kThreads * kIterations);
}

}  // namespace
}  // namespace deltad::daemon
