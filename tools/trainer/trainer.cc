// deltad-trainer: a demo training process. It replays one model's training
// iteration (the simulator's model traces: every tensor with its exact size,
// producer, parents and modelled compute time) through the client library,
// with real bytes in (simulated) device memory, under a budget below the
// model's peak. Every tensor's bytes carry a checksum that is verified
// after each reload and each recompute; a mismatch fails the run.
//
// Sizes are scaled down by --scale so that several jobs fit this machine;
// the host link is scaled by the same factor, so a copy takes as long as
// the unscaled copy would, and compute runs at the modelled speed.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "client/sim_chunk_device.h"
#include "client/sim_device.h"
#include "common/fd_limit.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/program.h"
#include "tools/table.h"

ABSL_FLAG(std::string, socket, "/run/deltad/deltad.sock", "deltad's socket");
ABSL_FLAG(bool, daemon, true, "use deltad (false: the in-process policy)");
ABSL_FLAG(int, gpu, 0, "GPU index");
ABSL_FLAG(std::string, model, "resnet50",
          "resnet50, resnet101, resnet152, densenet121, vgg16, unet, gpt");
ABSL_FLAG(int, batch, 32, "batch size");
ABSL_FLAG(int, gpt_layers, 12, "transformer blocks (gpt)");
ABSL_FLAG(int, gpt_seq, 1024, "sequence length (gpt)");
ABSL_FLAG(std::string, memory, "chunks",
          "where tensors live: \"chunks\" maps the daemon's device chunks "
          "(memfds standing in for GPU memory) into one address range, as "
          "a CUDA process does; \"heap\" allocates from the process heap");
ABSL_FLAG(std::string, device, "a100-80gb",
          "device profile for compute times and link bandwidth");
ABSL_FLAG(double, scale, 1.0 / 16, "bytes are multiplied by this");
ABSL_FLAG(int, chunk_kib, 0,
          "device chunk size, KiB, when the chunks are made in-process (no "
          "daemon yet): the daemon's, so that the job can attach when the "
          "daemon answers (0: CUDA's 2 MiB at --scale)");
ABSL_FLAG(double, budget, 0.6,
          "budget to request, as a fraction of the unmanaged peak");
ABSL_FLAG(int, iterations, 3, "training iterations");
ABSL_FLAG(int, iterations_after_reconnect, 0,
          "once the session was opened again (a daemon restarted), stop after "
          "this many more iterations with it, before --iterations (0: run "
          "them all)");
ABSL_FLAG(std::string, label, "", "job name (default: model)");
ABSL_FLAG(int, priority, 1, "weight in the GPU's fair share");
ABSL_FLAG(double, min_budget, 0,
          "the floor to declare, as a fraction of the requested budget: no "
          "later admission cuts the job below it (0: none; the peak of each "
          "iteration is reported either way)");
ABSL_FLAG(int, admission_wait_ms, 0,
          "how long to ask a daemon that refuses the session again");
ABSL_FLAG(bool, copy_ahead, true,
          "copy the forward pass's tensors to the host while the link idles "
          "(ClientOptions::copy_ahead)");
ABSL_FLAG(bool, require_session, false,
          "fail closed: exit when no session with deltad could be opened "
          "instead of training on the in-process policy");

namespace {

using deltad::client::Client;
using deltad::client::ClientOptions;
using deltad::client::TensorInfo;
using deltad::sim::Program;
using Clock = std::chrono::steady_clock;

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The op's "result": bytes that depend on the tensor and the iteration, so
// a stale, mixed-up or torn copy shows in the checksum.
uint64_t Fill(void* out, int64_t bytes, uint64_t seed) {
  auto* p = static_cast<unsigned char*>(out);
  uint64_t sum = 0;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t v = Mix(seed + static_cast<uint64_t>(i));
    std::memcpy(p + i, &v, 8);
    sum = sum * 31 + v;
  }
  for (; i < bytes; ++i) {
    p[i] = static_cast<unsigned char>(seed + static_cast<uint64_t>(i));
    sum = sum * 31 + p[i];
  }
  return sum;
}

uint64_t Checksum(const void* data, int64_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t sum = 0;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    sum = sum * 31 + v;
  }
  for (; i < bytes; ++i) sum = sum * 31 + p[i];
  return sum;
}

std::string Human(double bytes) {
  return deltad::tools::FormatBytes(static_cast<int64_t>(bytes));
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "deltad-trainer: %s\n", what.c_str());
  return 1;
}

class Replay {
 public:
  Replay(Client& client, const Program& program, double scale, int iteration,
         std::vector<uint64_t>& checksums, int64_t& mismatches)
      : client_(client),
        program_(program),
        scale_(scale),
        iteration_(iteration),
        checksums_(checksums),
        mismatches_(mismatches) {}

  uint64_t Id(int32_t storage) const {
    return static_cast<uint64_t>(iteration_) * program_.storages.size() +
           static_cast<uint64_t>(storage) + 1;
  }
  int64_t Bytes(int64_t bytes) const {
    return std::max<int64_t>(8, static_cast<int64_t>(bytes * scale_));
  }
  uint64_t Seed(int32_t storage) const {
    return Mix(Id(storage) * 1315423911ULL + 7);
  }

  // Pins a tensor and verifies its bytes when they came back.
  absl::StatusOr<void*> PinChecked(int32_t storage) {
    bool restored = false;
    auto p = client_.Pin(Id(storage), &restored);
    if (!p.ok()) return p.status();
    if (restored) {
      ++verified_;
      if (Checksum(*p, Bytes(program_.storages[storage].bytes)) !=
          checksums_[storage]) {
        ++mismatches_;
      }
    }
    return p;
  }

  // The op that makes `storage`: reads its parents, writes its bytes.
  absl::Status Produce(int32_t storage, void* out, bool recompute) {
    const deltad::sim::Storage& s = program_.storages[storage];
    std::vector<int32_t> pinned;
    absl::Status status;
    if (recompute) {
      for (int32_t p : s.parents) {
        auto got = PinChecked(p);
        if (!got.ok()) {
          status = got.status();
          break;
        }
        pinned.push_back(p);
      }
    }
    if (status.ok()) {
      const uint64_t sum = Fill(out, Bytes(s.bytes), Seed(storage));
      if (recompute) {
        ++verified_;
        if (sum != checksums_[storage]) ++mismatches_;
        if (s.producer >= 0) {
          std::this_thread::sleep_for(
              std::chrono::nanoseconds(program_.steps[s.producer].time_ns));
        }
      } else {
        checksums_[storage] = sum;
      }
    }
    for (int32_t p : pinned) client_.Unpin(Id(p));
    return status;
  }

  absl::Status Track(int32_t storage, int64_t compute_ns,
                     bool copy_ahead = false) {
    const deltad::sim::Storage& s = program_.storages[storage];
    TensorInfo info;
    info.id = Id(storage);
    info.bytes = Bytes(s.bytes);
    // A storage replaced in place is gone by the time its result is
    // tracked (Run): the client cannot rebuild the result from it, where
    // the simulator rebuilds dead storages for a child.
    bool orphan = false;
    for (int32_t p : s.parents) {
      if (live_[p]) {
        info.parents.push_back(Id(p));
      } else {
        orphan = true;
      }
    }
    const bool recomputable = s.recomputable && !orphan;
    info.compute_cost_ns = compute_ns;
    info.uncomputable = !recomputable;
    info.stable_key = static_cast<uint64_t>(storage) + 1;
    info.copy_ahead = copy_ahead;
    deltad::client::RecomputeFn fn;
    if (recomputable) {
      fn = [this, storage](uint64_t, void* out) {
        return Produce(storage, out, /*recompute=*/true);
      };
    }
    auto out = client_.Track(info, std::move(fn));
    if (!out.ok()) return out.status();
    return Produce(storage, *out, /*recompute=*/false);
  }

  absl::Status Run(int64_t& work_ns) {
    live_.assign(program_.storages.size(), false);
    std::vector<bool>& live = live_;
    for (size_t i = 0; i < program_.storages.size(); ++i) {
      if (!program_.storages[i].constant) continue;
      const auto start = Clock::now();
      if (absl::Status s = Track(static_cast<int32_t>(i), 0); !s.ok()) {
        return s;
      }
      client_.Unpin(Id(static_cast<int32_t>(i)));
      live[i] = true;
      work_ns += (Clock::now() - start).count();
    }
    auto free = [&](int32_t s) -> absl::Status {
      if (!live[s]) return absl::OkStatus();
      live[s] = false;
      return client_.Free(Id(s));
    };
    for (int32_t s : program_.initial_frees) {
      if (absl::Status st = free(s); !st.ok()) return st;
    }
    uint64_t workspace_id =
        (uint64_t{1} << 62) + static_cast<uint64_t>(iteration_) * 1000000;
    for (const deltad::sim::Step& step : program_.steps) {
      std::vector<uint64_t> pinned;
      absl::Status status;
      for (int32_t r : step.reads) {
        auto p = PinChecked(r);
        if (!p.ok()) return p.status();
        pinned.push_back(Id(r));
      }
      const auto start = Clock::now();
      for (int32_t c : step.creates) {
        // An in-place result takes over the memory of the storage it
        // replaces when that one's last name drops after this step, as in
        // the simulator (Engine::TakeOverInPlace), whose peak the budget is
        // measured against: allocated beside it, both were held at once (a
        // gradient accumulated in place, VGG-16's fc6 at 49 MiB, failed a
        // job given its whole peak).
        for (const deltad::sim::InPlace& ip : step.in_place) {
          if (ip.created != c || !live[ip.old] ||
              std::find(step.frees.begin(), step.frees.end(), ip.old) ==
                  step.frees.end()) {
            continue;
          }
          pinned.erase(std::remove(pinned.begin(), pinned.end(), Id(ip.old)),
                       pinned.end());
          if (absl::Status s = free(ip.old); !s.ok()) return s;
        }
        // What the forward pass makes, the backward reads (the simulator's
        // copy-ahead candidates).
        status =
            Track(c, step.time_ns, step.phase == deltad::sim::Phase::kForward);
        if (!status.ok()) return status;
        live[c] = true;
        pinned.push_back(Id(c));
      }
      if (step.workspace_bytes > 0) {
        TensorInfo ws;
        ws.id = ++workspace_id;
        ws.bytes = Bytes(step.workspace_bytes);
        ws.evict_pinned = ws.offload_pinned = ws.uncomputable = true;
        auto p = client_.Track(ws, nullptr);
        if (!p.ok()) return p.status();
        pinned.push_back(ws.id);
        std::this_thread::sleep_for(std::chrono::nanoseconds(step.time_ns));
        client_.Unpin(ws.id);
        pinned.pop_back();
        if (absl::Status s = client_.Free(ws.id); !s.ok()) return s;
      } else {
        std::this_thread::sleep_for(std::chrono::nanoseconds(step.time_ns));
      }
      work_ns += (Clock::now() - start).count();
      for (uint64_t id : pinned) client_.Unpin(id);
      for (int32_t f : step.frees) {
        if (absl::Status s = free(f); !s.ok()) return s;
      }
    }
    for (size_t i = 0; i < live.size(); ++i) {
      if (absl::Status s = free(static_cast<int32_t>(i)); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  int64_t verified() const { return verified_; }

 private:
  Client& client_;
  const Program& program_;
  const double scale_;
  const int iteration_;
  std::vector<uint64_t>& checksums_;
  int64_t& mismatches_;
  int64_t verified_ = 0;
  std::vector<bool> live_;  // tracked and not freed, this iteration
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "deltad-trainer: replays a model's training iterations through the "
      "deltad client library, with real bytes.");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  const std::string label =
      absl::GetFlag(FLAGS_label).empty() ? model : absl::GetFlag(FLAGS_label);
  const double scale = absl::GetFlag(FLAGS_scale);
  if (!(scale > 0) || scale > 1) return Fail("--scale must be in (0, 1]");

  auto profile = deltad::sim::FindDeviceProfile(absl::GetFlag(FLAGS_device));
  if (!profile.ok()) return Fail(std::string(profile.status().message()));
  deltad::sim::ModelOptions mo;
  mo.batch = absl::GetFlag(FLAGS_batch);
  mo.gpt_layers = absl::GetFlag(FLAGS_gpt_layers);
  mo.gpt_seq = absl::GetFlag(FLAGS_gpt_seq);
  auto trace = deltad::sim::BuildModelTrace(model, mo, *profile);
  if (!trace.ok()) return Fail(std::string(trace.status().message()));
  auto program = deltad::sim::Compile(*trace);
  if (!program.ok()) return Fail(std::string(program.status().message()));

  const auto peak = static_cast<int64_t>(program->peak_bytes * scale);
  const auto floor_bytes =
      static_cast<int64_t>(program->min_budget_bytes * scale);
  const auto budget = std::max(
      floor_bytes, static_cast<int64_t>(peak * absl::GetFlag(FLAGS_budget)));

  ClientOptions options;
  options.use_daemon = absl::GetFlag(FLAGS_daemon);
  options.link.socket_path = absl::GetFlag(FLAGS_socket);
  options.link.gpu = absl::GetFlag(FLAGS_gpu);
  options.link.requested_budget_bytes = budget;
  options.link.requested_host_bytes = peak;
  options.link.priority = static_cast<uint32_t>(absl::GetFlag(FLAGS_priority));
  options.link.label = label;
  options.link.min_budget_bytes =
      static_cast<int64_t>(budget * absl::GetFlag(FLAGS_min_budget));
  options.admission_wait_ms = absl::GetFlag(FLAGS_admission_wait_ms);
  options.require_session = absl::GetFlag(FLAGS_require_session);
  options.copy_ahead = absl::GetFlag(FLAGS_copy_ahead);
  options.fallback_budget_bytes = budget;
  options.fallback_host_bytes = peak;
  // The device is the real one scaled: full memory, link slowed by `scale`
  // so that scaled bytes take the time unscaled bytes would.
  const auto memory = static_cast<int64_t>(profile->memory_bytes * scale);
  const double d2h = profile->d2h_bytes_per_s * scale;
  const double h2d = profile->h2d_bytes_per_s * scale;
  (void)deltad::common::RaiseDescriptorLimit();  // one memfd per chunk held
  std::unique_ptr<deltad::client::Device> device;
  const std::string kind = absl::GetFlag(FLAGS_memory);
  if (kind == "chunks") {
    // CUDA's 2 MiB granularity, scaled like the tensors so that rounding
    // wastes what it would at full size; the daemon's sim chunk size
    // should match (scripts/run sets it so).
    // An arena holds chunks of one size: made in-process at another size
    // than the daemon's, they keep the job from ever attaching.
    const int64_t page = sysconf(_SC_PAGESIZE);
    const int64_t local_chunk =
        absl::GetFlag(FLAGS_chunk_kib) > 0
            ? int64_t{absl::GetFlag(FLAGS_chunk_kib)} << 10
            : std::max<int64_t>(
                  page, static_cast<int64_t>((2 << 20) * scale) / page * page);
    auto chunked =
        deltad::client::SimChunkDevice::Create(memory, d2h, h2d, local_chunk);
    if (!chunked.ok()) return Fail(chunked.status().ToString());
    device = std::move(*chunked);
  } else if (kind == "heap") {
    device = std::make_unique<deltad::client::SimDevice>(memory, d2h, h2d);
  } else {
    return Fail("--memory must be chunks or heap, got " + kind);
  }
  auto client = Client::Connect(options, std::move(device));
  if (!client.ok()) return Fail(client.status().ToString());
  Client& c = **client;
  const deltad::client::ClientStats first = c.Stats();
  std::printf(
      "[%s] %s, %s peak unmanaged (scale 1/%.0f: %s real), largest step "
      "%s, budget %s (%s), GPU %d, %s\n",
      label.c_str(), trace->name.c_str(), Human(peak).c_str(), 1 / scale,
      Human(program->peak_bytes).c_str(), Human(floor_bytes).c_str(),
      Human(first.budget_bytes).c_str(),
      first.connected ? "granted by deltad" : "in-process policy",
      absl::GetFlag(FLAGS_gpu),
      first.connected ? absl::StrFormat("session %d", first.session_id).c_str()
                      : "no daemon");
  std::fflush(stdout);

  std::vector<uint64_t> checksums(program->storages.size());
  int64_t mismatches = 0;
  int64_t verified = 0;
  int64_t work_ns = 0;
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const int after_reconnect = absl::GetFlag(FLAGS_iterations_after_reconnect);
  int reconnected_iterations = 0;
  const auto start = Clock::now();
  for (int it = 0; it < iterations; ++it) {
    const auto iter_start = Clock::now();
    Replay replay(c, *program, scale, it, checksums, mismatches);
    if (absl::Status s = replay.Run(work_ns); !s.ok()) {
      return Fail(absl::StrFormat("[%s] iteration %d: %s", label, it + 1,
                                  s.ToString()));
    }
    verified += replay.verified();
    c.IterationDone();  // its peak: the job's floor at the daemon
    const deltad::client::ClientStats st = c.Stats();
    std::printf(
        "[%s] iteration %d/%d  %.2f s  peak %s / budget %s  offloaded %s  "
        "reloaded %s  recomputed %" PRId64 "  %s\n",
        label.c_str(), it + 1, iterations,
        std::chrono::duration<double>(Clock::now() - iter_start).count(),
        Human(st.peak_device_bytes).c_str(), Human(st.budget_bytes).c_str(),
        Human(st.offloaded_bytes).c_str(), Human(st.reloaded_bytes).c_str(),
        st.recomputes, st.connected ? "deltad" : "in-process");
    std::fflush(stdout);
    if (after_reconnect > 0 && st.reconnects > 0 && st.connected &&
        ++reconnected_iterations >= after_reconnect) {
      std::printf(
          "[%s] stopping after %d iterations with the session "
          "opened again (--iterations_after_reconnect)\n",
          label.c_str(), reconnected_iterations);
      break;
    }
  }
  const double wall =
      std::chrono::duration<double>(Clock::now() - start).count();
  c.Flush();
  const deltad::client::ClientStats st = c.Stats();
  c.Close();
  // Releases the daemon ordered, and those the client chose itself (no
  // daemon, or chunks full of rounding the daemon cannot see).
  const int64_t ordered = st.orders_received;
  std::string decided;
  if (st.reconnects > 0) decided = "(reconnected) ";
  if (st.past_budget_bytes > 0) {
    decided += absl::StrCat("(", Human(st.past_budget_bytes),
                            " of chunks past the budget for rounding) ");
  }
  if (st.past_budget_allocations > 0) {
    // Everything held was in use by running ops (a budget cut mid-op).
    decided += absl::StrCat("(", st.past_budget_allocations,
                            " allocations past the budget in chunks held) ");
  }
  // What the training thread waited for: releases it asked for, and
  // tensors it needed that were not resident.
  decided += absl::StrFormat(
      "(waited %.3f s for %" PRId64 " releases, %.3f s for tensors) ",
      st.sync_release_ns / 1e9, st.sync_releases, st.stall_ns / 1e9);
  if (st.copies_ahead > 0) {
    decided += absl::StrCat("(", st.offloads_from_copies, " of ", st.offloads,
                            " offloads from ", st.copies_ahead,
                            " copies made ahead) ");
  }
  if (st.local_decisions > 0) {
    decided += absl::StrCat("(", st.local_decisions, " of ",
                            st.local_decisions + ordered,
                            " releases and prefetches chosen in-process)");
  }
  std::printf(
      "SUMMARY %-14s unmanaged peak %10s  managed peak %10s  offloaded %10s "
      " reloaded %10s  recomputes %6" PRId64
      " (%.2f s)  slowdown %.2fx  "
      "checksums %" PRId64 " verified, %" PRId64 " bad  %s\n",
      label.c_str(), Human(peak).c_str(), Human(st.peak_device_bytes).c_str(),
      Human(st.offloaded_bytes).c_str(), Human(st.reloaded_bytes).c_str(),
      st.recomputes, st.recompute_ns / 1e9, wall / (work_ns / 1e9), verified,
      mismatches, decided.c_str());
  if (mismatches > 0) return Fail("checksum mismatches: bytes were lost");
  return 0;
}
