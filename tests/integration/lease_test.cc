// Leases on what sessions hold (docs/RELIABILITY.md, "Leases"): a process
// frozen while it holds memory lent past its budget is marked unresponsive
// within its lease, the others stop counting on that memory and go on, and
// it is shared as before once the process answers; a daemon stalled past
// the lease marks no one; an idle process keeps its lease; and the
// operator's option ends a frozen process. Steady clients (the training
// process of steady_client_main.cc) do the work, checking every byte.
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/daemon_test.h"
#include "tests/integration/steady_client.h"
#include "tests/integration/trainer_jobs.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One simulated GPU of 96 MiB (86.25 MiB of budget) in 256 KiB chunks, a
// guaranteed minimum of 16 MiB, and the given lease settings.
DaemonOptions LeaseNode(const std::string& lease) {
  DaemonOptions o;
  o.sim_memory = "";
  o.host_pool = "";
  o.host_slab = "";
  o.config_text =
      "sim { gpus: 1 memory_bytes: 100663296 chunk_bytes: 262144 }\n"
      "min_session_bytes: 16777216\n"
      "host_pool_bytes: 1073741824\n"
      "host_slab_bytes: 16777216\n"
      "default_host_quota_bytes: 268435456\n"
      "lease { " +
      lease + " }\n";
  return o;
}

const v1::SessionStatus* SessionOfPid(const v1::NodeStatusResponse& s,
                                      pid_t pid) {
  for (const v1::SessionStatus& session : s.sessions()) {
    if (session.pid() == pid) return &session;
  }
  return nullptr;
}

std::string Metrics(DaemonProcess& daemon) {
  return Http(MetricsPort(daemon.Output()), "GET", "/metrics").second;
}

// A process alone on the GPU, lent 80 MiB of its 86.25 MiB; returned once
// it maps at least 64 MiB (a null process, and the test failed, if not).
// `rpc_timeout_ms` (0: the steady client's own default) is also how long a
// write on its stream may wait before it gives the stream up.
SteadyClient StartHolder(DaemonProcess& daemon, int rpc_timeout_ms = 0) {
  std::vector<std::string> flags = {"--budget_mib=80", "--window_mib=90"};
  if (rpc_timeout_ms > 0) {
    flags.push_back(absl::StrCat("--rpc_timeout_ms=", rpc_timeout_ms));
  }
  SteadyClient holder =
      StartSteadyClient(daemon.dir(), "holder", daemon.socket_path(), flags);
  if (holder.process == nullptr) return holder;
  const pid_t pid = holder.process->pid();
  const bool lent = StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* h = SessionOfPid(s, pid);
    return h != nullptr && h->chunk_bytes() >= 64 * kMiB;
  });
  EXPECT_TRUE(lent) << ReadFileOrEmpty(holder.errors);
  if (!lent) holder.process.reset();
  return holder;
}

TEST(Leases, AClientFrozenHoldingLentMemoryIsMarkedAndTheOthersGoOn) {
  auto d = DaemonProcess::Start(LeaseNode("lease_ms: 2000"));
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  // Twice in CI (a sanitizer build, tests two at a time), the holder's
  // first write after SIGCONT waited past 1 s, and the holder gave its
  // stream up before the daemon heard it again; what this test checks is
  // the daemon's side, so the holder waits longer (issue 16 tracks that
  // wait).
  SteadyClient holder = StartHolder(daemon, /*rpc_timeout_ms=*/20000);
  ASSERT_NE(holder.process, nullptr);
  const pid_t holder_pid = holder.process->pid();

  ::kill(holder_pid, SIGSTOP);
  const absl::Time stopped = absl::Now();
  // A newcomer whose share the frozen process would have had to give back.
  SteadyClient newcomer =
      StartSteadyClient(daemon.dir(), "newcomer", daemon.socket_path(),
                        {"--budget_mib=32", "--window_mib=40"});
  ASSERT_NE(newcomer.process, nullptr);
  const pid_t newcomer_pid = newcomer.process->pid();
  int64_t held = 0;
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* h = SessionOfPid(s, holder_pid);
    const v1::SessionStatus* n = SessionOfPid(s, newcomer_pid);
    if (h == nullptr || n == nullptr || h->unresponsive_ms() == 0) {
      return false;
    }
    held = h->chunk_bytes();
    // Its budget is what it holds, the GPU shows it as unresponsive, and
    // the newcomer's budget no longer counts on it.
    return h->budget_bytes() == held &&
           s.gpus(0).unresponsive_bytes() == held &&
           n->budget_bytes() + held <= s.gpus(0).budget_bytes() &&
           n->unresponsive_ms() == 0;
  })) << daemon.Output();
  std::printf("marked unresponsive %.1f s after SIGSTOP (lease 2 s)\n",
              absl::ToDoubleSeconds(absl::Now() - stopped));
  // The newcomer trains on within what is there, and says why it is short.
  auto before = newcomer.Ask("report");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_TRUE(Progressed(newcomer, *before, 200))
      << ReadFileOrEmpty(newcomer.errors);
  EXPECT_THAT(ReadFileOrEmpty(newcomer.errors),
              HasSubstr(absl::StrCat("(pid ", holder_pid,
                                     ", GPU 0, \"steady\") has not answered "
                                     "deltad for")));
  EXPECT_THAT(daemon.Output(),
              HasSubstr(absl::StrCat("(pid ", holder_pid,
                                     ", GPU 0, \"steady\") has not answered "
                                     "for")));
  std::string metrics = Metrics(daemon);
  EXPECT_THAT(metrics,
              HasSubstr("deltad_unresponsive_total{event=\"marked\"} 1"));
  EXPECT_THAT(metrics,
              HasSubstr(absl::StrCat("deltad_unresponsive_bytes{gpu=\"0\"")));

  ::kill(holder_pid, SIGCONT);
  // It answers: shared as before, it gives back what it holds past its
  // share, and the newcomer gets its 32 MiB again.
  ASSERT_TRUE(StatusBecomes(
      daemon,
      [&](const v1::NodeStatusResponse& s) {
        const v1::SessionStatus* h = SessionOfPid(s, holder_pid);
        const v1::SessionStatus* n = SessionOfPid(s, newcomer_pid);
        return h != nullptr && n != nullptr && h->unresponsive_ms() == 0 &&
               s.gpus(0).unresponsive_bytes() == 0 &&
               n->budget_bytes() == 32 * kMiB &&
               h->chunk_bytes() <= h->budget_bytes() + 256 * 1024;
      }))
      << daemon.Output() << ReadFileOrEmpty(holder.errors);
  // Both lines come after what the status shows: the daemon logs once it
  // has let go of the GPU's lock, and the newcomer once it has read the
  // order (in CI, ASan and tests two at a time, after the status held).
  EXPECT_THAT(
      OnceItHolds([&] { return daemon.Output(); }, "answers again after"),
      HasSubstr("answers again after"))
      << "the holder's log:\n"
      << ReadFileOrEmpty(holder.errors);
  EXPECT_THAT(OnceItHolds([&] { return ReadFileOrEmpty(newcomer.errors); },
                          "is counted on again"),
              HasSubstr("is counted on again"));
  metrics = Metrics(daemon);
  EXPECT_THAT(metrics,
              HasSubstr("deltad_unresponsive_total{event=\"answered\"} 1"));
  auto resumed = holder.Ask("report");
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  // The same session all along.
  EXPECT_EQ(resumed->lost, 0) << ReadFileOrEmpty(holder.errors);
  EXPECT_TRUE(Progressed(holder, *resumed, 100));
  holder.ExpectEveryTensorIntact();
  newcomer.ExpectEveryTensorIntact();
  const ExitStatus exit = daemon.Stop();
  EXPECT_TRUE(exit.ok()) << exit.ToString();
}

// gRPC's keepalive cuts the stream of a process frozen long enough, and the
// session ends; the chunks it maps stay in use all the same and are
// counted (left mapped) until it answers and reports them itself.
TEST(Leases, AFrozenProcessWhoseStreamIsCutStillCountsWhatItMaps) {
  DaemonOptions options = LeaseNode("lease_ms: 1000");
  options.config_text +=
      "limits { keepalive_time_ms: 1000 keepalive_timeout_ms: 1000 }\n";
  auto d = DaemonProcess::Start(options);
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  SteadyClient holder = StartHolder(daemon);
  ASSERT_NE(holder.process, nullptr);
  const pid_t holder_pid = holder.process->pid();

  ::kill(holder_pid, SIGSTOP);
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return SessionOfPid(s, holder_pid) == nullptr;
  })) << daemon.Output();
  const v1::NodeStatusResponse cut = Status(*daemon.NewStub());
  EXPECT_GE(cut.gpus(0).unlisted_bytes(), 64 * kMiB);
  // A newcomer is admitted only beside it (a floor of 16 MiB would not
  // fit), and its budget does not count on it.
  SteadyClient newcomer =
      StartSteadyClient(daemon.dir(), "newcomer", daemon.socket_path(),
                        {"--budget_mib=4", "--window_mib=8"});
  ASSERT_NE(newcomer.process, nullptr);
  const pid_t newcomer_pid = newcomer.process->pid();
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return SessionOfPid(s, newcomer_pid) != nullptr;
  })) << ReadFileOrEmpty(newcomer.errors);
  const v1::NodeStatusResponse joined = Status(*daemon.NewStub());
  const v1::SessionStatus* n = SessionOfPid(joined, newcomer_pid);
  ASSERT_NE(n, nullptr);
  EXPECT_LE(n->budget_bytes() + joined.gpus(0).unlisted_bytes(),
            joined.gpus(0).budget_bytes());

  ::kill(holder_pid, SIGCONT);
  // It finds its session lost, attaches anew and reports what it maps:
  // the daemon's count comes to what the two processes map.
  std::string last;
  EXPECT_TRUE(StatusBecomes(
      daemon,
      [&](const v1::NodeStatusResponse& s) {
        auto h = holder.Ask("report");
        auto c = newcomer.Ask("report");
        if (!h.ok() || !c.ok()) return false;
        last = absl::StrCat("processes map ", h->chunks, " + ", c->chunks,
                            "; daemon: chunks ", s.gpus(0).chunk_bytes(),
                            " + unlisted ", s.gpus(0).unlisted_bytes());
        // Both move on meanwhile: within a chunk of each's count.
        const int64_t diff = s.gpus(0).chunk_bytes() +
                             s.gpus(0).unlisted_bytes() - h->chunks - c->chunks;
        return h->connected == 1 && h->lost >= 1 && diff <= 512 * 1024 &&
               diff >= -512 * 1024;
      },
      absl::Seconds(60), absl::Milliseconds(100)))
      << last << "\n"
      << daemon.Output();
  holder.ExpectEveryTensorIntact();
  newcomer.ExpectEveryTensorIntact();
  EXPECT_TRUE(StatusBecomes(daemon, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.gpus(0).chunk_bytes() == 0 &&
           s.gpus(0).unlisted_bytes() == 0;
  })) << daemon.Output();
}

TEST(Leases, AnIdleProcessKeepsItsLease) {
  auto d = DaemonProcess::Start(LeaseNode("lease_ms: 1000"));
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  SteadyClient client =
      StartSteadyClient(daemon.dir(), "idle", daemon.socket_path());
  ASSERT_NE(client.process, nullptr);
  // Paused: it sends no batch, only the heartbeats of its keeper thread.
  ASSERT_TRUE(client.Ask("pause").ok());
  absl::SleepFor(absl::Seconds(4));
  const v1::NodeStatusResponse s = Status(*daemon.NewStub());
  const v1::SessionStatus* mine = SessionOfPid(s, client.process->pid());
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(mine->unresponsive_ms(), 0);
  EXPECT_THAT(daemon.Output(), Not(HasSubstr("has not answered")));
  ASSERT_TRUE(client.Ask("resume").ok());
  client.ExpectEveryTensorIntact();
}

TEST(Leases, ADaemonStalledPastTheLeaseMarksNoOne) {
  auto d = DaemonProcess::Start(LeaseNode("lease_ms: 2000"));
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  SteadyClient client =
      StartSteadyClient(daemon.dir(), "stalled", daemon.socket_path());
  ASSERT_NE(client.process, nullptr);
  auto before = client.Ask("report");
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(Progressed(client, *before, 50));

  // Three leases long: nobody listened, so nobody is to blame.
  ::kill(daemon.pid(), SIGSTOP);
  absl::SleepFor(absl::Seconds(6));
  ::kill(daemon.pid(), SIGCONT);

  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* mine = SessionOfPid(s, client.process->pid());
    return s.sessions_size() == 1 && mine != nullptr;
  })) << daemon.Output();
  auto after = client.Ask("report");
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(Progressed(client, *after, 50));
  EXPECT_THAT(daemon.Output(), Not(HasSubstr("has not answered")));
  EXPECT_THAT(Metrics(daemon),
              HasSubstr("deltad_unresponsive_total{event=\"marked\"} 0"));
  client.ExpectEveryTensorIntact();
}

TEST(Leases, TheOperatorsOptionEndsAFrozenProcess) {
  auto d = DaemonProcess::Start(
      LeaseNode("lease_ms: 1000 end_unresponsive_after_ms: 1000"));
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  SteadyClient client =
      StartSteadyClient(daemon.dir(), "frozen", daemon.socket_path());
  ASSERT_NE(client.process, nullptr);
  const pid_t pid = client.process->pid();
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* mine = SessionOfPid(s, pid);
    return mine != nullptr && mine->chunk_bytes() > 0;
  }));

  ::kill(pid, SIGSTOP);
  const std::optional<ExitStatus> ended =
      client.process->Wait(absl::Seconds(60));
  ASSERT_TRUE(ended.has_value()) << "not ended\n" << daemon.Output();
  EXPECT_FALSE(ended->exited);
  EXPECT_EQ(ended->signal, SIGKILL);
  // Its memory comes back once it is gone.
  EXPECT_TRUE(StatusBecomes(daemon, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.gpus(0).chunk_bytes() == 0 &&
           s.gpus(0).unresponsive_bytes() == 0;
  })) << daemon.Output();
  EXPECT_THAT(daemon.Output(), HasSubstr(absl::StrCat("(pid ", pid,
                                                      ", GPU 0, \"steady\") "
                                                      "unresponsive for")));
  EXPECT_THAT(daemon.Output(), HasSubstr("sent SIGKILL"));
  EXPECT_THAT(Metrics(daemon),
              HasSubstr("deltad_unresponsive_total{event=\"ended\"} 1"));
}

}  // namespace
}  // namespace deltad::testing_util
