#ifndef DELTAD_BENCH_SOAK_LOAD_H_
#define DELTAD_BENCH_SOAK_LOAD_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/soak_figures.h"
#include "bench/soak_trainers.h"

namespace deltad::bench {

// soak's load: the daemon started, the trainers kept running on it with
// the pressure storms, drained, and the daemon checked and stopped.

// The run's flags (see bench/soak.cc), with the sizes derived from them.
struct SoakSettings {
  std::string command;  // as run, for the report
  std::string deltad;   // binaries
  std::string trainer;
  int gpus = 0;
  int processes = 0;
  int duration = 0;  // seconds of load
  double scale = 0;
  int64_t gpu_memory = 0;  // bytes
  int64_t chunk = 0;       // bytes
  int64_t host_pool = 0;   // bytes
  int iterations = 0;
  int trainer_nice = 0;
  int storm_every = 0;
  int storm_length = 0;
  int storm_per_gpu = 0;
  int storm_priority = 0;
  int storm_iterations = 0;
  double warmup = 0;  // seconds
  int drain_timeout = 0;
  double flat_mib_per_min = 0;
  double flat_growth = 0;
  bool check_memory = true;
  std::string update_doc;
};

// What a run measured.
struct SoakResult {
  Outcome outcome;
  std::vector<Sample> samples;  // one a second of the load
  int storms = 0;
  double load_seconds = 0;
  double drain_seconds = 0;
  // CPU seconds of the load and drain: the whole machine's busy time, and
  // of it the trainers', the daemon's, soak's own and other processes'.
  double machine_busy = 0;
  double trainers_cpu = 0;
  double daemon_cpu = 0;
  double own_cpu = 0;
  double others_cpu = 0;
  // What the daemon still held once every client had left (all 0 when
  // reclaimed); descriptors and RSS (KiB) are -1 when it died.
  int left_sessions = 0;
  int64_t left_host_granted = 0;
  int64_t left_used = 0;
  int64_t left_chunks = 0;
  bool reclaimed = false;
  int64_t fds_after = -1;
  int64_t rss_after = -1;
  std::string daemon_exit;  // on SIGTERM, as DescribeWait says it
  std::string daemon_heap;  // its malloc, as its start line names it
  // Each one fails the run.
  std::vector<std::string> problems;
};

// Starts deltad with its socket, config and log in `dir`, keeps the
// trainers running on it for the duration with a storm every storm_every
// seconds, lets them finish, checks that the daemon reclaimed everything
// and stops it. nullopt (said on stderr) when the daemon did not start.
std::optional<SoakResult> RunLoad(const SoakSettings& settings,
                                  const std::string& dir);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_SOAK_LOAD_H_
