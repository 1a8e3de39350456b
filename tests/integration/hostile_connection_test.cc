// A hostile local client against the daemon's sockets themselves: HTTP/2
// PING floods (answered by gRPC without a call), connections that never
// read, idle connections that fill gRPC's memory, and more side-socket
// connections than one user may hold (hostile_grpc_limits_test.cc: the
// gRPC socket's limits). As in hostile_client_test.cc, an honest session
// on the same GPU must be unaffected (the fixture's TearDown).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"
#include "tests/integration/hostile_client.h"
#include "tests/integration/raw_http2.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// What a flood of HTTP/2 PINGs may leave in the daemon's resident memory
// once it is over and the heap return's next trim has run, where the
// daemon gives strikes (limits.max_ping_strikes, off by default). Past its
// strikes a connection is still read, and gRPC holds about 8 KB for each
// PING until the connection is gone: measured peaks of +62 to +286 MiB for
// 32 connections in a row, not bounded by anything the daemon controls.
// Once over, +12 to +104 MiB stayed after the trim 10 s later.
constexpr int64_t kPingFloodSettledRssBound = 192 * kMiB;

// Every side-socket connection holds a descriptor and a peer token: one
// user may hold only so many, and the next one is closed with the limit's
// name, not served.
TEST_F(HostileClientTest, SideConnectionsOfOneUserAreBoundedAndNamed) {
  std::vector<Peer> held;  // beside peer_, the fixture's own
  for (int i = 1; i < kMaxSideConnectionsPerUid; ++i) {
    auto p = Peer::Connect(daemon_->side_socket_path());
    ASSERT_TRUE(p.ok()) << p.status();
    held.push_back(std::move(*p));
  }
  auto refused = Peer::Connect(daemon_->side_socket_path());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("limits.max_side_connections_per_uid"));
  // One let go, another is served (once the daemon has seen the close).
  held.pop_back();
  absl::StatusOr<Peer> again = absl::UnavailableError("not tried");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    again = Peer::Connect(daemon_->side_socket_path());
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(again.ok()) << again.status();
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, ::testing::ContainsRegex(
                           "deltad_refused_total\\{limit=\"max_side_"
                           "connections_per_uid\"\\} [1-9]"));
}

// The HTTP/2 attack: PINGs, which gRPC answers by itself without a call.
// By default no PING is a strike (limits.max_ping_strikes 0). A connection
// that never reads its answers is no longer read once 10,000 of them wait
// (gRPC's own bound), so it holds about a megabyte while it stays open; one
// that reads is answered like any other client. The daemon serves calls
// all along, and the honest session keeps its stream (TearDown).
TEST_F(HostileClientTest,
       PingFloodsLeaveTheDaemonsMemoryBoundedAndServeOthers) {
  constexpr int kNeverRead = 8;
  constexpr int64_t kMostBytesPerConnection = 4 * kMiB;
  const int64_t rss_before = RssBytes(daemon_->pid());
  std::vector<PingFlood> floods(kNeverRead + 1);
  std::atomic<int> running{kNeverRead + 1};
  std::vector<std::thread> threads;
  for (int c = 0; c <= kNeverRead; ++c) {
    threads.emplace_back([&, c] {
      floods[c] =
          FloodWithPings(daemon_->socket_path(), kMostBytesPerConnection,
                         absl::Seconds(5), /*read_replies=*/c == kNeverRead);
      running.fetch_sub(1);
    });
  }
  const absl::Time start = absl::Now();
  int64_t rss_peak = rss_before;
  bool served = false;
  while (running.load() > 0) {
    rss_peak = std::max(rss_peak, RssBytes(daemon_->pid()));
    if (!served && absl::Now() - start > absl::Seconds(2)) {
      ExpectServing("two seconds into the ping floods");
      served = true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (std::thread& t : threads) t.join();
  int64_t unread_bytes = 0;
  for (int c = 0; c < kNeverRead; ++c) {
    unread_bytes += floods[c].bytes_sent;
    EXPECT_LT(floods[c].bytes_sent, kMostBytesPerConnection)
        << "connection " << c << ": gRPC read every PING sent, unanswered";
  }
  const PingFlood& reader = floods[kNeverRead];
  EXPECT_FALSE(reader.goaway) << "debug data: " << reader.goaway_debug;
  EXPECT_FALSE(reader.closed);
  std::printf(
      "ping floods: %d connections that never read sent %lld bytes of "
      "PINGs, one that reads %lld; daemon RSS %lld -> peak %lld (%+lld)\n",
      kNeverRead, static_cast<long long>(unread_bytes),
      static_cast<long long>(reader.bytes_sent),
      static_cast<long long>(rss_before), static_cast<long long>(rss_peak),
      static_cast<long long>(rss_peak - rss_before));
#ifndef __SANITIZE_ADDRESS__
  // Under AddressSanitizer resident memory says nothing (see above).
  EXPECT_LT(rss_peak - rss_before, kFloodRssBound);
#endif
}

// With strikes (limits.max_ping_strikes), a connection pinging too often
// gets GOAWAY ENHANCE_YOUR_CALM "too_many_pings", counted in the metrics.
// gRPC then closes it, though not always at once: now and then one goes on
// taking PINGs to this client's byte cap, and on a loaded machine a GOAWAY
// took over 10 s to come. Those are counted and printed, not failed on.
class HostileClientWithPingStrikesTest : public HostileClientTest {
 protected:
  std::string ExtraLimits() const override { return " max_ping_strikes: 2"; }
};

TEST_F(HostileClientWithPingStrikesTest,
       PingFloodsAreCutOffWithGoawayAndCounted) {
  constexpr int kConnections = 4;
  constexpr int64_t kMostBytesPerConnection = 4 * kMiB;
  const int64_t rss_before = RssBytes(daemon_->pid());
  int64_t sent = 0;
  int left_open = 0;
  int to_the_cap = 0;
  for (int c = 0; c < kConnections; ++c) {
    const PingFlood flood =
        FloodWithPings(daemon_->socket_path(), kMostBytesPerConnection,
                       absl::Seconds(30), /*read_replies=*/true);
    sent += flood.bytes_sent;
    ASSERT_TRUE(flood.goaway) << "connection " << c << ": no GOAWAY after "
                              << flood.bytes_sent << " bytes of PINGs";
    EXPECT_EQ(flood.goaway_error, kEnhanceYourCalm) << "connection " << c;
    EXPECT_EQ(flood.goaway_debug, "too_many_pings") << "connection " << c;
    if (!flood.closed) ++left_open;
    if (flood.bytes_sent >= kMostBytesPerConnection) ++to_the_cap;
    ExpectServing(absl::StrCat("ping flood ", c));
  }
  const int64_t rss_after = RssBytes(daemon_->pid());
  // The heap return trims what lies free every 10 s (25 s given here).
  int64_t rss_settled = rss_after;
  for (int i = 0;
       i < 250 && rss_settled - rss_before >= kPingFloodSettledRssBound; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    rss_settled = RssBytes(daemon_->pid());
  }
  std::printf(
      "ping flood with strikes: %d connections (%d not closed in time, %d "
      "took PINGs to the %lld-byte cap), %lld bytes of PINGs, RSS %lld -> "
      "%lld bytes (%+lld), settled at %lld (%+lld)\n",
      kConnections, left_open, to_the_cap,
      static_cast<long long>(kMostBytesPerConnection),
      static_cast<long long>(sent), static_cast<long long>(rss_before),
      static_cast<long long>(rss_after),
      static_cast<long long>(rss_after - rss_before),
      static_cast<long long>(rss_settled),
      static_cast<long long>(rss_settled - rss_before));
#ifndef __SANITIZE_ADDRESS__
  EXPECT_LT(rss_settled - rss_before, kPingFloodSettledRssBound);
#endif
  const std::string metrics =
      Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat(
                           "deltad_refused_total{limit=\"max_ping_strikes\"} ",
                           kConnections)));
}

// gRPC closes a connection only once its writes are done: one whose client
// never reads would stay open, holding its memory, for as long as the
// client likes. The daemon shuts it down once its bytes have sat unread
// for keepalive_time_ms (2 s here), and counts it: sooner than gRPC's own
// keepalive would close it uncounted (a ping sent before the bytes piled
// up, unanswered for keepalive_timeout_ms, 5 s here; it won that race once
// in CI when the two were equal).
class HostileClientWithShortKeepaliveTest : public HostileClientTest {
 protected:
  std::string ExtraLimits() const override {
    return " keepalive_time_ms: 2000 keepalive_timeout_ms: 5000";
  }
};

TEST_F(HostileClientWithShortKeepaliveTest,
       AConnectionThatNeverReadsIsShutDownAndCounted) {
  const absl::Time start = absl::Now();
  const PingFlood flood =
      FloodWithPings(daemon_->socket_path(), 64 * kMiB, absl::Seconds(30),
                     /*read_replies=*/false);
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(flood.closed) << "still open after " << took;
  EXPECT_LT(took, absl::Seconds(20));
  std::printf(
      "a connection that never read: shut down after %s, %lld "
      "bytes of PINGs sent\n",
      absl::FormatDuration(took).c_str(),
      static_cast<long long>(flood.bytes_sent));
  ExpectServing("a connection shut down unread");
  // The count comes before the shutdown, the log line after it: on a
  // loaded machine the client can see the connection end first (CI-like
  // load, 2026-12-02: closed after 3.0 s, neither there yet).
  const std::string counted =
      "deltad_refused_total{limit=\"unread_connection\"} 1";
  EXPECT_THAT(MetricsOnceTheyHold(daemon_->Output(), {counted}),
              HasSubstr(counted));
  EXPECT_THAT(OnceItHolds([&] { return daemon_->Output(); },
                          "left the daemon's bytes unread"),
              HasSubstr("left the daemon's bytes unread"));
}

// gRPC's memory quota (limits.grpc_memory_bytes, 1 MiB here) filled by
// idle connections: gRPC closes idle ones with GOAWAY ENHANCE_YOUR_CALM
// "Buffers full", which no hook of its C++ API reports. The daemon counts
// each from the line chttp2 logs for it, and says so in its log.
class HostileClientWithSmallGrpcMemoryTest : public HostileClientTest {
 protected:
  std::string ExtraLimits() const override {
    return " grpc_memory_bytes: 1048576";
  }
};

TEST_F(HostileClientWithSmallGrpcMemoryTest,
       IdleConnectionsClosedForWantOfMemoryAreCountedAndLogged) {
  // About 80 fit in 1 MiB (gRPC 1.51); the rest push the quota over.
  constexpr int kConnections = 200;
  const std::string preface = ClientHello();
  std::vector<common::UniqueFd> fds;
  for (int i = 0; i < kConnections; ++i) {
    auto fd = common::ConnectUnix(daemon_->socket_path());
    ASSERT_TRUE(fd.ok()) << fd.status();
    (void)::send(fd->get(), preface.data(), preface.size(), MSG_NOSIGNAL);
    fds.push_back(std::move(*fd));
  }
  std::vector<std::string> received(fds.size());
  std::vector<bool> closed(fds.size(), false);
  // Reads every open connection until none has said anything for `quiet`
  // or `limit` has passed.
  const auto read_for = [&](absl::Duration quiet, absl::Duration limit) {
    absl::Time quiet_since = absl::Now();
    const absl::Time deadline = absl::Now() + limit;
    while (absl::Now() - quiet_since < quiet && absl::Now() < deadline) {
      std::vector<pollfd> polled;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!closed[i]) polled.push_back({fds[i].get(), POLLIN, 0});
      }
      if (polled.empty()) return;
      if (::poll(polled.data(), polled.size(), 100) <= 0) continue;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (closed[i]) continue;
        char buf[4096];
        const ssize_t n = ::recv(fds[i].get(), buf, sizeof(buf), MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        quiet_since = absl::Now();
        if (n <= 0) {
          closed[i] = true;
          continue;
        }
        received[i].append(buf, static_cast<size_t>(n));
      }
    }
  };
  const auto count_goaways = [&] {
    int goaways = 0;
    for (size_t i = 0; i < fds.size(); ++i) {
      PingFlood seen;
      ReadGoaway(received[i], seen);
      if (!seen.goaway) continue;
      EXPECT_EQ(seen.goaway_error, kEnhanceYourCalm) << "connection " << i;
      EXPECT_EQ(seen.goaway_debug, "Buffers full") << "connection " << i;
      ++goaways;
    }
    return goaways;
  };
  const std::string kCounter =
      "deltad_refused_total{limit=\"grpc_memory_bytes\"} ";
  const auto counted = [&] {
    const std::string metrics =
        Http(MetricsPort(daemon_->Output()), "GET", "/metrics").second;
    const size_t at = metrics.find(kCounter);
    int64_t n = -1;
    if (at != std::string::npos) {
      (void)absl::SimpleAtoi(absl::string_view(metrics).substr(
                                 at + kCounter.size(),
                                 metrics.find('\n', at) - at - kCounter.size()),
                             &n);
    }
    return n;
  };
  read_for(absl::Seconds(2), absl::Seconds(20));
  int goaways = count_goaways();
  ASSERT_GT(goaways, 0) << "no connection of " << kConnections
                        << " was closed for want of gRPC memory";
  // The daemon counts each GOAWAY from the line gRPC logs as it queues the
  // frame, so under load the count can lead what this client has read
  // (CI once saw the 2 s quiet end first): read on until the two agree.
  int64_t in_metrics = counted();
  const absl::Time patience = absl::Now() + absl::Seconds(15);
  while (in_metrics != goaways && absl::Now() < patience) {
    read_for(absl::Milliseconds(500), absl::Milliseconds(500));
    goaways = count_goaways();
    in_metrics = counted();
  }
  const int closed_count =
      static_cast<int>(std::count(closed.begin(), closed.end(), true));
  fds.clear();
  EXPECT_EQ(in_metrics, goaways)
      << closed_count << " connections closed by the daemon";
  EXPECT_THAT(OnceItHolds([&] { return daemon_->Output(); },
                          "reached limits.grpc_memory_bytes"),
              HasSubstr("reached limits.grpc_memory_bytes"));
  std::printf("%d of %d idle connections closed with \"Buffers full\"\n",
              goaways, kConnections);
  ExpectServing("idle connections past gRPC's memory");
}

}  // namespace
}  // namespace deltad::testing_util
