// soak: the daemon under sustained load from real training processes.
//
// Starts deltad on --gpus simulated GPUs and keeps --processes
// deltad-trainer processes running on them (spread evenly) for --duration
// seconds: each replays a model's training iterations with real bytes and
// checksums under a budget below its peak, so the daemon must keep ordering
// releases; a trainer that finishes its iterations is replaced at once.
// Every --storm_every seconds a pressure storm starts --storm_per_gpu extra
// trainers per GPU at a higher priority asking for their whole peak, so
// every GPU's shares shrink and the running sessions must release down to
// them; at the end of the storm those on even GPUs are SIGKILLed (the
// daemon must reclaim them without touching anyone else's tensors), those
// on odd GPUs run a few iterations and exit on their own.
//
// Every second it samples the daemon's RSS and descriptors (/proc), its
// sessions (NodeStatus) and its release-decision histogram and order
// counters (the Prometheus endpoint). At the end every trainer still
// running finishes its iterations, and the daemon must have reclaimed
// everything (no session, no host slab, no device byte or chunk) and stop
// cleanly on SIGTERM. Exits non-zero on a lost tensor (a trainer that was
// not killed on purpose and did not exit 0 with "0 bad" checksums), a daemon
// that died, unreclaimed resources or memory that did not stay flat.
// --update_doc=FILE writes the report as the `soak` section of FILE.

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "bench/report.h"
#include "bench/soak_load.h"
#include "bench/soak_process.h"
#include "bench/soak_report.h"

ABSL_FLAG(std::string, deltad, DELTAD_BINARY, "the deltad binary");
ABSL_FLAG(std::string, trainer, DELTAD_TRAINER_BINARY,
          "the deltad-trainer binary");
ABSL_FLAG(int, duration, 300, "seconds of load");
ABSL_FLAG(int, processes, 64,
          "training processes kept running, spread evenly across the GPUs");
ABSL_FLAG(int, gpus, 8, "simulated GPUs");
ABSL_FLAG(double, scale, 1.0 / 64,
          "trainers' bytes (and link speed) are multiplied by this");
ABSL_FLAG(int, gpu_memory_mib, 128,
          "each simulated GPU's memory, MiB (at --scale; 90% is budget)");
ABSL_FLAG(int, chunk_kib, 0,
          "device chunk size, KiB (0: CUDA's 2 MiB at --scale, or larger "
          "where the descriptor limit cannot hold one per chunk)");
ABSL_FLAG(int, iterations, 4, "training iterations of each trainer");
ABSL_FLAG(int, trainer_nice, 19,
          "nice value of the trainers: with more processes than cores, the "
          "daemon (which serves them all) should not wait behind them (at "
          "10, 64 trainers on 2 cores outweighed its few threads, and 16 of "
          "them timed out opening a session in a 60 s run; at 19, none)");
ABSL_FLAG(int, storm_every, 30, "seconds from one storm's start to the next");
ABSL_FLAG(int, storm_length, 10, "seconds a storm lasts");
ABSL_FLAG(int, storm_per_gpu, 1, "extra trainers per GPU in a storm");
ABSL_FLAG(int, storm_priority, 2,
          "their weight in the GPU's fair share (the others have 1)");
ABSL_FLAG(int, storm_iterations, 2,
          "iterations of the storm trainers that are not killed");
ABSL_FLAG(int, warmup, -1,
          "seconds before the memory figures' baseline (-1: a fifth of "
          "--duration, at most 60)");
ABSL_FLAG(int, drain_timeout, 420,
          "seconds the trainers get to finish after --duration (a DenseNet "
          "trainer started at the end of the load needs about 4 x 100 s on "
          "2 cores)");
ABSL_FLAG(double, flat_mib_per_min, 0.1,
          "memory is flat when the RSS slope over the second half is below "
          "this");
ABSL_FLAG(double, flat_growth, 0.05,
          "... and RSS at the end is at most this fraction above the RSS "
          "in the middle of the run");
ABSL_FLAG(bool, check_memory, true,
          "fail when memory is not flat (a run of a few seconds has no "
          "trend to judge)");
ABSL_FLAG(std::string, work_dir, "",
          "where the daemon's socket and the trainers' output go (default: "
          "a fresh directory in $TMPDIR, removed unless the run fails)");
ABSL_FLAG(std::string, samples_csv, "",
          "also write the per-second samples (time, phase, RSS, anonymous "
          "memory, heap in use, threads, descriptors, sessions, trainers) "
          "to this CSV file");
ABSL_FLAG(std::string, update_doc, "",
          "write the report as the soak section of this Markdown file");

namespace deltad::bench {
namespace {

// The daemon and every trainer hold a descriptor per device chunk: the
// limit deltad's systemd unit sets (LimitNOFILE), where this process may
// raise it; the children inherit it. Returns the hard limit.
rlim_t RaiseDescriptorLimit() {
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_max < 1048576) {
    rlimit raised{1048576, 1048576};
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) files = raised;
  }
  return files.rlim_max;
}

// The flags, with the chunk size, warm-up and host pool derived from them;
// nullopt (said on stderr) when they make no run.
std::optional<SoakSettings> ReadSettings(const std::string& command) {
  SoakSettings s;
  s.command = command;
  s.deltad = absl::GetFlag(FLAGS_deltad);
  s.trainer = absl::GetFlag(FLAGS_trainer);
  s.gpus = absl::GetFlag(FLAGS_gpus);
  s.processes = absl::GetFlag(FLAGS_processes);
  s.duration = absl::GetFlag(FLAGS_duration);
  s.scale = absl::GetFlag(FLAGS_scale);
  s.storm_every = absl::GetFlag(FLAGS_storm_every);
  s.storm_length = absl::GetFlag(FLAGS_storm_length);
  s.storm_per_gpu = absl::GetFlag(FLAGS_storm_per_gpu);
  s.storm_priority = absl::GetFlag(FLAGS_storm_priority);
  s.storm_iterations = absl::GetFlag(FLAGS_storm_iterations);
  s.iterations = absl::GetFlag(FLAGS_iterations);
  s.trainer_nice = absl::GetFlag(FLAGS_trainer_nice);
  s.gpu_memory = int64_t{absl::GetFlag(FLAGS_gpu_memory_mib)} << 20;
  s.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  s.flat_mib_per_min = absl::GetFlag(FLAGS_flat_mib_per_min);
  s.flat_growth = absl::GetFlag(FLAGS_flat_growth);
  s.check_memory = absl::GetFlag(FLAGS_check_memory);
  s.update_doc = absl::GetFlag(FLAGS_update_doc);
  const rlim_t files = RaiseDescriptorLimit();
  s.chunk = int64_t{absl::GetFlag(FLAGS_chunk_kib)} << 10;
  if (s.chunk == 0) {
    // As the trainer sizes its local chunks, so that rounding wastes what
    // it would at full size; doubled while every GPU's budget (90%) handed
    // out in chunks would take more than 80% of the daemon's descriptors
    // (the rest: host slabs, sockets).
    const int64_t page = 4096;
    s.chunk = std::max<int64_t>(
        page, static_cast<int64_t>((2 << 20) * s.scale) / page * page);
    const auto fit =
        static_cast<int64_t>(0.9 * static_cast<double>(s.gpus * s.gpu_memory) /
                             std::max(1.0, 0.8 * static_cast<double>(files)));
    while (s.chunk < fit) s.chunk *= 2;
  }
  s.warmup = absl::GetFlag(FLAGS_warmup) >= 0
                 ? absl::GetFlag(FLAGS_warmup)
                 : std::min(60.0, s.duration / 5.0);
  if (s.gpus < 1 || s.processes < 1 || s.duration < 1 || !(s.scale > 0) ||
      s.scale > 1 || s.iterations < 1 || s.storm_every < 1 ||
      s.storm_length < 0 || s.storm_length >= s.storm_every ||
      s.storm_per_gpu < 0 || s.chunk <= 0 || s.chunk % 4096 != 0) {
    std::fprintf(stderr,
                 "soak: bad flags (need gpus, processes, duration, iterations "
                 ">= 1, scale in (0, 1], storm_length < storm_every, chunk a "
                 "multiple of 4 KiB)\n");
    return std::nullopt;
  }
  // A host pool that covers every process's whole peak at once (each asks
  // for its peak in host memory), storms included. A session gets its
  // quota in whole slabs, rounded down: slabs must be small beside the
  // peaks, yet each is a descriptor in the daemon. The pool's memfds cost
  // only what is touched.
  s.host_pool = std::max<int64_t>(
      int64_t{1} << 30,
      static_cast<int64_t>((s.processes + s.gpus * s.storm_per_gpu) *
                           (3.0 * (int64_t{1} << 30) * s.scale)));
  return s;
}

int Run(const std::string& command) {
  const std::optional<SoakSettings> settings = ReadSettings(command);
  if (!settings) return 2;

  std::string dir = absl::GetFlag(FLAGS_work_dir);
  bool own_dir = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/soak.XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("soak: mkdtemp");
      return 1;
    }
    dir = pattern;
    own_dir = true;
  } else {
    std::filesystem::create_directories(dir);
  }

  std::optional<SoakResult> result = RunLoad(*settings, dir);
  if (!result) return 1;
  if (const std::string csv = absl::GetFlag(FLAGS_samples_csv); !csv.empty()) {
    if (!WriteSamplesCsv(result->samples, csv)) {
      std::fprintf(stderr, "soak: could not write %s\n", csv.c_str());
      return 1;
    }
    Note("wrote " + csv);
  }
  const std::string md = SoakReport(*settings, *result);
  const bool ok = result->problems.empty();

  const std::string& doc = settings->update_doc;
  if (!PrintReport(md, doc, "soak")) {
    std::fprintf(stderr, "soak: could not write %s\n", doc.c_str());
    return 1;
  }
  if (!doc.empty()) Note("updated " + doc);
  for (const std::string& f : result->outcome.failures) {
    std::fprintf(stderr, "soak: failed trainer %s\n", f.c_str());
  }
  if (ok && own_dir) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  } else if (!ok) {
    Note("kept " + dir + " (the daemon's log and the failed trainers' output)");
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace deltad::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "soak: deltad under 64 training processes on 8 simulated GPUs with "
      "pressure storms; see the comment at the top of bench/soak.cc.");
  const std::string command = deltad::bench::CommandLine("soak", argc, argv);
  absl::ParseCommandLine(argc, argv);
  return deltad::bench::Run(command);
}
