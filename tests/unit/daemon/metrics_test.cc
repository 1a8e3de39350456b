#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::IsSubsetOf;
using ::testing::Not;
using ::testing::StartsWith;
using Labels = std::map<std::string, std::string>;

constexpr char kUuid0[] = "GPU-00000000-aaaa-bbbb-cccc-000000000000";
constexpr char kUuid1[] = "GPU-11111111-aaaa-bbbb-cccc-111111111111";

// One sample line of the text exposition.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// Parses sample lines of the form name{k="v",...} value. Label values here
// never contain quotes or commas, so no unescaping is needed.
std::vector<Sample> Samples(const std::string& scrape) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (brace != absl::string_view::npos && brace < space) {
      s.name = std::string(line.substr(0, brace));
      const size_t close = line.find('}', brace);
      for (absl::string_view pair :
           absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',',
                          absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        absl::string_view value = pair.substr(eq + 1);
        value.remove_prefix(1);  // the quotes
        value.remove_suffix(1);
        s.labels[std::string(pair.substr(0, eq))] = std::string(value);
      }
    } else {
      s.name = std::string(line.substr(0, space));
    }
    s.value = std::strtod(std::string(line.substr(space + 1)).c_str(), nullptr);
    samples.push_back(std::move(s));
  }
  return samples;
}

// The value of the one sample with this name and these labels; `le` is
// compared as a number, since its formatting is the library's business.
std::optional<double> Value(const std::string& scrape, const std::string& name,
                            const Labels& labels) {
  std::optional<double> found;
  for (const Sample& s : Samples(scrape)) {
    if (s.name != name || s.labels.size() != labels.size()) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      if (it == s.labels.end()) {
        match = false;
      } else if (k == "le" && v != "+Inf" && it->second != "+Inf") {
        match = std::abs(std::strtod(v.c_str(), nullptr) -
                         std::strtod(it->second.c_str(), nullptr)) < 1e-12;
      } else {
        match = match && it->second == v;
      }
      if (!match) break;
    }
    if (!match) continue;
    EXPECT_FALSE(found.has_value()) << "two samples " << name;
    found = s.value;
  }
  return found;
}

Labels Gpu0(Labels more = {}) {
  more["gpu"] = "0";
  more["uuid"] = kUuid0;
  return more;
}

std::unique_ptr<Metrics> TwoGpus() {
  auto m = Metrics::Create(
      {{0, kUuid0, int64_t{80} << 30}, {1, kUuid1, int64_t{40} << 30}}, "1.2.3",
      "sim");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

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
        "max_grpc_connections_per_uid", "unread_connection"}) {
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

// --- MetricsServer -----------------------------------------------------------

// Sends `request` to 127.0.0.1:port and returns everything the server sent
// back before closing; empty if the connection failed.
std::string Http(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  // A server that never answers fails the test instead of hanging it.
  timeval timeout{};
  timeout.tv_sec = 10;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  }
  close(fd);
  return response;
}

std::string Get(int port, const std::string& path) {
  return Http(port, absl::StrCat("GET ", path, " HTTP/1.0\r\n\r\n"));
}

// A server on a port the kernel picked, so parallel test runs never collide.
std::unique_ptr<MetricsServer> StartOnFreePort(const Metrics& m) {
  auto server = MetricsServer::Start("127.0.0.1:0", m.registry());
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  EXPECT_GT((*server)->port(), 0);
  return *std::move(server);
}

TEST(MetricsServer, ServesTheScrapeAtMetricsOverTcp) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  m->AddEviction(0);
  auto server = StartOnFreePort(*m);
  ASSERT_NE(server, nullptr);
  const std::string response = Get(server->port(), "/metrics");
  EXPECT_THAT(response, ContainsRegex("^HTTP/1\\.[01] 200 "));
  const size_t body = response.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << response;
  EXPECT_THAT(
      response.substr(body),
      HasSubstr("\ndeltad_build_info{backend=\"sim\",version=\"1.2.3\"} 1\n"));
  EXPECT_EQ(Value(response.substr(body + 4), "deltad_evictions_total", Gpu0()),
            1.0);
}

TEST(MetricsServer, OtherPathsAreNotFound) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  auto server = StartOnFreePort(*m);
  ASSERT_NE(server, nullptr);
  for (const char* path :
       {"/", "/metricsx", "/metrics/x", "/other", "/../etc/passwd"}) {
    EXPECT_THAT(Get(server->port(), path), ContainsRegex("^HTTP/1\\.[01] 404 "))
        << path;
  }
}

TEST(MetricsServer, OnlyReadsMetrics) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  auto server = StartOnFreePort(*m);
  ASSERT_NE(server, nullptr);
  const std::string before = m->Scrape();
  const std::string response = Http(
      server->port(), "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc");
  EXPECT_THAT(response, ContainsRegex("^HTTP/1\\.[01] 4[0-9][0-9] "));
  EXPECT_EQ(m->Scrape(), before);
}

TEST(MetricsServer, ASecondServerOnTheSamePortFailsWithAStatus) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  auto first = StartOnFreePort(*m);
  ASSERT_NE(first, nullptr);
  auto second = MetricsServer::Start(absl::StrCat("127.0.0.1:", first->port()),
                                     m->registry());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable)
      << second.status();
  // The first one keeps serving.
  EXPECT_THAT(Get(first->port(), "/metrics"), HasSubstr("deltad_build_info"));
}

TEST(MetricsServer, BadAddressesAreAStatus) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  for (const char* address : {"not an address", "127.0.0.1:99999",
                              "127.0.0.1:port", "300.1.1.1:9464"}) {
    EXPECT_FALSE(MetricsServer::Start(address, m->registry()).ok()) << address;
  }
  EXPECT_EQ(MetricsServer::Start("", m->registry()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsServer, StopsServingWhenDestroyed) {
  auto m = TwoGpus();
  ASSERT_NE(m, nullptr);
  auto server = StartOnFreePort(*m);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  server.reset();
  EXPECT_EQ(Get(port, "/metrics"), "");
}

}  // namespace
}  // namespace deltad::daemon
