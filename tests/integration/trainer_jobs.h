#ifndef DELTAD_TESTS_INTEGRATION_TRAINER_JOBS_H_
#define DELTAD_TESTS_INTEGRATION_TRAINER_JOBS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "tests/integration/child_process.h"
#include "tests/integration/daemon_process.h"

// Real training processes (tools/trainer: model traces replayed through the
// client library with real bytes and checksums) against a real deltad, for
// the integration tests that need jobs, not hand-written requests.
namespace deltad::testing_util {

// Two simulated GPUs of 320 MiB (288 MiB of budget each), as in
// scripts/run, 256 KiB chunks, a 2 GiB host pool of 16 MiB slabs.
DaemonOptions SmallNode();

inline const std::vector<std::string> kUnet = {"--model=unet", "--batch=4"};
// Asks for its whole peak (190 MiB): two of them do not fit one GPU's
// 288 MiB of budget, so their shares must be split.
inline const std::vector<std::string> kResnet = {"--model=resnet50",
                                                 "--batch=16", "--budget=1.0"};
// 355 MiB at its peak: above the GPU's budget even alone.
inline const std::vector<std::string> kResnetBig = {"--model=resnet50",
                                                    "--batch=32"};

struct Job {
  std::unique_ptr<ChildProcess> process;
  std::string output;  // file with its stdout and stderr
};

// Starts deltad-trainer at scale 1/8 with `model`'s flags
// (--model=... --batch=...); its output goes to <dir>/<label>.out.
Job StartTrainer(const std::string& dir, const std::string& socket,
                 const std::string& label, int gpu,
                 const std::vector<std::string>& model, int iterations);

// Waits for `job` to exit (killed past `timeout`) and expects exit code 0
// and no bad checksum; returns its output, which the failures quote.
std::string ExpectCleanExit(Job& job, absl::Duration timeout);

// NodeStatus over `stub`, with a 10 s deadline; an empty answer on failure
// (the test fails too).
v1::NodeStatusResponse Status(v1::MemoryManager::Stub& stub);

// Polls (every `every`) until `pred` holds for the daemon's status, for up
// to `timeout`.
template <typename Pred>
bool StatusBecomes(DaemonProcess& d, Pred pred,
                   absl::Duration timeout = absl::Seconds(60),
                   absl::Duration every = absl::Milliseconds(20)) {
  // One stub for the whole wait: each would open a connection of its own.
  auto stub = d.NewStub();
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred(Status(*stub))) return true;
    absl::SleepFor(every);
  }
  return false;
}

// The session's record in `s`, or null.
const v1::SessionStatus* FindSession(const v1::NodeStatusResponse& s,
                                     uint64_t session_id);

}  // namespace deltad::testing_util

#endif  // DELTAD_TESTS_INTEGRATION_TRAINER_JOBS_H_
