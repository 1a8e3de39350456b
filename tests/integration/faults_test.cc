// Faults with real processes against a real deltad: a client SIGKILLed in
// the middle of an offload, a reload and a recompute is reclaimed (budget,
// device chunks, host slabs) within a second while another job on its GPU
// trains on with every checksum intact; a daemon SIGKILLed and started
// again loses no tensor of the job that outlived it; with the host pool
// exhausted the daemon evicts instead of offloading; and a budget shrunk
// under a busy job is released down to without a failure.
#include <signal.h>

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
#include "tests/integration/trainer_jobs.h"

namespace deltad::testing_util {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

// integration_fault_client on GPU 0 in `phase` with `flags`: its stdout is
// a pipe (LineStarting reads it), its stderr goes to <dir>/<name>.err.
struct FaultClient {
  std::unique_ptr<ChildProcess> process;
  std::string errors;  // the file
};
FaultClient StartFaultClient(DaemonProcess& daemon, const std::string& name,
                             const std::string& phase,
                             std::vector<std::string> flags = {},
                             bool pipe_stdin = false) {
  FaultClient c;
  SpawnOptions options;
  options.pipe_stdout = true;
  options.pipe_stdin = pipe_stdin;
  c.errors = daemon.dir() + "/" + name + ".err";
  options.output_file = c.errors;
  std::vector<std::string> argv = {DELTAD_FAULT_CLIENT_BINARY,
                                   "--socket=" + daemon.socket_path(),
                                   "--gpu=0", "--phase=" + phase};
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto p = ChildProcess::Spawn(argv, options);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) c.process = std::move(*p);
  return c;
}

// A session's tensors as the daemon sees them, asked as `peer` (this
// test's own process, so the same user as every client here).
std::vector<v1::TensorStatus> Tensors(DaemonProcess& d, const Peer& peer,
                                      uint64_t session_id) {
  auto stub = d.NewStub();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::ListTensorsRequest request;
  request.set_session_id(session_id);
  request.set_peer_token(peer.token());
  request.set_limit(1000);
  v1::ListTensorsResponse response;
  if (!stub->ListTensors(&context, request, &response).ok()) return {};
  return {response.tensors().begin(), response.tensors().end()};
}

bool AnyInState(const std::vector<v1::TensorStatus>& tensors,
                const std::string& state) {
  for (const v1::TensorStatus& t : tensors) {
    if (t.state() == state) return true;
  }
  return false;
}

// Everything on GPU `gpu` belongs to the sessions still open: no chunk, no
// device byte and no host slab of a dead session is left behind.
// `host_granted_before`: the pool's grants while only `other` was open.
bool OnlyOpenSessionsHold(const v1::NodeStatusResponse& s, int gpu,
                          uint64_t other, int64_t host_granted_before) {
  int64_t chunks = 0, used = 0;
  for (const v1::SessionStatus& session : s.sessions()) {
    if (session.gpu() != gpu) continue;
    chunks += session.chunk_bytes();
    used += session.device_bytes();
  }
  const int64_t host =
      FindSession(s, other) != nullptr ? host_granted_before : 0;
  return s.gpus(gpu).chunk_bytes() == chunks &&
         s.gpus(gpu).used_bytes() == used &&
         s.host_pool_granted_bytes() == host;
}

// From a trainer's SUMMARY: how many of its releases the daemon ordered.
// It says "(X of Y releases and prefetches chosen in-process)" when the
// client chose some itself; without it, every release was ordered (1 here:
// some). -1 when there is no summary.
int DaemonOrdered(const std::string& out) {
  const size_t summary = out.find("SUMMARY");
  if (summary == std::string::npos) return -1;
  const size_t said = out.find(" releases and prefetches chosen", summary);
  if (said == std::string::npos) return 1;
  int local = 0, all = 0;
  const size_t open = out.rfind('(', said);
  if (std::sscanf(out.c_str() + open, "(%d of %d", &local, &all) != 2) {
    return -1;
  }
  return all - local;
}

class KilledMidTransfer : public ::testing::TestWithParam<std::string> {};

TEST_P(KilledMidTransfer, IsReclaimedWithinOneSecondAndOthersKeepTheirBytes) {
  const std::string phase = GetParam();
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  auto peer = Peer::Connect(daemon.side_socket_path());
  ASSERT_TRUE(peer.ok()) << peer.status();

  // Another job on the same GPU.
  Job other =
      StartTrainer(daemon.dir(), daemon.socket_path(), "other", 0, kUnet, 20);
  ASSERT_NE(other.process, nullptr);
  int64_t host_before = 0;
  uint64_t other_id = 0;
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    if (s.sessions_size() != 1 || s.sessions(0).tensors() == 0) return false;
    host_before = s.host_pool_granted_bytes();
    other_id = s.sessions(0).session_id();
    return true;
  })) << ReadFileOrEmpty(other.output);

  FaultClient fault = StartFaultClient(daemon, "fault", phase);
  ASSERT_NE(fault.process, nullptr);
  auto session_line =
      LineStarting(*fault.process, "session ", absl::Seconds(60));
  ASSERT_TRUE(session_line.ok()) << session_line.status();
  const uint64_t session_id = std::stoull(session_line->substr(8));
  auto phase_line =
      LineStarting(*fault.process, "phase " + phase, absl::Seconds(60));
  ASSERT_TRUE(phase_line.ok()) << phase_line.status() << "\n"
                               << ReadFileOrEmpty(fault.errors);

  if (phase == "offload") {
    // The daemon has ordered the offload and the copy (a second) runs.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    bool offloading = false;
    while (!offloading && absl::Now() < deadline) {
      offloading = AnyInState(Tensors(daemon, *peer, session_id), "offloading");
    }
    ASSERT_TRUE(offloading) << "no tensor was seen offloading";
  } else if (phase == "reload") {
    // The pin's reload takes a second; the daemon hears of it at the end.
    absl::SleepFor(absl::Milliseconds(200));
    const std::vector<v1::TensorStatus> now =
        Tensors(daemon, *peer, session_id);
    EXPECT_TRUE(AnyInState(now, "offloaded") || AnyInState(now, "reloading"))
        << "the reload was over before the kill";
  }
  // In a recompute, the client's callback announced itself and never
  // returns: the kill lands inside it.
  const v1::NodeStatusResponse before =
      Status(*daemon.NewStub());  // the victim holds chunks and slabs
  const v1::SessionStatus* victim = FindSession(before, session_id);
  ASSERT_NE(victim, nullptr);
  EXPECT_GT(victim->chunk_bytes(), 0);
  EXPECT_GT(before.host_pool_granted_bytes(), host_before);

  fault.process->Kill();
  const absl::Time killed = absl::Now();
  v1::NodeStatusResponse last;
  ASSERT_TRUE(StatusBecomes(
      daemon,
      [&](const v1::NodeStatusResponse& s) {
        last = s;
        return FindSession(s, session_id) == nullptr &&
               OnlyOpenSessionsHold(s, 0, other_id, host_before);
      },
      absl::Seconds(10), absl::Milliseconds(5)))
      << "host granted before " << host_before << ", status now "
      << last.DebugString();
  const absl::Duration took = absl::Now() - killed;
  RecordProperty("reclaim_ms", static_cast<int>(took / absl::Milliseconds(1)));
  std::printf("killed mid-%s: reclaimed in %.0f ms\n", phase.c_str(),
              absl::ToDoubleMilliseconds(took));
  EXPECT_LE(took, absl::Seconds(1));

  const ExitStatus exit = other.process->WaitOrKill(absl::Seconds(180));
  const std::string out = ReadFileOrEmpty(other.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, HasSubstr(" 0 bad"));
  EXPECT_TRUE(daemon.Running());
  EXPECT_TRUE(StatusBecomes(daemon, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.host_pool_granted_bytes() == 0 &&
           s.gpus(0).chunk_bytes() == 0 && s.gpus(0).used_bytes() == 0;
  }));
}

INSTANTIATE_TEST_SUITE_P(Faults, KilledMidTransfer,
                         ::testing::Values("offload", "reload", "recompute"),
                         [](const auto& p) { return p.param; });

// A process opens on a GPU whose chunks another holds, all pinned: its
// share is owed to it, and comes only when the other can let go. Its
// allocation waits for that instead of failing (it once failed at once,
// "can free at most 0 bytes", as 21 runs of bench/soak did).
TEST(Faults, AnAllocationWaitsForChunksItsBudgetIsOwed) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  // The whole GPU's budget (288 MiB) in 8 MiB tensors, all pinned.
  FaultClient holder =
      StartFaultClient(daemon, "holder", "hold",
                       {"--budget_mib=288", "--link_mib_per_s=0"}, true);
  ASSERT_NE(holder.process, nullptr);
  auto held = LineStarting(*holder.process, "phase hold", absl::Seconds(60));
  ASSERT_TRUE(held.ok()) << held.status() << "\n"
                         << ReadFileOrEmpty(holder.errors);
  ASSERT_TRUE(StatusBecomes(daemon, [](const v1::NodeStatusResponse& s) {
    return s.gpus(0).chunk_bytes() == s.gpus(0).budget_bytes();
  }));

  FaultClient alloc = StartFaultClient(
      daemon, "alloc", "alloc",
      {"--budget_mib=64", "--tensor_mib=48", "--link_mib_per_s=0"});
  ASSERT_NE(alloc.process, nullptr);
  ASSERT_TRUE(LineStarting(*alloc.process, "session ", absl::Seconds(60)).ok());
  // 48 MiB: more than the GPU's memory beyond its budget (32 MiB), which
  // the daemon lends at once. It waits while the holder pins everything...
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(alloc.process->Running()) << ReadFileOrEmpty(alloc.errors);
  // ...and gets its memory once the holder lets go.
  holder.process->CloseStdin();
  ASSERT_TRUE(
      LineStarting(*holder.process, "unpinned", absl::Seconds(30)).ok());
  auto done = LineStarting(*alloc.process, "done", absl::Seconds(30));
  EXPECT_TRUE(done.ok()) << done.status() << "\n"
                         << ReadFileOrEmpty(alloc.errors);
  const ExitStatus exit = alloc.process->WaitOrKill(absl::Seconds(30));
  EXPECT_TRUE(exit.ok()) << exit.ToString();
  EXPECT_TRUE(daemon.Running());
}

TEST(Faults, ChunksHeldPastABudgetByRoundingGoToTheSessionOwedThem) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  // 64 MiB of budget in tensors of a 256 KiB chunk and a bit: two chunks
  // each, 120 MiB of chunks in all, lent while the GPU had room.
  FaultClient holder = StartFaultClient(
      daemon, "rounded", "rounded",
      {"--budget_mib=64", "--tensor_kib=272", "--link_mib_per_s=0"}, true);
  ASSERT_NE(holder.process, nullptr);
  auto held = LineStarting(*holder.process, "phase rounded", absl::Seconds(60));
  ASSERT_TRUE(held.ok()) << held.status() << "\n"
                         << ReadFileOrEmpty(holder.errors);
  // The rest of the GPU's budget, in one tensor larger than the chunks no
  // one holds (320 MiB of memory): the holder owes it chunks that its
  // budget's bytes fit in but its tensors keep in use. It gives them back
  // by offloading, well within the wait for owed chunks.
  FaultClient alloc = StartFaultClient(
      daemon, "alloc", "alloc",
      {"--budget_mib=224", "--tensor_mib=216", "--link_mib_per_s=0"});
  ASSERT_NE(alloc.process, nullptr);
  auto done = LineStarting(*alloc.process, "done", absl::Seconds(60));
  EXPECT_TRUE(done.ok()) << done.status() << "\n"
                         << ReadFileOrEmpty(alloc.errors);
  const ExitStatus exit = alloc.process->WaitOrKill(absl::Seconds(30));
  EXPECT_TRUE(exit.ok()) << exit.ToString();
  // And keeps every byte.
  holder.process->CloseStdin();
  auto verified = LineStarting(*holder.process, "verified", absl::Seconds(60));
  EXPECT_TRUE(verified.ok()) << verified.status() << "\n"
                             << ReadFileOrEmpty(holder.errors);
  EXPECT_TRUE(holder.process->WaitOrKill(absl::Seconds(30)).ok());
  EXPECT_TRUE(daemon.Running());
}

TEST(Faults, ADaemonKilledAndRestartedLosesNoTensor) {
  DaemonOptions options = SmallNode();
  const std::string dir = ::testing::TempDir();
  options.socket_path =
      dir + "/restart-" + std::to_string(::getpid()) + ".sock";
  auto first = DaemonProcess::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  // Iterations enough to outlast the new daemon's start on a loaded
  // machine: it must find the job still training. It stops 2 iterations
  // after it has a session with the new daemon (the rest took a minute).
  std::vector<std::string> args = kResnetBig;
  args.push_back("--iterations_after_reconnect=2");
  Job job = StartTrainer(dir, options.socket_path, "survivor", 0, args, 30);
  ASSERT_NE(job.process, nullptr);
  ASSERT_TRUE(StatusBecomes(**first, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 1 && s.sessions(0).releases() > 0;
  })) << ReadFileOrEmpty(job.output);
  (*first)->Kill();
  // It trains on alone for a while, then finds the new daemon, its stale
  // socket taken over.
  absl::SleepFor(absl::Seconds(2));
  ASSERT_TRUE(job.process->Running()) << ReadFileOrEmpty(job.output);
  auto second = DaemonProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(StatusBecomes(**second, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 1 && s.sessions(0).tensors() > 0;
  })) << ReadFileOrEmpty(job.output);
  // 30 iterations, if it never reconnected, take about 80 s in the normal
  // build and about 300 s under ASan on 2 cores.
  const ExitStatus exit = job.process->WaitOrKill(absl::Seconds(600));
  const std::string out = ReadFileOrEmpty(job.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, HasSubstr(" 0 bad"));
  EXPECT_THAT(out, HasSubstr("in-process"));
  EXPECT_THAT(out, HasSubstr("(reconnected)"));
  EXPECT_THAT(out, HasSubstr("stopping after 2 iterations with the session "
                             "opened again"));
  // The new daemon is clean once the job has gone.
  EXPECT_TRUE(StatusBecomes(**second, [](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.host_pool_granted_bytes() == 0 &&
           s.gpus(0).chunk_bytes() == 0;
  }));
  const ExitStatus stopped = (*second)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped.ToString() << "\n"
                            << (*second)->Output();
}

TEST(Faults, WithTheHostPoolExhaustedTheDaemonEvictsInsteadOfOffloading) {
  DaemonOptions options = SmallNode();
  // One 16 MiB slab in all, taken by the first session.
  options.config_text =
      "sim { gpus: 2 memory_bytes: 335544320 chunk_bytes: 262144 }\n"
      "min_session_bytes: 16777216\n"
      "host_pool_bytes: 16777216\n"
      "host_slab_bytes: 16777216\n"
      "default_host_quota_bytes: 16777216\n";
  auto d = DaemonProcess::Start(options);
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  auto holder = PeerProcess::Start(daemon.side_socket_path());
  ASSERT_TRUE(holder.ok()) << holder.status();
  {
    auto stub = daemon.NewStub();
    grpc::ClientContext context;
    v1::OpenSessionRequest request;
    request.set_gpu(1);
    request.set_peer_token((*holder)->token());
    v1::OpenSessionResponse response;
    ASSERT_TRUE(stub->OpenSession(&context, request, &response).ok());
    ASSERT_EQ(response.host_quota_bytes(), 16 << 20);
  }
  // The whole GPU as its budget, on a device of its own memory (not the
  // daemon's chunks, whose rounding makes the client choose releases
  // itself), so that the daemon's orders keep it within the GPU.
  Job job = StartTrainer(
      daemon.dir(), daemon.socket_path(), "nohost", 0,
      {"--model=resnet50", "--batch=32", "--budget=1.0", "--memory=heap"}, 2);
  ASSERT_NE(job.process, nullptr);
  const ExitStatus exit = job.process->WaitOrKill(absl::Seconds(180));
  const std::string out = ReadFileOrEmpty(job.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, HasSubstr(" 0 bad"));
  // Above its budget, with nowhere to offload: recomputes, no offloads.
  EXPECT_THAT(out, ContainsRegex("SUMMARY.* offloaded +0 B "));
  EXPECT_THAT(out, Not(ContainsRegex("SUMMARY.* recomputes +0 ")));
  // The daemon ordered releases, and so it evicted: some were its orders.
  EXPECT_GT(DaemonOrdered(out), 0) << out;
  EXPECT_TRUE(daemon.Running());
}

TEST(Faults, ABudgetShrunkUnderABusyJobIsReleasedDownTo) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  Job busy =
      StartTrainer(daemon.dir(), daemon.socket_path(), "busy", 0, kResnet, 12);
  ASSERT_NE(busy.process, nullptr);
  int64_t alone = 0;
  uint64_t busy_id = 0;
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    if (s.sessions_size() != 1 || s.sessions(0).device_bytes() == 0) {
      return false;
    }
    alone = s.sessions(0).budget_bytes();
    busy_id = s.sessions(0).session_id();
    return true;
  })) << ReadFileOrEmpty(busy.output);
  // A job of four times its weight takes most of the GPU.
  Job heavy = StartTrainer(
      daemon.dir(), daemon.socket_path(), "heavy", 0,
      {"--model=resnet50", "--batch=16", "--budget=1.0", "--priority=4"}, 3);
  ASSERT_NE(heavy.process, nullptr);
  int64_t shrunk = 0;
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* b = FindSession(s, busy_id);
    if (b == nullptr || s.sessions_size() != 2) return false;
    shrunk = b->budget_bytes();
    return shrunk < alone;
  })) << ReadFileOrEmpty(busy.output);
  // The busy job comes down to its new budget, device bytes and chunks.
  EXPECT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    const v1::SessionStatus* b = FindSession(s, busy_id);
    return b != nullptr && b->device_bytes() <= b->budget_bytes() &&
           b->chunk_bytes() <= b->budget_bytes() &&
           s.gpus(0).chunk_bytes() <= s.gpus(0).budget_bytes();
  })) << ReadFileOrEmpty(busy.output);
  for (Job* job : {&heavy, &busy}) {
    const ExitStatus exit = job->process->WaitOrKill(absl::Seconds(240));
    const std::string out = ReadFileOrEmpty(job->output);
    EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
    EXPECT_THAT(out, HasSubstr(" 0 bad"));
  }
  EXPECT_TRUE(daemon.Running());
}

}  // namespace
}  // namespace deltad::testing_util
