#include "bench/soak_load.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/report.h"
#include "bench/soak_figures.h"
#include "bench/soak_process.h"
#include "bench/soak_trainers.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace deltad::bench {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }

// One run's daemon and trainers, through the phases of RunLoad.
class Soak {
 public:
  Soak(const SoakSettings& settings, const std::string& dir)
      : settings_(settings),
        dir_(dir),
        socket_path_(dir + "/deltad.sock"),
        config_path_(dir + "/deltad.conf"),
        daemon_log_(dir + "/deltad.log"),
        slot_busy_(settings.processes, false),
        slot_runs_(settings.processes, 0) {}

  // False (said on stderr) when the daemon does not start serving.
  bool StartDaemon();
  void Load();
  void Drain();
  void CheckReclaimed();
  void StopDaemon();
  void CountCpu();
  SoakResult& result() { return result_; }

 private:
  bool NodeStatus(v1::NodeStatusResponse* out);
  bool StartJob(Job job, const std::vector<std::string>& extra);
  void StartRegular(int slot);
  void StartStorm();
  void Reap();
  bool StormAt(double t) const;
  void TakeSample(double t);
  void PrintProgress(double t, size_t& progress_from);

  const SoakSettings& settings_;
  const std::string dir_;
  const std::string socket_path_;
  const std::string config_path_;
  const std::string daemon_log_;
  pid_t daemon_ = -1;
  bool daemon_died_ = false;
  int metrics_port_ = 0;
  std::unique_ptr<v1::MemoryManager::Stub> stub_;
  std::map<pid_t, Job> jobs_;
  std::vector<bool> slot_busy_;
  std::vector<int> slot_runs_;
  int storm_serial_ = 0;
  Clock::time_point load_start_;
  double machine_busy_start_ = 0;
  double own_start_ = 0;
  double daemon_cpu_start_ = 0;
  double children_start_ = 0;
  double daemon_cpu_end_ = 0;
  SoakResult result_;
};

bool Soak::NodeStatus(v1::NodeStatusResponse* out) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  return stub_->NodeStatus(&context, {}, out).ok();
}

bool Soak::StartDaemon() {
  const SoakSettings& s = settings_;
  {
    std::ofstream conf(config_path_);
    conf << "sim { gpus: " << s.gpus << " memory_bytes: " << s.gpu_memory
         << " chunk_bytes: " << s.chunk << " }\n"
         << "min_session_bytes: " << std::max<int64_t>(s.chunk, 1 << 20) << "\n"
         << "host_pool_bytes: " << s.host_pool << "\n"
         << "host_slab_bytes: " << (int64_t{2} << 20) << "\n"
         << "default_host_quota_bytes: " << s.host_pool / 8 << "\n";
  }
  const std::vector<std::string> daemon_args = {
      s.deltad,        "--config=" + config_path_, "--socket=" + socket_path_,
      "--backend=sim", "--metrics=127.0.0.1:0",    "--drain_seconds=5"};
  Note(absl::StrCat("starting deltad: ", s.gpus, " simulated GPUs of ",
                    s.gpu_memory >> 20, " MiB, chunks of ", s.chunk >> 10,
                    " KiB; work dir ", dir_));
  daemon_ = Spawn(daemon_args, daemon_log_);
  if (daemon_ < 0) {
    std::perror("soak: fork");
    return false;
  }

  // Ready when the log names the metrics port and NodeStatus answers.
  auto channel = grpc::CreateChannel("unix:" + socket_path_,
                                     grpc::InsecureChannelCredentials());
  stub_ = v1::MemoryManager::NewStub(channel);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  v1::NodeStatusResponse status;
  while (true) {
    int wait_status = 0;
    if (waitpid(daemon_, &wait_status, WNOHANG) == daemon_) {
      std::fprintf(stderr, "soak: deltad exited at start-up (%s):\n%s",
                   DescribeWait(wait_status).c_str(),
                   ReadFile(daemon_log_).c_str());
      return false;
    }
    const std::string log = ReadFile(daemon_log_);
    const size_t at = log.find("(port ");
    if (at != std::string::npos) {
      metrics_port_ = std::atoi(log.c_str() + at + 6);
      if (const size_t heap = log.find("heap: ", at);
          heap != std::string::npos) {
        const size_t from = heap + 6;
        result_.daemon_heap = log.substr(from, log.find('\n', from) - from);
      }
    }
    if (metrics_port_ > 0 && NodeStatus(&status)) break;
    if (Clock::now() > deadline) {
      std::fprintf(stderr, "soak: deltad not ready in 60 s:\n%s", log.c_str());
      kill(daemon_, SIGKILL);
      waitpid(daemon_, nullptr, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Note(absl::StrCat("deltad ready (pid ", daemon_, ", metrics port ",
                    metrics_port_, ")"));
  return true;
}

bool Soak::StartJob(Job job, const std::vector<std::string>& extra) {
  job.output = absl::StrCat(dir_, "/", job.label, ".out");
  std::vector<std::string> args = {
      settings_.trainer,
      "--socket=" + socket_path_,
      absl::StrCat("--gpu=", job.gpu),
      "--label=" + job.label,
      absl::StrFormat("--scale=%.9g", settings_.scale),
      // The daemon's chunks, also for a trainer that starts before it
      // answers and makes its own (they must match to attach later).
      absl::StrCat("--chunk_kib=", settings_.chunk >> 10),
  };
  args.insert(args.end(), extra.begin(), extra.end());
  job.pid = Spawn(args, job.output, settings_.trainer_nice);
  if (job.pid < 0) {
    result_.problems.push_back(
        absl::StrCat("fork failed: ", std::strerror(errno)));
    return false;
  }
  ++result_.outcome.started[static_cast<int>(job.kind)];
  jobs_.emplace(job.pid, std::move(job));
  return true;
}

void Soak::StartRegular(int slot) {
  Job job;
  job.kind = Kind::kRegular;
  job.slot = slot;
  job.gpu = slot % settings_.gpus;
  const Model& model = Models()[(slot / settings_.gpus) % Models().size()];
  job.label = absl::StrCat("p", slot, "-", slot_runs_[slot]++);
  std::vector<std::string> extra = model.flags;
  extra.push_back(absl::StrCat("--iterations=", settings_.iterations));
  // A newcomer the floors leave no room for waits, as a job should,
  // for a storm's length and the one after: a storm's trainers leave.
  extra.push_back(
      absl::StrCat("--admission_wait_ms=", settings_.storm_every * 1000));
  if (StartJob(std::move(job), extra)) slot_busy_[slot] = true;
}

void Soak::StartStorm() {
  ++storm_serial_;
  for (int gpu = 0; gpu < settings_.gpus; ++gpu) {
    for (int i = 0; i < settings_.storm_per_gpu; ++i) {
      Job job;
      job.gpu = gpu;
      job.kind = gpu % 2 == 0 ? Kind::kStormKilled : Kind::kStormExits;
      job.label = absl::StrCat("storm", storm_serial_, "-g", gpu, "-", i);
      // The whole peak, weighted: the GPU's other shares must shrink,
      // down to their floors. A storm that would cut one below waits for
      // the storm's length, then gives up (fails closed) as a newcomer
      // should rather than train unmanaged beside the daemon's budgets.
      std::vector<std::string> extra = {
          "--model=resnet50",
          "--batch=32",
          "--budget=1.0",
          "--min_budget=0.3",
          "--require_session",
          absl::StrCat("--admission_wait_ms=", settings_.storm_length * 1000),
          absl::StrCat("--priority=", settings_.storm_priority),
          absl::StrCat("--iterations=", job.kind == Kind::kStormKilled
                                            ? 1000000
                                            : settings_.storm_iterations)};
      StartJob(std::move(job), extra);
    }
  }
}

void Soak::Reap() {
  while (true) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    if (pid == daemon_) {
      daemon_died_ = true;
      result_.problems.push_back(absl::StrCat(
          "deltad died during the run: ", DescribeWait(status), "; log ",
          daemon_log_, ":\n", Tail(ReadFile(daemon_log_), 10)));
      Note(result_.problems.back());
      continue;
    }
    auto it = jobs_.find(pid);
    if (it == jobs_.end()) continue;
    Account(it->second, status, result_.outcome);
    if (it->second.kind == Kind::kRegular) {
      slot_busy_[it->second.slot] = false;
    }
    jobs_.erase(it);
  }
}

// Storms start at every multiple of --storm_every after the first, when
// they can end before the load does.
bool Soak::StormAt(double t) const {
  const int storm_every = settings_.storm_every;
  if (t < storm_every) return false;
  const double start = std::floor(t / storm_every) * storm_every;
  return t - start < settings_.storm_length &&
         start + settings_.storm_length <= settings_.duration;
}

void Soak::TakeSample(double t) {
  Sample s;
  s.t = t;
  s.storm = StormAt(t);
  s.rss_kib = RssKib(daemon_);
  s.anon_kib = StatusField(daemon_, "RssAnon");
  s.threads = StatusField(daemon_, "Threads");
  s.fds = CountFds(daemon_);
  s.trainers = static_cast<int>(jobs_.size());
  s.daemon_cpu = CpuSeconds(daemon_);
  v1::NodeStatusResponse status;
  if (NodeStatus(&status)) s.sessions = status.sessions_size();
  s.scrape = ParseMetrics(ScrapeMetrics(metrics_port_));
  if (s.scrape.heap_in_use >= 0) {
    s.heap_kib = static_cast<int64_t>(s.scrape.heap_in_use / 1024);
  }
  result_.samples.push_back(std::move(s));
}

void Soak::PrintProgress(double t, size_t& progress_from) {
  const std::vector<Sample>& samples = result_.samples;
  const Outcome& outcome = result_.outcome;
  const Sample& a = samples[progress_from];
  const Sample& b = samples.back();
  std::fprintf(stderr,
               "soak [%6.1f s]: load %4.0f s  trainers %3d  sessions %3d  "
               "decisions/s %7.0f  RSS %6.1f MiB  threads %3" PRId64
               "  fds %5d  ok %" PRId64 " killed %" PRId64 " failed %" PRId64
               "\n",
               SinceStart(), t, b.trainers, b.sessions,
               (b.scrape.count - a.scrape.count) / std::max(1e-9, b.t - a.t),
               b.rss_kib / 1024.0, b.threads, b.fds, outcome.ok, outcome.killed,
               outcome.failed);
  progress_from = samples.size() - 1;
}

void Soak::Load() {
  const SoakSettings& s = settings_;
  machine_busy_start_ = MachineBusySeconds();
  own_start_ = CpuSeconds(getpid());
  daemon_cpu_start_ = CpuSeconds(daemon_);
  children_start_ = ChildrenCpuSeconds();

  Note(absl::StrCat("load: ", s.processes, " trainers on ", s.gpus,
                    " GPUs for ", s.duration, " s; a storm of ",
                    s.storm_per_gpu * s.gpus, " every ", s.storm_every,
                    " s for ", s.storm_length, " s"));
  load_start_ = Clock::now();
  double next_sample = 0, next_progress = 10;
  bool in_storm = false;
  size_t progress_from = 0;
  while (!daemon_died_ && !g_interrupted) {
    Reap();
    const double t = Seconds(Clock::now() - load_start_);
    if (t >= s.duration) break;
    // Staggered: a whole node's processes starting in the same instant
    // would measure fork and model set-up, not the daemon.
    int spawned = 0;
    for (int slot = 0; slot < s.processes && spawned < 2; ++slot) {
      if (!slot_busy_[slot]) {
        StartRegular(slot);
        ++spawned;
      }
    }
    const bool storm_now = StormAt(t);
    if (storm_now && !in_storm) {
      ++result_.storms;
      Note(absl::StrCat("storm ", result_.storms, ": ",
                        s.storm_per_gpu * s.gpus, " trainers at priority ",
                        s.storm_priority));
      StartStorm();
    } else if (!storm_now && in_storm) {
      int killed = 0;
      for (auto& [pid, job] : jobs_) {
        if (job.kind == Kind::kStormKilled && !job.killed) {
          kill(pid, SIGKILL);
          job.killed = true;
          ++killed;
        }
      }
      Note(absl::StrCat("storm ", result_.storms, " ends: ", killed,
                        " storm trainers SIGKILLed"));
    }
    in_storm = storm_now;
    if (t >= next_sample) {
      TakeSample(t);
      next_sample += 1;
    }
    if (t >= next_progress && result_.samples.size() > progress_from + 1) {
      PrintProgress(t, progress_from);
      next_progress += 10;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  result_.load_seconds = Seconds(Clock::now() - load_start_);
  if (g_interrupted) result_.problems.push_back("interrupted");
}

// Storm trainers left are killed as a storm's end would; the rest finish
// their iterations, which is what proves their bytes.
void Soak::Drain() {
  for (auto& [pid, job] : jobs_) {
    if (job.kind == Kind::kStormKilled && !job.killed) {
      kill(pid, SIGKILL);
      job.killed = true;
    }
  }
  Note(absl::StrCat("load over; waiting for ", jobs_.size(),
                    " trainers to finish"));
  const auto deadline =
      Clock::now() + std::chrono::seconds(settings_.drain_timeout);
  while (!jobs_.empty() && !daemon_died_ && !g_interrupted &&
         Clock::now() < deadline) {
    Reap();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!jobs_.empty()) {
    result_.problems.push_back(absl::StrCat(
        jobs_.size(), " trainers still running after the drain timeout"));
    for (auto& [pid, job] : jobs_) {
      Note(absl::StrCat("still running: ", job.label, "; output ", job.output,
                        ":\n", Tail(ReadFile(job.output), 4)));
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    jobs_.clear();
  }
  result_.drain_seconds =
      Seconds(Clock::now() - load_start_) - result_.load_seconds;
}

// Nothing may be left for anyone once every client is gone.
void Soak::CheckReclaimed() {
  v1::NodeStatusResponse final_status;
  bool serving = false, reclaimed = false;
  if (!daemon_died_) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      final_status.Clear();
      serving = NodeStatus(&final_status);
      reclaimed = serving && final_status.sessions_size() == 0 &&
                  final_status.host_pool_granted_bytes() == 0;
      for (const v1::GpuStatus& g : final_status.gpus()) {
        reclaimed = reclaimed && g.used_bytes() == 0 && g.chunk_bytes() == 0 &&
                    g.sessions() == 0;
      }
      if (reclaimed) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  int64_t left_used = 0, left_chunks = 0;
  for (const v1::GpuStatus& g : final_status.gpus()) {
    left_used += g.used_bytes();
    left_chunks += g.chunk_bytes();
  }
  result_.left_sessions = final_status.sessions_size();
  result_.left_host_granted = final_status.host_pool_granted_bytes();
  result_.left_used = left_used;
  result_.left_chunks = left_chunks;
  result_.reclaimed = reclaimed;
  result_.fds_after = daemon_died_ ? -1 : CountFds(daemon_);
  result_.rss_after = daemon_died_ ? -1 : RssKib(daemon_);
  if (!serving)
    result_.problems.push_back("deltad is not serving after the run");
  if (serving && !reclaimed) {
    result_.problems.push_back(absl::StrCat(
        "not reclaimed after every client left: ", final_status.sessions_size(),
        " sessions, ", final_status.host_pool_granted_bytes(),
        " host pool bytes granted, ", left_used, " device bytes used, ",
        left_chunks, " in chunks"));
  }
  daemon_cpu_end_ = daemon_died_ ? 0 : CpuSeconds(daemon_);
}

// SIGTERM, which a daemon with no sessions answers at once.
void Soak::StopDaemon() {
  std::string daemon_exit = "died during the run";
  if (!daemon_died_) {
    kill(daemon_, SIGTERM);
    int status = 0;
    pid_t got = 0;
    for (int i = 0; i < 300 && got == 0; ++i) {
      got = waitpid(daemon_, &status, WNOHANG);
      if (got == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (got == daemon_) {
      daemon_exit = DescribeWait(status);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        result_.problems.push_back("deltad did not exit cleanly on SIGTERM: " +
                                   daemon_exit);
      }
    } else {
      daemon_exit = "did not exit in 30 s of SIGTERM";
      result_.problems.push_back("deltad " + daemon_exit);
      kill(daemon_, SIGKILL);
      waitpid(daemon_, nullptr, 0);
    }
  }
  result_.daemon_exit = daemon_exit;
}

void Soak::CountCpu() {
  // Every child is reaped by now: the trainers are the children's CPU
  // less the daemon's (which it spent before the load too, but start-up
  // is a fraction of a second).
  SoakResult& r = result_;
  r.machine_busy = MachineBusySeconds() - machine_busy_start_;
  r.own_cpu = CpuSeconds(getpid()) - own_start_;
  r.trainers_cpu =
      std::max(0.0, ChildrenCpuSeconds() - children_start_ - daemon_cpu_end_);
  r.daemon_cpu = daemon_cpu_end_ - daemon_cpu_start_;
  r.others_cpu =
      std::max(0.0, r.machine_busy - r.own_cpu - r.trainers_cpu - r.daemon_cpu);
}

}  // namespace

std::optional<SoakResult> RunLoad(const SoakSettings& settings,
                                  const std::string& dir) {
  Soak soak(settings, dir);
  if (!soak.StartDaemon()) return std::nullopt;
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  soak.Load();
  soak.Drain();
  soak.CheckReclaimed();
  soak.StopDaemon();
  soak.CountCpu();
  return std::move(soak.result());
}

}  // namespace deltad::bench
