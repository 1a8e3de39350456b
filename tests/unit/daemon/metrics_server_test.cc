// MetricsServer: the scrape served over HTTP.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/daemon/metrics_test_util.h"

namespace deltad::daemon {
namespace {

using metrics_testing::Gpu0;
using metrics_testing::TwoGpus;
using metrics_testing::Value;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;

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
