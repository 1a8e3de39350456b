// A training process for the fault tests (faults_test.cc) that stops in the
// middle of one kind of work so that the test can SIGKILL it there:
//
//   integration_fault_client --socket=S --gpu=G
//   --phase=offload|reload|recompute
//
// It opens a session through the client library on a simulated GPU made of
// the daemon's chunks, with a slow host link (--link_mib_per_s), fills its
// budget (and the GPU, if it has room beyond) with tensors of known bytes
// and then:
//   offload    tracks tensors until the daemon orders an offload (they may
//              not be evicted), which copies for about a second;
//   reload     once those offloads are done, frees room and pins an
//              offloaded tensor: a reload of about a second;
//   recompute  (tensors may not be offloaded) pins an evicted tensor whose
//              recompute announces itself and then never returns.
// Two more phases make a budget shrink under a process that cannot give
// back its chunks yet:
//   hold       tracks tensors until its chunks are full and keeps them all
//              pinned ("phase hold") until its stdin closes, then unpins
//              them ("unpinned") and waits to be killed;
//   alloc      tracks one tensor ("done" once it has its memory).
// And one makes a process hold chunks past its budget by their rounding:
//   rounded    tracks --tensor_kib tensors (a chunk and a bit: two chunks
//              each) up to its budget, all offloadable, says "phase
//              rounded", and once its stdin closes checks every tensor's
//              bytes ("verified") and exits 0.
// It prints "session <id>" once connected and "phase <name>" just before the
// slow step starts, each flushed, for the test to act on. Exits 3 when no
// daemon answered (the test needs one), 1 on any other failure, and, if
// nobody kills it, 0 after the step with every tensor's bytes verified.
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "tests/integration/tensor_bytes.h"

ABSL_FLAG(std::string, socket, "", "deltad's socket");
ABSL_FLAG(int, gpu, 0, "GPU index");
ABSL_FLAG(std::string, phase, "offload", "offload, reload or recompute");
ABSL_FLAG(int64_t, tensor_mib, 8, "size of each tensor");
ABSL_FLAG(int64_t, tensor_kib, 0, "size of each tensor, if not 0");
ABSL_FLAG(int64_t, budget_mib, 48, "budget to ask for");
ABSL_FLAG(double, link_mib_per_s, 8, "host link bandwidth, each way");
ABSL_FLAG(int, owed_chunks_wait_ms, 10000,
          "ClientOptions::owed_chunks_wait_ms (0: fail at once)");

namespace {

using deltad::client::Client;
using deltad::client::TensorInfo;
using deltad::testing_util::FillTensor;
using deltad::testing_util::Say;
using deltad::testing_util::TensorIntact;

constexpr int64_t kMiB = int64_t{1} << 20;

int Fail(const std::string& why) {
  Say("error " + why);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string phase = absl::GetFlag(FLAGS_phase);
  if (phase != "offload" && phase != "reload" && phase != "recompute" &&
      phase != "hold" && phase != "alloc" && phase != "rounded") {
    return Fail(
        "--phase must be offload, reload, recompute, hold, alloc or rounded");
  }
  const int64_t bytes = absl::GetFlag(FLAGS_tensor_kib) > 0
                            ? absl::GetFlag(FLAGS_tensor_kib) * 1024
                            : absl::GetFlag(FLAGS_tensor_mib) * kMiB;
  const int64_t budget = absl::GetFlag(FLAGS_budget_mib) * kMiB;
  const double link = absl::GetFlag(FLAGS_link_mib_per_s) * kMiB;

  deltad::client::ClientOptions options;
  options.link.socket_path = absl::GetFlag(FLAGS_socket);
  options.link.gpu = absl::GetFlag(FLAGS_gpu);
  options.link.requested_budget_bytes = budget;
  options.link.requested_host_bytes = 4 * budget;
  options.link.label = "fault-" + phase;
  options.fallback_budget_bytes = budget;
  options.reconnect_interval_ms = 0;
  options.owed_chunks_wait_ms = absl::GetFlag(FLAGS_owed_chunks_wait_ms);
  auto device = deltad::client::SimChunkDevice::Create(64 * budget, link, link);
  if (!device.ok()) return Fail(device.status().ToString());
  auto client = Client::Connect(options, std::move(*device));
  if (!client.ok()) return Fail(client.status().ToString());
  Client& c = **client;
  if (!c.connected()) {
    Say("error no daemon answered");
    return 3;
  }
  Say("session " + std::to_string(c.Stats().session_id));

  // Whole chunks' worth of tensors (or a chunk and a bit each), up to the
  // budget, that may be offloaded but not evicted; left pinned or not.
  auto fill_budget = [&](bool pin) -> absl::StatusOr<uint64_t> {
    const int64_t fit = c.Stats().budget_bytes / bytes;
    for (uint64_t id = 1; id <= static_cast<uint64_t>(fit); ++id) {
      TensorInfo info;
      info.id = id;
      info.bytes = bytes;
      info.evict_pinned = true;
      auto out = c.Track(info, nullptr);
      if (!out.ok()) return out.status();
      FillTensor(*out, bytes, id);
      if (!pin) c.Unpin(id);
    }
    return static_cast<uint64_t>(fit);
  };
  auto wait_for_stdin_to_close = [] {
    char ignored[64];
    while (::read(0, ignored, sizeof ignored) > 0) {
    }
  };
  if (phase == "hold") {
    // All pinned: nothing can be released.
    auto count = fill_budget(/*pin=*/true);
    if (!count.ok()) return Fail(count.status().ToString());
    Say("phase hold " + std::to_string(*count));
    wait_for_stdin_to_close();
    for (uint64_t id = 1; id <= *count; ++id) c.Unpin(id);
    Say("unpinned");
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (phase == "rounded") {
    auto count = fill_budget(/*pin=*/false);
    if (!count.ok()) return Fail(count.status().ToString());
    Say("phase rounded " + std::to_string(*count));
    wait_for_stdin_to_close();
    for (uint64_t id = 1; id <= *count; ++id) {
      auto p = c.Pin(id);
      if (!p.ok()) return Fail(p.status().ToString());
      if (!TensorIntact(*p, bytes, id))
        return Fail("tensor bytes came back wrong");
      c.Unpin(id);
    }
    Say("verified offloads " + std::to_string(c.Stats().offloads));
    return 0;
  }
  if (phase == "alloc") {
    TensorInfo info;
    info.id = 1;
    info.bytes = bytes;
    auto out = c.Track(info, nullptr);
    if (!out.ok()) return Fail(out.status().ToString());
    const deltad::client::ClientStats st = c.Stats();
    Say("done connected " + std::to_string(st.connected) + " budget " +
        std::to_string(st.budget_bytes) + " local decisions " +
        std::to_string(st.local_decisions));
    return 0;
  }

  const bool recompute = phase == "recompute";
  // What the daemon may do with them: offload only, or evict only.
  auto track = [&](uint64_t id) -> absl::Status {
    TensorInfo info;
    info.id = id;
    info.bytes = bytes;
    info.compute_cost_ns = 1'000'000;
    info.evict_pinned = !recompute;
    info.offload_pinned = recompute;
    deltad::client::RecomputeFn fn;
    if (recompute) {
      fn = [](uint64_t, void*) -> absl::Status {
        Say("phase recompute");
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      };
    }
    auto out = c.Track(info, std::move(fn));
    if (!out.ok()) return out.status();
    FillTensor(*out, bytes, id);
    c.Unpin(id);
    return absl::OkStatus();
  };

  // Tracks tensors until the daemon has one released: its budget may be
  // exceeded while the GPU has room that no session holds.
  if (phase == "offload") Say("phase offload");
  uint64_t last = 0;
  uint64_t gone = 0;  // a tensor no longer resident
  while (gone == 0) {
    if (last == 512) return Fail("no tensor was released");
    if (absl::Status s = track(++last); !s.ok()) return Fail(s.ToString());
    for (uint64_t id = 1; id < last && gone == 0; ++id) {
      if (!c.Resident(id)) gone = id;
    }
  }
  c.Flush();
  if (phase == "reload") {
    // The daemon orders several offloads at once (down to its low
    // watermark) and they copy one after the other: a pin of one still
    // queued would wait for its offload first. Wait until none has ended
    // for longer than one copy takes, then every released one is on the
    // host.
    const auto copy = std::chrono::milliseconds(
        static_cast<int64_t>(1500 * static_cast<double>(bytes) / link));
    int64_t host = -1;
    auto settled = std::chrono::steady_clock::now();
    for (;;) {
      const int64_t now_host = c.Stats().host_bytes;
      if (now_host != host) {
        host = now_host;
        settled = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - settled > copy) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // Room for it, so that the pin only reloads.
    if (absl::Status s = c.Free(last); !s.ok()) return Fail(s.ToString());
    Say("phase reload");
  }
  bool restored = false;
  auto p = c.Pin(gone, &restored);
  if (!p.ok()) return Fail(p.status().ToString());
  if (!TensorIntact(*p, bytes, gone))
    return Fail("tensor bytes came back wrong");
  c.Unpin(gone);
  Say("done");
  return 0;
}
