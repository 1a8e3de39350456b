// Sessions that survive the daemon: a training process (the steady client,
// which never stops allocating, freeing and checking its tensors' bytes)
// goes on through a daemon stalled for 3 s, a daemon killed and started
// again, and a daemon that was not there when it started; each time it ends
// up attached to a session the daemon lists, with everything it holds
// reported again, and loses no byte.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/child_process.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/steady_client.h"
#include "tests/integration/trainer_jobs.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// Waits (up to `timeout`) until the client is attached to a session that
// `daemon` lists as its only one, holding what the client holds (device
// bytes and tensors, compared while the client is paused), and returns the
// client's report then; the client is left running.
absl::StatusOr<Report> AttachedWithItsHoldings(DaemonProcess& daemon,
                                               SteadyClient& client,
                                               absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto stub = daemon.NewStub();
  std::string last = "no report";
  while (absl::Now() < deadline) {
    auto r = client.Ask("pause");
    if (!r.ok()) return r.status();
    // The events it sent on pausing, and orders carried out since, take a
    // moment to reach the daemon: compare a few times.
    for (int i = 0; i < 50 && r.ok() && r->connected == 1; ++i) {
      const v1::NodeStatusResponse s = Status(*stub);
      const v1::SessionStatus* mine = FindSession(s, r->session);
      last = absl::StrCat("client: session ", r->session, ", ", r->device_bytes,
                          " device bytes, ", r->tensors,
                          " tensors; daemon: ", s.ShortDebugString());
      if (s.sessions_size() == 1 && mine != nullptr &&
          mine->pid() == client.process->pid() &&
          mine->device_bytes() == r->device_bytes &&
          static_cast<long long>(mine->tensors()) == r->tensors) {
        (void)client.Ask("resume");
        return r;
      }
      absl::SleepFor(absl::Milliseconds(100));
      r = client.Ask("report");
    }
    if (!r.ok()) return r.status();
    auto resumed = client.Ask("resume");
    if (!resumed.ok()) return resumed.status();
    absl::SleepFor(absl::Milliseconds(200));
  }
  return absl::DeadlineExceededError("not attached with its holdings: " + last);
}

// The daemon's count of the device memory in use on GPU 0 (the chunks it
// holds and those the processes map beside them) comes to what the client
// maps, while the client is paused; the client is left running.
void ExpectChunksAccountedExactly(DaemonProcess& daemon, SteadyClient& client) {
  auto paused = client.Ask("pause");
  ASSERT_TRUE(paused.ok()) << paused.status();
  std::string last;
  const bool exact = StatusBecomes(
      daemon,
      [&](const v1::NodeStatusResponse& s) {
        auto r = client.Ask("report");
        if (!r.ok()) return false;
        last = absl::StrCat("client maps ", r->chunks, "; daemon: chunks ",
                            s.gpus(0).chunk_bytes(), " + unlisted ",
                            s.gpus(0).unlisted_bytes());
        return s.gpus(0).chunk_bytes() + s.gpus(0).unlisted_bytes() ==
               r->chunks;
      },
      absl::Seconds(30), absl::Milliseconds(100));
  EXPECT_TRUE(exact) << last;
  ASSERT_TRUE(client.Ask("resume").ok());
}

// Starts a steady client with `flags` and waits until it is attached with
// its holdings and trains past its budget: it then asks the daemon for room
// at every step. `*before`: its report then.
void StartPastItsBudget(DaemonProcess& daemon,
                        const std::vector<std::string>& flags,
                        SteadyClient* client, Report* before) {
  *client =
      StartSteadyClient(daemon.dir(), "steady", daemon.socket_path(), flags);
  ASSERT_NE(client->process, nullptr);
  auto attached = AttachedWithItsHoldings(daemon, *client, absl::Seconds(60));
  ASSERT_TRUE(attached.ok()) << attached.status() << "\n"
                             << ReadFileOrEmpty(client->errors);
  *before = *attached;
  ASSERT_TRUE(Progressed(*client, *before, 20));
}

void Stall(DaemonProcess& daemon, absl::Duration how_long) {
  ::kill(daemon.pid(), SIGSTOP);
  absl::SleepFor(how_long);
  ::kill(daemon.pid(), SIGCONT);
}

TEST(SessionSurvival, ADaemonStalledForThreeSecondsGetsTheClientBack) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  // Calls are not sent again: the first one past its deadline loses the
  // session (see the next test for a client that waits).
  SteadyClient client;
  Report before;
  ASSERT_NO_FATAL_FAILURE(
      StartPastItsBudget(daemon, {"--release_retry_ms=0"}, &client, &before));
  // A stall that no call for room runs into goes unseen: on a loaded
  // machine the client sometimes made none within 3 s (4 runs in 11 with a
  // benchmark beside it; a second stall caught one). Stall again until one
  // is caught.
  absl::StatusOr<Report> after;
  for (int stall = 0; stall < 5; ++stall) {
    Stall(daemon, absl::Seconds(3));
    after = AttachedWithItsHoldings(daemon, client, absl::Seconds(60));
    ASSERT_TRUE(after.ok()) << after.status() << "\n"
                            << ReadFileOrEmpty(client.errors) << "\n"
                            << daemon.Output();
    if (after->lost >= 1) break;
  }
  // It noticed (a call for room ran past its 1 s deadline), ended that
  // session on both sides and opened another; it kept training meanwhile.
  EXPECT_GE(after->lost, 1);
  EXPECT_NE(after->session, before.session);
  EXPECT_GE(after->reconnects, 1);
  EXPECT_THAT(ReadFileOrEmpty(client.errors),
              HasSubstr("lost the session with deltad"));
  // The daemon logs the old session's end once its stream handler is done,
  // which may come after the new session opened.
  const std::string ended =
      absl::StrCat("session ", before.session, " (pid ", client.process->pid());
  EXPECT_THAT(OnceItHolds([&] { return daemon.Output(); }, ended),
              HasSubstr(ended));
  EXPECT_TRUE(Progressed(client, *after, 20));
  ExpectChunksAccountedExactly(daemon, client);
  client.ExpectEveryTensorIntact();
  EXPECT_TRUE(StatusBecomes(daemon, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.host_pool_granted_bytes() == 0 &&
           s.gpus(0).chunk_bytes() == 0;
  }));
  const ExitStatus stopped = daemon.Stop();
  EXPECT_TRUE(stopped.ok()) << stopped.ToString();
}

// A daemon that answers late (a busy node) is not a lost one: the client
// sends its call for room again, the daemon applies it once, and the
// session goes on with its tensors and chunks as they were.
TEST(SessionSurvival, ADaemonLateForACallKeepsTheSession) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  SteadyClient client;
  Report before;
  ASSERT_NO_FATAL_FAILURE(StartPastItsBudget(
      daemon, {"--release_retry_ms=8000"}, &client, &before));
  // Past the client's 1 s deadline, within its 8 s of tries. A stall that
  // no call for room runs into tests nothing (a loaded machine, see the
  // test above): stall again until a call was sent again.
  absl::StatusOr<Report> after = before;
  for (int stall = 0; stall < 5; ++stall) {
    Stall(daemon, absl::Milliseconds(2500));
    ASSERT_TRUE(Progressed(client, *after, 200))
        << ReadFileOrEmpty(client.errors);
    after = client.Ask("report");
    ASSERT_TRUE(after.ok()) << after.status();
    if (after->sent_again >= 1 || after->lost > 0) break;
  }
  EXPECT_GE(after->sent_again, 1) << "no call for room met a stall";
  EXPECT_EQ(after->session, before.session);
  EXPECT_EQ(after->lost, 0) << ReadFileOrEmpty(client.errors);
  EXPECT_EQ(after->reconnects, 0);
  ExpectChunksAccountedExactly(daemon, client);
  client.ExpectEveryTensorIntact();
  const ExitStatus stopped = daemon.Stop();
  EXPECT_TRUE(stopped.ok()) << stopped.ToString();
}

TEST(SessionSurvival, ADaemonKilledAndRestartedGetsEverythingReportedAgain) {
  DaemonOptions options = SmallNode();
  const std::string dir = ::testing::TempDir();
  options.socket_path =
      dir + "/survive-" + std::to_string(::getpid()) + ".sock";
  auto first = DaemonProcess::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  // Its log outlives the first daemon's dir.
  SteadyClient client = StartSteadyClient(
      dir, "survive-" + std::to_string(::getpid()), options.socket_path);
  ASSERT_NE(client.process, nullptr);
  auto before = AttachedWithItsHoldings(**first, client, absl::Seconds(60));
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_TRUE(Progressed(client, *before, 20));

  (*first)->Kill();
  first->reset();
  // Training on alone meanwhile.
  ASSERT_TRUE(Progressed(client, *before, 40))
      << ReadFileOrEmpty(client.errors);
  auto second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();

  auto after = AttachedWithItsHoldings(**second, client, absl::Seconds(60));
  ASSERT_TRUE(after.ok()) << after.status() << "\n"
                          << ReadFileOrEmpty(client.errors);
  EXPECT_GE(after->lost, 1);
  EXPECT_GE(after->reconnects, 1);
  EXPECT_GT(after->tensors, 0);
  ExpectChunksAccountedExactly(**second, client);
  client.ExpectEveryTensorIntact();
  EXPECT_TRUE(StatusBecomes(**second, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.host_pool_granted_bytes() == 0 &&
           s.gpus(0).chunk_bytes() == 0;
  }));
  const ExitStatus stopped = (*second)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped.ToString();
}

TEST(SessionSurvival, AClientStartedBeforeTheDaemonAttachesWhenItStarts) {
  DaemonOptions options = SmallNode();
  const std::string dir = ::testing::TempDir();
  options.socket_path = dir + "/late-" + std::to_string(::getpid()) + ".sock";
  SteadyClient client = StartSteadyClient(
      dir, "late-" + std::to_string(::getpid()), options.socket_path);
  ASSERT_NE(client.process, nullptr);
  auto alone = client.Ask("report");
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->connected, 0);
  ASSERT_TRUE(Progressed(client, *alone, 20)) << ReadFileOrEmpty(client.errors);

  auto d = DaemonProcess::Start(options);
  ASSERT_TRUE(d.ok()) << d.status();
  auto attached = AttachedWithItsHoldings(**d, client, absl::Seconds(60));
  ASSERT_TRUE(attached.ok()) << attached.status() << "\n"
                             << ReadFileOrEmpty(client.errors);
  EXPECT_EQ(attached->lost, 0);
  // Its first session, but after tensors it tracked alone: a reconnect.
  EXPECT_EQ(attached->reconnects, 1);
  EXPECT_GT(attached->tensors, 0);
  EXPECT_TRUE(Progressed(client, *attached, 20));
  client.ExpectEveryTensorIntact();
  const ExitStatus stopped = (*d)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped.ToString();
}

}  // namespace
}  // namespace deltad::testing_util
