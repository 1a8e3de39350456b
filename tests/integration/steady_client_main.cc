// A training process for the session survival tests
// (session_survival_test.cc) that keeps working through whatever happens
// to the daemon:
//
//   integration_steady_client --socket=S [--budget_mib=32 ...]
//
// It tracks 1 MiB tensors of known bytes (offloadable, never evicted)
// without end, keeping a window of them alive past its budget so that it
// keeps asking the daemon for room, frees the oldest, and checks the bytes
// of an older one at every step. It needs no daemon to start: it decides
// alone until one answers. Commands on stdin, one a line:
//   pause   stops between two steps, sends what is waiting to the daemon
//           and answers with a report line;
//   report  a report line (paused or not);
//   resume  goes on;
//   exit    (or stdin closed) checks every live tensor's bytes, says
//           "verified <n> bad <m>" and exits 0 when none was bad.
// A report line is "report connected <0|1> session <id> device_bytes <n>
// tensors <n> lost <n> reconnects <n> steps <n> budget <n> sync_releases
// <n> chunks <n>" (chunks: the device chunk bytes it maps). It prints
// "started" once running, and exits 1 on any failure ("error <why>").
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "tests/integration/tensor_bytes.h"

ABSL_FLAG(std::string, socket, "", "deltad's socket");
ABSL_FLAG(int64_t, budget_mib, 32, "budget to ask for");
ABSL_FLAG(int64_t, window_mib, 40, "live tensors kept, in MiB");
ABSL_FLAG(int64_t, local_chunk_kib, 256,
          "chunk size while no daemon has granted any");
ABSL_FLAG(int, rpc_timeout_ms, 1000, "LinkOptions::rpc_timeout_ms");
ABSL_FLAG(int, release_retry_ms, 8000, "LinkOptions::release_retry_ms");
ABSL_FLAG(int, reconnect_ms, 100, "ClientOptions::reconnect_interval_ms");
ABSL_FLAG(int, max_reconnect_ms, 1000,
          "ClientOptions::max_reconnect_interval_ms");

namespace {

using deltad::client::Client;
using deltad::client::TensorInfo;
using deltad::testing_util::FillTensor;
using deltad::testing_util::Say;
using deltad::testing_util::TensorIntact;

constexpr int64_t kMiB = int64_t{1} << 20;

// The commands read from stdin by a thread of their own, so that the
// training loop never blocks on them.
class Commands {
 public:
  Commands() {
    reader_ = std::thread([this] {
      std::string line;
      char c;
      while (::read(0, &c, 1) == 1) {
        if (c != '\n') {
          line += c;
          continue;
        }
        Push(line);
        line.clear();
      }
      Push("exit");
    });
    reader_.detach();  // blocked in read() until the process ends
  }
  // The next command, or "" when none is waiting.
  std::string Next() {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty()) return "";
    std::string c = queue_.front();
    queue_.pop_front();
    return c;
  }

 private:
  void Push(const std::string& c) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(c);
  }
  std::mutex mu_;
  std::deque<std::string> queue_;
  std::thread reader_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t budget = absl::GetFlag(FLAGS_budget_mib) * kMiB;
  const int64_t window = absl::GetFlag(FLAGS_window_mib);
  deltad::client::ClientOptions options;
  options.link.socket_path = absl::GetFlag(FLAGS_socket);
  options.link.gpu = 0;
  options.link.requested_budget_bytes = budget;
  options.link.requested_host_bytes = 4 * budget;
  options.link.label = "steady";
  options.link.rpc_timeout_ms = absl::GetFlag(FLAGS_rpc_timeout_ms);
  options.link.release_retry_ms = absl::GetFlag(FLAGS_release_retry_ms);
  options.fallback_budget_bytes = budget;
  options.fallback_host_bytes = 4 * budget;
  options.reconnect_interval_ms = absl::GetFlag(FLAGS_reconnect_ms);
  options.max_reconnect_interval_ms = absl::GetFlag(FLAGS_max_reconnect_ms);
  auto device = deltad::client::SimChunkDevice::Create(
      64 * budget, 0, 0, absl::GetFlag(FLAGS_local_chunk_kib) * 1024);
  if (!device.ok()) {
    Say("error " + device.status().ToString());
    return 1;
  }
  auto client = Client::Connect(options, std::move(*device));
  if (!client.ok()) {
    Say("error " + client.status().ToString());
    return 1;
  }
  Client& c = **client;
  Commands commands;
  std::deque<uint64_t> live;
  uint64_t next = 1;
  int64_t steps = 0;
  auto report = [&] {
    const deltad::client::ClientStats s = c.Stats();
    Say(absl::StrCat(
        "report connected ", s.connected ? 1 : 0, " session ", s.session_id,
        " device_bytes ", s.device_bytes, " tensors ", live.size(), " lost ",
        s.sessions_lost, " reconnects ", s.reconnects, " steps ", steps,
        " budget ", s.budget_bytes, " sync_releases ", s.sync_releases,
        " chunks ", s.chunk_bytes, " sent_again ", s.release_calls_sent_again));
  };
  Say("started");
  bool paused = false;
  for (;;) {
    const std::string command = commands.Next();
    if (command == "exit") break;
    if (command == "pause") paused = true;
    if (command == "resume") paused = false;
    if (!command.empty()) {
      c.Flush();
      report();
    }
    if (paused || !command.empty()) {
      if (paused) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    TensorInfo info;
    info.id = next++;
    info.bytes = kMiB;
    info.evict_pinned = true;
    auto out = c.Track(info, nullptr);
    if (!out.ok()) {
      Say("error " + out.status().ToString());
      return 1;
    }
    FillTensor(*out, kMiB, info.id);
    c.Unpin(info.id);
    live.push_back(info.id);
    if (static_cast<int64_t>(live.size()) > window) {
      if (absl::Status s = c.Free(live.front()); !s.ok()) {
        Say("error " + s.ToString());
        return 1;
      }
      live.pop_front();
    }
    // An older one, likely offloaded: its bytes must come back whole.
    const uint64_t old = live[live.size() / 3];
    auto p = c.Pin(old);
    if (!p.ok()) {
      Say("error " + p.status().ToString());
      return 1;
    }
    const bool good = TensorIntact(*p, kMiB, old);
    c.Unpin(old);
    if (!good) {
      Say(absl::StrCat("error tensor ", old, " came back wrong"));
      return 1;
    }
    ++steps;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  int bad = 0;
  for (uint64_t id : live) {
    auto p = c.Pin(id);
    if (!p.ok() || !TensorIntact(*p, kMiB, id)) ++bad;
    if (p.ok()) c.Unpin(id);
  }
  Say(absl::StrCat("verified ", live.size(), " bad ", bad));
  return bad == 0 ? 0 : 1;
}
