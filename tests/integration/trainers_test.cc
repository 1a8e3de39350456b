// Real deltad, real training processes (deltad-trainer: model traces
// replayed through the client library with real bytes and checksums): the
// GPU's budget split and rebalanced among them, a killed process reclaimed,
// and training that goes on when the daemon dies or was never there. A
// trainer exits non-zero if any tensor's bytes come back wrong.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/child_process.h"
#include "tests/integration/daemon_process.h"

namespace deltad::testing_util {
namespace {

using ::testing::HasSubstr;

// Two simulated GPUs of 320 MiB (288 MiB of budget each), as in
// scripts/run, and sizes scaled to match.
DaemonOptions SmallNode() {
  DaemonOptions o;
  o.sim_memory = "";
  o.host_pool = "";
  o.host_slab = "";
  o.config_text =
      // 256 KiB chunks: CUDA's 2 MiB at the jobs' scale of 1/8.
      "sim { gpus: 2 memory_bytes: 335544320 chunk_bytes: 262144 }\n"
      "min_session_bytes: 16777216\n"
      "host_pool_bytes: 2147483648\n"
      "host_slab_bytes: 16777216\n"
      "default_host_quota_bytes: 536870912\n";
  return o;
}

struct Job {
  std::unique_ptr<ChildProcess> process;
  std::string output;  // file
};

Job StartTrainer(const std::string& dir, const std::string& socket,
                 const std::string& label, int gpu,
                 const std::vector<std::string>& model, int iterations) {
  Job job;
  job.output = dir + "/" + label + ".out";
  std::vector<std::string> argv = {
      DELTAD_TRAINER_BINARY,
      "--socket=" + socket,
      "--gpu=" + std::to_string(gpu),
      "--label=" + label,
      "--scale=0.125",
      "--iterations=" + std::to_string(iterations)};
  argv.insert(argv.end(), model.begin(), model.end());
  SpawnOptions options;
  options.output_file = job.output;
  auto p = ChildProcess::Spawn(argv, options);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) job.process = std::move(*p);
  return job;
}

v1::NodeStatusResponse Status(v1::MemoryManager::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::NodeStatusResponse status;
  EXPECT_TRUE(stub.NodeStatus(&context, {}, &status).ok());
  return status;
}

// Polls until `pred` holds for the daemon's status, for up to a minute.
template <typename Pred>
bool StatusBecomes(DaemonProcess& d, Pred pred) {
  // One stub for the whole wait: each would open a connection of its own.
  auto stub = d.NewStub();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    if (pred(Status(*stub))) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

const std::vector<std::string> kUnet = {"--model=unet", "--batch=4"};
// Asks for its whole peak (190 MiB): two of them do not fit one GPU's
// 288 MiB of budget, so their shares must be split.
const std::vector<std::string> kResnet = {"--model=resnet50", "--batch=16",
                                          "--budget=1.0"};
// 355 MiB at its peak: above the GPU's budget even alone.
const std::vector<std::string> kResnetBig = {"--model=resnet50", "--batch=32"};

TEST(Trainers, TwoJobsOnOneGpuSplitItsBudgetAndKeepTheirBytes) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  Job a = StartTrainer(daemon.dir(), daemon.socket_path(), "a", 0, kResnet, 40);
  ASSERT_NE(a.process, nullptr);
  int64_t alone = 0;
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    if (s.sessions_size() != 1) return false;
    alone = s.sessions(0).budget_bytes();
    return true;
  }));
  // Long enough for a to give back what its smaller share no longer
  // covers while b still runs, on a loaded machine too.
  Job b = StartTrainer(daemon.dir(), daemon.socket_path(), "b", 0, kResnet, 8);
  ASSERT_NE(b.process, nullptr);
  // Rebalanced: a's share shrinks for b, and the two never exceed the GPU.
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    if (s.sessions_size() != 2) return false;
    const int64_t sum =
        s.sessions(0).budget_bytes() + s.sessions(1).budget_bytes();
    EXPECT_LE(sum, s.gpus(0).budget_bytes());
    return s.sessions(0).budget_bytes() < alone;
  })) << ReadFileOrEmpty(a.output);
  // Both map their budgets in the daemon's chunks: a gives back what its
  // smaller share no longer covers, and b gets real memory for its share.
  EXPECT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 2 && s.sessions(1).chunk_bytes() > 0 &&
           s.sessions(0).chunk_bytes() <= s.sessions(0).budget_bytes() &&
           s.gpus(0).chunk_bytes() <= s.gpus(0).budget_bytes();
  })) << ReadFileOrEmpty(a.output);
  const ExitStatus b_exit = b.process->WaitOrKill(absl::Seconds(120));
  EXPECT_TRUE(b_exit.ok()) << b_exit.ToString() << "\n"
                           << ReadFileOrEmpty(b.output);
  EXPECT_THAT(ReadFileOrEmpty(b.output), HasSubstr(" 0 bad"));
  // a has the GPU to itself again.
  EXPECT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 1 && s.sessions(0).budget_bytes() == alone;
  })) << ReadFileOrEmpty(a.output);
  a.process->Kill();
}

TEST(Trainers, AKilledJobIsReclaimedAtOnce) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  Job a = StartTrainer(daemon.dir(), daemon.socket_path(), "a", 1, kUnet, 100);
  ASSERT_NE(a.process, nullptr);
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 1 && s.host_pool_granted_bytes() > 0 &&
           s.sessions(0).tensors() > 0 && s.gpus(1).chunk_bytes() > 0;
  })) << ReadFileOrEmpty(a.output);
  a.process->Kill();
  // Its budget, its device chunks (mapped when it died) and its slabs.
  EXPECT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 0 && s.host_pool_granted_bytes() == 0 &&
           s.gpus(1).used_bytes() == 0 && s.gpus(1).chunk_bytes() == 0;
  }));
  EXPECT_TRUE(daemon.Running());
}

TEST(Trainers, AJobKeepsTrainingWhenTheDaemonDiesAndKeepsItsBytes) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  Job a =
      StartTrainer(daemon.dir(), daemon.socket_path(), "a", 0, kResnetBig, 4);
  ASSERT_NE(a.process, nullptr);
  ASSERT_TRUE(StatusBecomes(daemon, [&](const v1::NodeStatusResponse& s) {
    return s.sessions_size() == 1 && s.sessions(0).releases() > 0;
  })) << ReadFileOrEmpty(a.output);
  daemon.Kill();
  const ExitStatus exit = a.process->WaitOrKill(absl::Seconds(180));
  const std::string out = ReadFileOrEmpty(a.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, HasSubstr(" 0 bad"));
  EXPECT_THAT(out, HasSubstr("in-process"));
}

// The demo's GPT job (scripts/run), whose large tensors take whole chunks:
// when the chunks ran short while the daemon's chosen releases were pinned
// in the process, the client asked the daemon again and again and failed
// ("device memory is full") in about one run in three of five iterations.
TEST(Trainers, AGptJobOnFullChunksReleasesWhatItDoesNotPin) {
  auto d = DaemonProcess::Start(SmallNode());
  ASSERT_TRUE(d.ok()) << d.status();
  DaemonProcess& daemon = **d;
  for (int run = 0; run < 2; ++run) {
    Job a = StartTrainer(daemon.dir(), daemon.socket_path(),
                         "gpt" + std::to_string(run), 1,
                         {"--model=gpt", "--batch=2", "--gpt_layers=6"}, 5);
    ASSERT_NE(a.process, nullptr);
    const ExitStatus exit = a.process->WaitOrKill(absl::Seconds(180));
    const std::string out = ReadFileOrEmpty(a.output);
    EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
    EXPECT_THAT(out, HasSubstr(" 0 bad"));
  }
}

TEST(Trainers, WithoutADaemonAJobTrainsWithTheInProcessPolicy) {
  const std::string dir = ::testing::TempDir();
  Job a = StartTrainer(dir, dir + "/nothing-here.sock", "alone", 0, kUnet, 2);
  ASSERT_NE(a.process, nullptr);
  const ExitStatus exit = a.process->WaitOrKill(absl::Seconds(120));
  const std::string out = ReadFileOrEmpty(a.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, HasSubstr("in-process policy"));
  EXPECT_THAT(out, HasSubstr(" 0 bad"));
}

}  // namespace
}  // namespace deltad::testing_util
