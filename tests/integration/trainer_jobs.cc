#include "tests/integration/trainer_jobs.h"

#include <chrono>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::testing_util {

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

std::string ExpectCleanExit(Job& job, absl::Duration timeout) {
  EXPECT_NE(job.process, nullptr) << "the trainer did not start";
  if (job.process == nullptr) return "";
  const ExitStatus exit = job.process->WaitOrKill(timeout);
  const std::string out = ReadFileOrEmpty(job.output);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << "\n" << out;
  EXPECT_THAT(out, ::testing::HasSubstr(" 0 bad"));
  return out;
}

v1::NodeStatusResponse Status(v1::MemoryManager::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  v1::NodeStatusResponse status;
  EXPECT_TRUE(stub.NodeStatus(&context, {}, &status).ok());
  return status;
}

const v1::SessionStatus* FindSession(const v1::NodeStatusResponse& s,
                                     uint64_t session_id) {
  for (const v1::SessionStatus& session : s.sessions()) {
    if (session.session_id() == session_id) return &session;
  }
  return nullptr;
}

}  // namespace deltad::testing_util
