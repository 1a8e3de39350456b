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

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "bench/report.h"
#include "deltad/v1/memory_manager.grpc.pb.h"
#include "grpcpp/grpcpp.h"

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
ABSL_FLAG(int, trainer_nice, 10,
          "nice value of the trainers: with more processes than cores, the "
          "daemon (which serves them all) should not wait behind them");
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
ABSL_FLAG(int, drain_timeout, 180,
          "seconds the trainers get to finish after --duration");
ABSL_FLAG(double, flat_mib_per_min, 1.0,
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
ABSL_FLAG(std::string, update_doc, "",
          "write the report as the soak section of this Markdown file");

namespace deltad::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMiB = 1024.0 * 1024.0;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

const Clock::time_point kStart = Clock::now();

void Note(const std::string& what) {
  std::fprintf(stderr, "soak [%6.1f s]: %s\n", Seconds(Clock::now() - kStart),
               what.c_str());
}

volatile std::sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The last `n` lines of `text`, for quoting a failed process's output.
std::string Tail(const std::string& text, int n) {
  // Skips the final newline, then counts n line breaks back.
  size_t pos = text.size() > 0 ? text.size() - 1 : 0;
  while (pos > 0) {
    const size_t nl = text.rfind('\n', pos - 1);
    if (nl == std::string::npos) return text;
    pos = nl;
    if (--n == 0) return text.substr(pos + 1);
  }
  return text;
}

// fork + exec with stdout and stderr to `output`, stdin from /dev/null,
// SIGKILL when this process dies (PR_SET_PDEATHSIG), so that a crashed or
// killed soak leaves no daemon or trainer behind. Spawned from the main
// thread only: the death signal follows the thread that forked. gRPC has
// threads, so only async-signal-safe calls happen in the child.
// `nice` > 0 lowers the child's CPU priority.
pid_t Spawn(const std::vector<std::string>& args, const std::string& output,
            int nice = 0) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.data()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;  // -1 on failure
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // the parent died before prctl
  if (nice > 0) setpriority(PRIO_PROCESS, 0, nice);
  const int in = open("/dev/null", O_RDONLY);
  const int out = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (in < 0 || out < 0) _exit(127);
  dup2(in, 0);
  dup2(out, 1);
  dup2(out, 2);
  execv(argv[0], argv.data());
  _exit(127);
}

std::string DescribeWait(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("wait status ", status);
}

// --- The daemon's figures.

// A number field of /proc/<pid>/status ("VmRSS", "RssAnon", "Threads").
int64_t StatusField(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      int64_t value = 0;
      (void)absl::SimpleAtoi(
          absl::StripAsciiWhitespace(absl::StripSuffix(
              absl::string_view(line).substr(field.size() + 1), "kB")),
          &value);
      return value;
    }
  }
  return -1;
}

int64_t RssKib(pid_t pid) { return StatusField(pid, "VmRSS"); }

int CountFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

// User plus system CPU seconds of a process (/proc/<pid>/stat).
double CpuSeconds(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  // The command name may hold spaces; fields count from after its ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> f =
      absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
  // utime and stime are fields 14 and 15 of the whole line, 12 and 13 here.
  if (f.size() < 13) return 0;
  int64_t utime = 0, stime = 0;
  (void)absl::SimpleAtoi(f[11], &utime);
  (void)absl::SimpleAtoi(f[12], &stime);
  return static_cast<double>(utime + stime) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

// User plus system CPU seconds of the children reaped so far.
double ChildrenCpuSeconds() {
  rusage r{};
  getrusage(RUSAGE_CHILDREN, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// The body of GET /metrics on 127.0.0.1:port; empty on any failure.
std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval timeout{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    // HTTP/1.0: the server closes the connection after the body, so reading
    // to EOF needs no parsing of lengths or chunks.
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[65536];
      ssize_t n;
      while ((n = recv(fd, buffer, sizeof buffer, 0)) > 0) {
        response.append(buffer, static_cast<size_t>(n));
      }
      if (n < 0) response.clear();
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos ||
      response.find(" 200 ") > body) {
    return "";
  }
  return response.substr(body + 4);
}

// What one scrape says, summed over the GPUs.
struct Scrape {
  bool ok = false;
  std::map<double, double> buckets;  // le -> cumulative count
  double count = 0;
  double sum = 0;
  double offloads = 0;
  double evictions = 0;
  double budgets = 0;
  double prefetches = 0;
};

std::string LabelValue(absl::string_view labels, absl::string_view name) {
  const std::string key = absl::StrCat(name, "=\"");
  const size_t at = labels.find(key);
  if (at == absl::string_view::npos) return "";
  const size_t start = at + key.size();
  const size_t end = labels.find('"', start);
  return std::string(labels.substr(start, end - start));
}

Scrape ParseMetrics(const std::string& text) {
  Scrape s;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value)) continue;
    const absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    const absl::string_view name = series.substr(0, brace);
    const absl::string_view labels =
        brace == absl::string_view::npos ? "" : series.substr(brace);
    if (name == "deltad_release_decision_seconds_bucket") {
      const std::string le = LabelValue(labels, "le");
      double bound = 0;
      if (le == "+Inf") {
        bound = std::numeric_limits<double>::infinity();
      } else if (!absl::SimpleAtod(le, &bound)) {
        continue;
      }
      s.buckets[bound] += value;
      s.ok = true;
    } else if (name == "deltad_release_decision_seconds_count") {
      s.count += value;
    } else if (name == "deltad_release_decision_seconds_sum") {
      s.sum += value;
    } else if (name == "deltad_orders_total") {
      const std::string kind = LabelValue(labels, "kind");
      if (kind == "offload") s.offloads += value;
      if (kind == "evict") s.evictions += value;
      if (kind == "budget") s.budgets += value;
      if (kind == "prefetch") s.prefetches += value;
    }
  }
  return s;
}

// Decisions between two scrapes: bucket, count and sum deltas.
struct Histogram {
  std::map<double, double> buckets;
  double count = 0;
  double sum = 0;

  void Add(const Scrape& from, const Scrape& to) {
    for (const auto& [le, n] : to.buckets) {
      auto it = from.buckets.find(le);
      buckets[le] += n - (it == from.buckets.end() ? 0 : it->second);
    }
    count += to.count - from.count;
    sum += to.sum - from.sum;
  }

  // As Prometheus's histogram_quantile: linear within the bucket that holds
  // the rank (the bucket bounds are all that is known).
  double Quantile(double q) const {
    if (count <= 0 || buckets.empty()) return 0;
    const double rank = q * count;
    double lower = 0, below = 0;
    for (const auto& [le, cum] : buckets) {
      if (cum >= rank) {
        if (std::isinf(le)) return lower;
        if (cum <= below) return le;
        return lower + (le - lower) * (rank - below) / (cum - below);
      }
      lower = le;
      below = cum;
    }
    return lower;
  }
  double Mean() const { return count > 0 ? sum / count : 0; }
};

struct Sample {
  double t = 0;  // seconds since the load started
  bool storm = false;
  int64_t rss_kib = 0;
  int64_t anon_kib = 0;  // of it, the daemon's private memory (heap, stacks)
  int64_t threads = 0;
  int fds = 0;
  int sessions = -1;  // -1: NodeStatus failed
  int trainers = 0;   // processes running
  double daemon_cpu = 0;
  Scrape scrape;
};

// --- The trainers.

enum class Kind { kRegular, kStormKilled, kStormExits };

struct Job {
  pid_t pid = -1;
  Kind kind = Kind::kRegular;
  int slot = -1;  // regular: which of --processes it replaces
  int gpu = 0;
  std::string label;
  std::string output;
  bool killed = false;  // SIGKILL sent on purpose
};

// Regular models, cycled over the slots of a GPU: a CNN, an encoder-decoder,
// a transformer and a dense net, as the demo mixes them; budgets from 60% to
// 80% of the model's peak so every process must release. Each declares the
// floor it needs to make progress (--min_budget, a fraction of its budget),
// as a job that must not die declares it: no admission cuts it below that.
// The floors are those below which runs without them failed (ResNet-50 at
// 4.9-5.4 MiB, U-Net at 5.0-6.8 MiB, GPT at 12-15 MiB of its 17.9 MiB
// peak), with the chunks' rounding on top; on a GPU they leave about a
// quarter of the budget to newcomers.
struct Model {
  std::vector<std::string> flags;
};
const std::vector<Model>& Models() {
  static const auto* models = new std::vector<Model>{
      {{"--model=resnet50", "--batch=16", "--budget=0.6", "--min_budget=0.6"}},
      {{"--model=unet", "--batch=4", "--budget=0.7", "--min_budget=0.7"}},
      // Its optimizer step pins nearly its whole peak: below 95% of it it
      // fails even with the in-process policy, and chunks of 2x CUDA's
      // granularity waste more than that. It asks for 130% and weighs
      // triple, so that the storms' cuts spare it; it releases when its
      // chunks run short, and loads the daemon with its many tensors.
      {{"--model=gpt", "--batch=2", "--gpt_layers=6", "--gpt_seq=256",
        "--budget=1.3", "--priority=3", "--min_budget=0.85"}},
      {{"--model=densenet121", "--batch=8", "--budget=0.8",
        "--min_budget=0.6"}},
  };
  return *models;
}

struct Outcome {
  int64_t started[3] = {};
  int64_t ok = 0;
  int64_t killed = 0;
  int64_t failed = 0;
  int64_t verified = 0;
  int64_t bad = 0;
  int64_t in_process = 0;  // never got a daemon session
  // Storm newcomers the daemon would not admit (that would have cut a
  // running job below its floor) within their wait: they fail closed.
  int64_t refused = 0;
  int64_t reconnected = 0;  // lost the daemon on the way
  std::vector<std::string> failures;
  // Failed runs by the cause their trainer printed.
  std::map<std::string, int64_t> causes;
};

// The trainer's error, short: its kind, without the numbers that differ
// from run to run.
std::string Cause(const std::string& out) {
  static const char* const kKnown[] = {
      "no chunk was granted yet", "need a chunk for blocks of",
      "device memory is full",    "no room for",
      "checksum mismatches",
  };
  for (const char* known : kKnown) {
    if (out.find(known) != std::string::npos) return known;
  }
  const size_t at = out.rfind("deltad-trainer: ");
  return at == std::string::npos ? "no error printed"
                                 : Tail(out.substr(at), 1).substr(0, 80);
}

// Reads a finished trainer's summary into `outcome`.
void Account(const Job& job, int status, Outcome& outcome) {
  const std::string out = ReadFile(job.output);
  if (job.killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
    ++outcome.killed;
    std::filesystem::remove(job.output);
    return;
  }
  if (out.find("in-process policy") != std::string::npos) ++outcome.in_process;
  if (out.find("(reconnected)") != std::string::npos) ++outcome.reconnected;
  const size_t summary = out.find("SUMMARY ");
  const size_t sums = out.find("checksums ", summary);
  int64_t verified = -1, bad = -1;
  if (summary != std::string::npos && sums != std::string::npos) {
    std::sscanf(out.c_str() + sums, "checksums %" SCNd64 " verified, %" SCNd64,
                &verified, &bad);
  }
  if (verified >= 0 && bad >= 0) {
    outcome.verified += verified;
    outcome.bad += bad;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && bad == 0) {
    ++outcome.ok;
    std::filesystem::remove(job.output);
    return;
  }
  if (job.kind != Kind::kRegular &&
      out.find("require_session is set") != std::string::npos) {
    ++outcome.refused;
    std::filesystem::remove(job.output);
    return;
  }
  ++outcome.failed;
  ++outcome.causes[WIFEXITED(status) ? Cause(out) : DescribeWait(status)];
  const std::string why =
      absl::StrCat(job.label, " (GPU ", job.gpu, "): ", DescribeWait(status),
                   bad > 0 ? absl::StrCat(", ", bad, " bad checksums") : "",
                   "; output ", job.output, ":\n", Tail(out, 6));
  Note("FAILED " + why);
  outcome.failures.push_back(why);
}

// --- The report.

double At(const std::vector<Sample>& samples, double t,
          int64_t Sample::*field) {
  for (const Sample& s : samples) {
    if (s.t >= t) return static_cast<double>(s.*field);
  }
  return samples.empty() ? 0 : static_cast<double>(samples.back().*field);
}

// Least-squares slope of RSS (MiB) over time (minutes) for t in [from, to].
double RssSlopeMibPerMin(const std::vector<Sample>& samples, double from,
                         double to) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const Sample& s : samples) {
    if (s.t < from || s.t > to) continue;
    const double x = s.t / 60, y = s.rss_kib / 1024.0;
    n += 1;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double d = n * sxx - sx * sx;
  return n < 2 || d == 0 ? 0 : (n * sxy - sx * sy) / d;
}

std::string Us(double seconds) {
  return absl::StrFormat("%.0f", seconds * 1e6);
}

int Run(const std::string& command) {
  const int gpus = absl::GetFlag(FLAGS_gpus);
  const int processes = absl::GetFlag(FLAGS_processes);
  const int duration = absl::GetFlag(FLAGS_duration);
  const double scale = absl::GetFlag(FLAGS_scale);
  const int storm_every = absl::GetFlag(FLAGS_storm_every);
  const int storm_length = absl::GetFlag(FLAGS_storm_length);
  const int storm_per_gpu = absl::GetFlag(FLAGS_storm_per_gpu);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const int64_t gpu_memory = int64_t{absl::GetFlag(FLAGS_gpu_memory_mib)} << 20;
  // The daemon and every trainer hold a descriptor per device chunk: the
  // limit deltad's systemd unit sets (LimitNOFILE), where this process may
  // raise it; the children inherit it.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_max < 1048576) {
    rlimit raised{1048576, 1048576};
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) files = raised;
  }
  int64_t chunk = int64_t{absl::GetFlag(FLAGS_chunk_kib)} << 10;
  if (chunk == 0) {
    // As the trainer sizes its local chunks, so that rounding wastes what
    // it would at full size; doubled while every GPU's budget (90%) handed
    // out in chunks would take more than 80% of the daemon's descriptors
    // (the rest: host slabs, sockets).
    const int64_t page = 4096;
    chunk = std::max<int64_t>(
        page, static_cast<int64_t>((2 << 20) * scale) / page * page);
    const auto fit = static_cast<int64_t>(
        0.9 * static_cast<double>(gpus * gpu_memory) /
        std::max(1.0, 0.8 * static_cast<double>(files.rlim_max)));
    while (chunk < fit) chunk *= 2;
  }
  const double warmup = absl::GetFlag(FLAGS_warmup) >= 0
                            ? absl::GetFlag(FLAGS_warmup)
                            : std::min(60.0, duration / 5.0);
  if (gpus < 1 || processes < 1 || duration < 1 || !(scale > 0) || scale > 1 ||
      iterations < 1 || storm_every < 1 || storm_length < 0 ||
      storm_length >= storm_every || storm_per_gpu < 0 || chunk <= 0 ||
      chunk % 4096 != 0) {
    std::fprintf(stderr,
                 "soak: bad flags (need gpus, processes, duration, iterations "
                 ">= 1, scale in (0, 1], storm_length < storm_every, chunk a "
                 "multiple of 4 KiB)\n");
    return 2;
  }

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
  const std::string socket_path = dir + "/deltad.sock";
  const std::string config_path = dir + "/deltad.conf";
  const std::string daemon_log = dir + "/deltad.log";
  // A host pool that covers every process's whole peak at once (each asks
  // for its peak in host memory), storms included. A session gets its
  // quota in whole slabs, rounded down: slabs must be small beside the
  // peaks, yet each is a descriptor in the daemon. The pool's memfds cost
  // only what is touched.
  const int64_t host_pool = std::max<int64_t>(
      int64_t{1} << 30,
      static_cast<int64_t>((processes + gpus * storm_per_gpu) *
                           (3.0 * (int64_t{1} << 30) * scale)));
  {
    std::ofstream conf(config_path);
    conf << "sim { gpus: " << gpus << " memory_bytes: " << gpu_memory
         << " chunk_bytes: " << chunk << " }\n"
         << "min_session_bytes: " << std::max<int64_t>(chunk, 1 << 20) << "\n"
         << "host_pool_bytes: " << host_pool << "\n"
         << "host_slab_bytes: " << (int64_t{2} << 20) << "\n"
         << "default_host_quota_bytes: " << host_pool / 8 << "\n";
  }
  const std::vector<std::string> daemon_args = {
      absl::GetFlag(FLAGS_deltad), "--config=" + config_path,
      "--socket=" + socket_path,   "--backend=sim",
      "--metrics=127.0.0.1:0",     "--drain_seconds=5"};
  Note(absl::StrCat("starting deltad: ", gpus, " simulated GPUs of ",
                    gpu_memory >> 20, " MiB, chunks of ", chunk >> 10,
                    " KiB; work dir ", dir));
  const pid_t daemon = Spawn(daemon_args, daemon_log);
  if (daemon < 0) {
    std::perror("soak: fork");
    return 1;
  }
  std::vector<std::string> problems;
  bool daemon_died = false;
  auto kill_daemon = [&] {
    if (!daemon_died) {
      kill(daemon, SIGKILL);
      waitpid(daemon, nullptr, 0);
    }
  };

  // Ready when the log names the metrics port and NodeStatus answers.
  int metrics_port = 0;
  auto channel = grpc::CreateChannel("unix:" + socket_path,
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::MemoryManager::NewStub(channel);
  auto node_status = [&](v1::NodeStatusResponse* out) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    return stub->NodeStatus(&context, {}, out).ok();
  };
  {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    v1::NodeStatusResponse status;
    while (true) {
      int wait_status = 0;
      if (waitpid(daemon, &wait_status, WNOHANG) == daemon) {
        std::fprintf(stderr, "soak: deltad exited at start-up (%s):\n%s",
                     DescribeWait(wait_status).c_str(),
                     ReadFile(daemon_log).c_str());
        return 1;
      }
      const std::string log = ReadFile(daemon_log);
      const size_t at = log.find("(port ");
      if (at != std::string::npos) {
        metrics_port = std::atoi(log.c_str() + at + 6);
      }
      if (metrics_port > 0 && node_status(&status)) break;
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "soak: deltad not ready in 60 s:\n%s",
                     log.c_str());
        kill_daemon();
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  Note(absl::StrCat("deltad ready (pid ", daemon, ", metrics port ",
                    metrics_port, ")"));

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  std::map<pid_t, Job> jobs;
  std::vector<bool> slot_busy(processes, false);
  std::vector<int> slot_runs(processes, 0);
  int storm_serial = 0;
  Outcome outcome;
  auto start_job = [&](Job job, const std::vector<std::string>& extra) {
    job.output = absl::StrCat(dir, "/", job.label, ".out");
    std::vector<std::string> args = {
        absl::GetFlag(FLAGS_trainer),           "--socket=" + socket_path,
        absl::StrCat("--gpu=", job.gpu),        "--label=" + job.label,
        absl::StrFormat("--scale=%.9g", scale),
    };
    args.insert(args.end(), extra.begin(), extra.end());
    job.pid = Spawn(args, job.output, absl::GetFlag(FLAGS_trainer_nice));
    if (job.pid < 0) {
      problems.push_back(absl::StrCat("fork failed: ", std::strerror(errno)));
      return false;
    }
    ++outcome.started[static_cast<int>(job.kind)];
    jobs.emplace(job.pid, std::move(job));
    return true;
  };
  auto start_regular = [&](int slot) {
    Job job;
    job.kind = Kind::kRegular;
    job.slot = slot;
    job.gpu = slot % gpus;
    const Model& model = Models()[(slot / gpus) % Models().size()];
    job.label = absl::StrCat("p", slot, "-", slot_runs[slot]++);
    std::vector<std::string> extra = model.flags;
    extra.push_back(absl::StrCat("--iterations=", iterations));
    // A newcomer the floors leave no room for waits, as a job should,
    // for a storm's length and the one after: a storm's trainers leave.
    extra.push_back(absl::StrCat("--admission_wait_ms=",
                                 absl::GetFlag(FLAGS_storm_every) * 1000));
    if (start_job(std::move(job), extra)) slot_busy[slot] = true;
  };
  auto start_storm = [&] {
    ++storm_serial;
    for (int gpu = 0; gpu < gpus; ++gpu) {
      for (int i = 0; i < storm_per_gpu; ++i) {
        Job job;
        job.gpu = gpu;
        job.kind = gpu % 2 == 0 ? Kind::kStormKilled : Kind::kStormExits;
        job.label = absl::StrCat("storm", storm_serial, "-g", gpu, "-", i);
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
            absl::StrCat("--admission_wait_ms=",
                         absl::GetFlag(FLAGS_storm_length) * 1000),
            absl::StrCat("--priority=", absl::GetFlag(FLAGS_storm_priority)),
            absl::StrCat("--iterations=",
                         job.kind == Kind::kStormKilled
                             ? 1000000
                             : absl::GetFlag(FLAGS_storm_iterations))};
        start_job(std::move(job), extra);
      }
    }
  };
  auto reap = [&] {
    while (true) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      if (pid == daemon) {
        daemon_died = true;
        problems.push_back(absl::StrCat(
            "deltad died during the run: ", DescribeWait(status), "; log ",
            daemon_log, ":\n", Tail(ReadFile(daemon_log), 10)));
        Note(problems.back());
        continue;
      }
      auto it = jobs.find(pid);
      if (it == jobs.end()) continue;
      Account(it->second, status, outcome);
      if (it->second.kind == Kind::kRegular) {
        slot_busy[it->second.slot] = false;
      }
      jobs.erase(it);
    }
  };
  // Storms start at every multiple of --storm_every after the first, when
  // they can end before the load does.
  auto storm_at = [&](double t) {
    if (t < storm_every) return false;
    const double start = std::floor(t / storm_every) * storm_every;
    return t - start < storm_length && start + storm_length <= duration;
  };

  std::vector<Sample> samples;
  const double machine_busy_start = MachineBusySeconds();
  const double own_start = CpuSeconds(getpid());
  const double daemon_cpu_start = CpuSeconds(daemon);
  const double children_start = ChildrenCpuSeconds();
  auto take_sample = [&](double t) {
    Sample s;
    s.t = t;
    s.storm = storm_at(t);
    s.rss_kib = RssKib(daemon);
    s.anon_kib = StatusField(daemon, "RssAnon");
    s.threads = StatusField(daemon, "Threads");
    s.fds = CountFds(daemon);
    s.trainers = static_cast<int>(jobs.size());
    s.daemon_cpu = CpuSeconds(daemon);
    v1::NodeStatusResponse status;
    if (node_status(&status)) s.sessions = status.sessions_size();
    s.scrape = ParseMetrics(ScrapeMetrics(metrics_port));
    samples.push_back(std::move(s));
  };

  Note(absl::StrCat("load: ", processes, " trainers on ", gpus, " GPUs for ",
                    duration, " s; a storm of ", storm_per_gpu * gpus,
                    " every ", storm_every, " s for ", storm_length, " s"));
  const Clock::time_point load_start = Clock::now();
  double next_sample = 0, next_progress = 10;
  bool in_storm = false;
  int storms = 0;
  size_t progress_from = 0;
  while (!daemon_died && !g_interrupted) {
    reap();
    const double t = Seconds(Clock::now() - load_start);
    if (t >= duration) break;
    // Staggered: a whole node's processes starting in the same instant
    // would measure fork and model set-up, not the daemon.
    int spawned = 0;
    for (int slot = 0; slot < processes && spawned < 2; ++slot) {
      if (!slot_busy[slot]) {
        start_regular(slot);
        ++spawned;
      }
    }
    const bool storm_now = storm_at(t);
    if (storm_now && !in_storm) {
      ++storms;
      Note(absl::StrCat("storm ", storms, ": ", storm_per_gpu * gpus,
                        " trainers at priority ",
                        absl::GetFlag(FLAGS_storm_priority)));
      start_storm();
    } else if (!storm_now && in_storm) {
      int killed = 0;
      for (auto& [pid, job] : jobs) {
        if (job.kind == Kind::kStormKilled && !job.killed) {
          kill(pid, SIGKILL);
          job.killed = true;
          ++killed;
        }
      }
      Note(absl::StrCat("storm ", storms, " ends: ", killed,
                        " storm trainers SIGKILLed"));
    }
    in_storm = storm_now;
    if (t >= next_sample) {
      take_sample(t);
      next_sample += 1;
    }
    if (t >= next_progress && samples.size() > progress_from + 1) {
      const Sample& a = samples[progress_from];
      const Sample& b = samples.back();
      std::fprintf(
          stderr,
          "soak [%6.1f s]: load %4.0f s  trainers %3d  sessions %3d  "
          "decisions/s %7.0f  RSS %6.1f MiB  threads %3" PRId64
          "  fds %5d  ok %" PRId64 " killed %" PRId64 " failed %" PRId64 "\n",
          Seconds(Clock::now() - kStart), t, b.trainers, b.sessions,
          (b.scrape.count - a.scrape.count) / std::max(1e-9, b.t - a.t),
          b.rss_kib / 1024.0, b.threads, b.fds, outcome.ok, outcome.killed,
          outcome.failed);
      progress_from = samples.size() - 1;
      next_progress += 10;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double load_seconds = Seconds(Clock::now() - load_start);
  if (g_interrupted) problems.push_back("interrupted");

  // Drain: storm trainers left are killed as a storm's end would; the rest
  // finish their iterations, which is what proves their bytes.
  for (auto& [pid, job] : jobs) {
    if (job.kind == Kind::kStormKilled && !job.killed) {
      kill(pid, SIGKILL);
      job.killed = true;
    }
  }
  Note(absl::StrCat("load over; waiting for ", jobs.size(),
                    " trainers to finish"));
  {
    const auto deadline =
        Clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_drain_timeout));
    while (!jobs.empty() && !daemon_died && !g_interrupted &&
           Clock::now() < deadline) {
      reap();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!jobs.empty()) {
      problems.push_back(absl::StrCat(
          jobs.size(), " trainers still running after the drain timeout"));
      for (auto& [pid, job] : jobs) {
        Note(absl::StrCat("still running: ", job.label, "; output ", job.output,
                          ":\n", Tail(ReadFile(job.output), 4)));
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
      jobs.clear();
    }
  }
  const double drain_seconds =
      Seconds(Clock::now() - load_start) - load_seconds;

  // Reclaimed: nothing left for anyone once every client is gone.
  v1::NodeStatusResponse final_status;
  bool serving = false, reclaimed = false;
  if (!daemon_died) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      final_status.Clear();
      serving = node_status(&final_status);
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
  const int64_t fds_after = daemon_died ? -1 : CountFds(daemon);
  const int64_t rss_after = daemon_died ? -1 : RssKib(daemon);
  if (!serving) problems.push_back("deltad is not serving after the run");
  if (serving && !reclaimed) {
    problems.push_back(absl::StrCat(
        "not reclaimed after every client left: ", final_status.sessions_size(),
        " sessions, ", final_status.host_pool_granted_bytes(),
        " host pool bytes granted, ", left_used, " device bytes used, ",
        left_chunks, " in chunks"));
  }
  const double daemon_cpu = daemon_died ? 0 : CpuSeconds(daemon);

  // Stop: SIGTERM, which a daemon with no sessions answers at once.
  std::string daemon_exit = "died during the run";
  if (!daemon_died) {
    kill(daemon, SIGTERM);
    int status = 0;
    pid_t got = 0;
    for (int i = 0; i < 300 && got == 0; ++i) {
      got = waitpid(daemon, &status, WNOHANG);
      if (got == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (got == daemon) {
      daemon_exit = DescribeWait(status);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        problems.push_back("deltad did not exit cleanly on SIGTERM: " +
                           daemon_exit);
      }
    } else {
      daemon_exit = "did not exit in 30 s of SIGTERM";
      problems.push_back("deltad " + daemon_exit);
      kill(daemon, SIGKILL);
      waitpid(daemon, nullptr, 0);
    }
  }
  // Every child is reaped by now: the trainers are the children's CPU
  // less the daemon's (which it spent before the load too, but start-up
  // is a fraction of a second).
  const double machine_busy = MachineBusySeconds() - machine_busy_start;
  const double own_cpu = CpuSeconds(getpid()) - own_start;
  const double trainers_cpu =
      std::max(0.0, ChildrenCpuSeconds() - children_start - daemon_cpu);
  const double others_cpu =
      std::max(0.0, machine_busy - own_cpu - trainers_cpu -
                        (daemon_cpu - daemon_cpu_start));

  // --- Figures.
  const bool lost = outcome.failed > 0 || outcome.bad > 0;
  if (lost) {
    problems.push_back(absl::StrCat(outcome.failed, " trainer runs failed, ",
                                    outcome.bad, " bad checksums"));
  }
  Histogram all, quiet, storm;
  double storm_time = 0, quiet_time = 0;
  double storm_orders = 0, quiet_orders = 0;
  int scrape_failures = 0;
  for (size_t i = 1; i < samples.size(); ++i) {
    const Sample& a = samples[i - 1];
    const Sample& b = samples[i];
    if (!a.scrape.ok || !b.scrape.ok) {
      ++scrape_failures;
      continue;
    }
    all.Add(a.scrape, b.scrape);
    const double orders = (b.scrape.offloads + b.scrape.evictions) -
                          (a.scrape.offloads + a.scrape.evictions);
    if (a.storm) {
      storm.Add(a.scrape, b.scrape);
      storm_time += b.t - a.t;
      storm_orders += orders;
    } else {
      quiet.Add(a.scrape, b.scrape);
      quiet_time += b.t - a.t;
      quiet_orders += orders;
    }
  }
  const double sampled = storm_time + quiet_time;
  const Scrape first = samples.empty() ? Scrape() : samples.front().scrape;
  const Scrape last = samples.empty() ? Scrape() : samples.back().scrape;

  // Memory: the baseline after warm-up (the first trainers' sessions and
  // the allocator's arenas settled), then the second half's trend.
  std::vector<Sample> after;
  for (const Sample& s : samples) {
    if (s.t >= warmup) after.push_back(s);
  }
  const double rss_base = At(samples, warmup, &Sample::rss_kib) / 1024;
  const double rss_mid = At(samples, duration / 2.0, &Sample::rss_kib) / 1024;
  const double rss_end = samples.empty() ? 0 : samples.back().rss_kib / 1024.0;
  double rss_max = 0, fds_max = 0, sessions_max = 0, sessions_sum = 0;
  int sessions_n = 0;
  for (const Sample& s : after) {
    rss_max = std::max(rss_max, s.rss_kib / 1024.0);
    fds_max = std::max<double>(fds_max, s.fds);
    sessions_max = std::max<double>(sessions_max, s.sessions);
    if (s.sessions >= 0) {
      sessions_sum += s.sessions;
      ++sessions_n;
    }
  }
  const double slope =
      RssSlopeMibPerMin(samples, duration / 2.0, static_cast<double>(duration));
  // From the middle: the first half holds the allocator's climb to its
  // high-water mark (glibc's per-thread arenas, one per gRPC thread that
  // ever allocated, and the cached stacks of exited threads), which a
  // process reaches once; a leak goes on climbing through the second half.
  const double growth = rss_mid > 0 ? (rss_end - rss_mid) / rss_mid : 0;
  const bool flat = slope < absl::GetFlag(FLAGS_flat_mib_per_min) &&
                    growth <= absl::GetFlag(FLAGS_flat_growth);
  const bool check_memory = absl::GetFlag(FLAGS_check_memory);
  if (check_memory && !flat) {
    problems.push_back("daemon memory did not stay flat");
  }
  const bool ok = problems.empty();

  std::ostringstream md;
  const int per_gpu = (processes + gpus - 1) / gpus;
  md << "## soak: " << processes << " training processes on " << gpus
     << " GPUs with pressure storms\n\n"
     << "Command: `" << command << "`  \n"
     << "Machine: " << CpuModel() << ", " << std::thread::hardware_concurrency()
     << " cores, busy "
     << absl::StrFormat(
            "%.0f of the %.0f CPU seconds (cores x wall time) of the load "
            "and drain: trainers %.0f, deltad %.0f, soak %.0f, other "
            "processes %.0f",
            machine_busy,
            std::thread::hardware_concurrency() *
                (load_seconds + drain_seconds),
            trainers_cpu, daemon_cpu - daemon_cpu_start, own_cpu, others_cpu)
     << "  \nDate: " << Today() << "\n\n"
     << "`deltad` (sim backend) runs " << gpus << " simulated GPUs of "
     << (gpu_memory >> 20) << " MiB (90% of it budgets), " << (chunk >> 10)
     << " KiB device chunks, a host pool of " << (host_pool >> 20)
     << " MiB. For " << duration << " s, " << processes
     << " `deltad-trainer` processes (about " << per_gpu
     << " per GPU) replay their model's training iterations with real "
        "bytes at scale 1/"
     << absl::StrFormat("%.0f", 1 / scale)
     << ", every tensor checksummed and verified after each reload and "
        "recompute; each runs "
     << iterations
     << " iterations and is replaced as soon as it exits. The models cycle "
        "over ResNet-50 (batch 16, budget 60% of its peak), U-Net (batch 4, "
        "70%), a 6-layer GPT (batch 2, sequence 256, 130%, priority 3: its "
        "optimizer step pins nearly its whole peak, below 95% of which it "
        "fails even with the in-process policy, and the chunks' rounding "
        "takes more) "
        "and DenseNet-121 (batch 8, 80%), so every process must release; "
        "each declares a floor (60%, 70%, 85% and 60% of its budget: below "
        "about that, runs without floors failed), and the daemon also keeps "
        "each job at the peak of its last iteration; a newcomer waits up to "
     << storm_every << " s for room above the floors. Every " << storm_every
     << " s a storm starts " << storm_per_gpu
     << " ResNet-50 (batch 32, floor 30%) per GPU asking for its whole peak "
        "at priority "
     << absl::GetFlag(FLAGS_storm_priority) << " for " << storm_length
     << " s, so every GPU's shares shrink down to the floors; a storm "
        "trainer the daemon will not admit above them waits the storm's "
        "length and gives up (it fails closed, and is counted apart). At a "
        "storm's end those on even GPUs are "
        "SIGKILLed, those on odd GPUs run "
     << absl::GetFlag(FLAGS_storm_iterations)
     << " iterations and exit. Then every trainer finishes, and the daemon "
        "must hold nothing. Sampled every second: RSS and descriptors "
        "(/proc), sessions (`NodeStatus`), and the release-decision "
        "histogram (`deltad_release_decision_seconds`: one decision per "
        "event batch applied and per `Release` call) from the metrics "
        "endpoint; percentiles interpolate within its buckets as "
        "`histogram_quantile` does.\n\n";
  md << "| figure | value | target | result |\n|---|---:|---|---|\n";
  auto row = [&](const std::string& name, const std::string& value,
                 const std::string& target, const std::string& result) {
    md << "| " << name << " | " << value << " | " << target << " | " << result
       << " |\n";
  };
  row("load / drain (s)",
      absl::StrFormat("%.0f / %.0f", load_seconds, drain_seconds), "-", "-");
  row("trainers started: regular / storm",
      absl::StrCat(outcome.started[0], " / ",
                   outcome.started[1] + outcome.started[2]),
      "-", "-");
  row("storms", absl::StrCat(storms), "-", "-");
  row("trainers exited 0 with 0 bad checksums", absl::StrCat(outcome.ok), "-",
      "-");
  row("trainers SIGKILLed on purpose (storms)", absl::StrCat(outcome.killed),
      "-", "-");
  row("storm newcomers refused: no room above the running jobs' floors",
      absl::StrCat(outcome.refused), "-", "-");
  row("checksums verified (reloads and recomputes)",
      absl::StrCat(outcome.verified), "-", "-");
  row("lost tensors: bad checksums", absl::StrCat(outcome.bad), "0",
      Verdict(outcome.bad == 0));
  std::string causes;
  for (const auto& [cause, n] : outcome.causes) {
    absl::StrAppend(&causes, causes.empty() ? " (" : "; ", n, " \"", cause,
                    "\"");
  }
  if (!causes.empty()) causes += ")";
  row("trainer runs that failed", absl::StrCat(outcome.failed, causes), "0",
      Verdict(outcome.failed == 0));
  row("trainers that ran without a daemon session",
      absl::StrCat(outcome.in_process, " (", outcome.reconnected,
                   " reconnected)"),
      "0", Verdict(outcome.in_process == 0 && outcome.reconnected == 0));
  int status_missed = 0;
  for (const Sample& s : samples) status_missed += s.sessions < 0 ? 1 : 0;
  row("NodeStatus samples that got no answer within 5 s",
      absl::StrCat(status_missed, " of ", samples.size()), "-", "-");
  row("sessions: max / mean after warm-up",
      absl::StrFormat("%.0f / %.1f", sessions_max,
                      sessions_n == 0 ? 0.0 : sessions_sum / sessions_n),
      "-", "-");
  row("release decisions", absl::StrFormat("%.0f", last.count - first.count),
      "-", "-");
  row("decisions/s: all / quiet / storm",
      absl::StrFormat("%.0f / %.0f / %.0f", all.count / std::max(1e-9, sampled),
                      quiet.count / std::max(1e-9, quiet_time),
                      storm.count / std::max(1e-9, storm_time)),
      "-", "-");
  row("decision latency p50 / p99 / mean (us): all",
      absl::StrCat(Us(all.Quantile(0.5)), " / ", Us(all.Quantile(0.99)), " / ",
                   Us(all.Mean())),
      "-", "-");
  row("decision latency p50 / p99 / mean (us): quiet",
      absl::StrCat(Us(quiet.Quantile(0.5)), " / ", Us(quiet.Quantile(0.99)),
                   " / ", Us(quiet.Mean())),
      "-", "-");
  row("decision latency p50 / p99 / mean (us): storms",
      absl::StrCat(Us(storm.Quantile(0.5)), " / ", Us(storm.Quantile(0.99)),
                   " / ", Us(storm.Mean())),
      "-", "-");
  row("release orders (offload + evict) per s: quiet / storm",
      absl::StrFormat("%.0f / %.0f", quiet_orders / std::max(1e-9, quiet_time),
                      storm_orders / std::max(1e-9, storm_time)),
      "-", "-");
  row("orders in all: offload / evict / budget / prefetch",
      absl::StrFormat(
          "%.0f / %.0f / %.0f / %.0f", last.offloads - first.offloads,
          last.evictions - first.evictions, last.budgets - first.budgets,
          last.prefetches - first.prefetches),
      "-", "-");
  row("daemon CPU (% of one core, load and drain)",
      absl::StrFormat("%.0f%%",
                      100 * (daemon_cpu - daemon_cpu_start) /
                          std::max(1e-9, load_seconds + drain_seconds)),
      "-", "-");
  row(absl::StrFormat("daemon RSS (MiB): after %.0f s warm-up / middle / end "
                      "/ max",
                      warmup),
      absl::StrFormat("%.1f / %.1f / %.1f / %.1f", rss_base, rss_mid, rss_end,
                      rss_max),
      "-", "-");
  row("daemon RSS slope over the second half (MiB/min)",
      absl::StrFormat("%+.2f", slope),
      absl::StrFormat("< %.1f", absl::GetFlag(FLAGS_flat_mib_per_min)), "-");
  row("daemon RSS growth, end over middle",
      absl::StrFormat("%+.1f%%", 100 * growth),
      absl::StrFormat("<= %.0f%%", 100 * absl::GetFlag(FLAGS_flat_growth)),
      "-");
  row("memory flat (both of the above)", flat ? "yes" : "no", "flat",
      check_memory ? Verdict(flat) : "not checked");
  row("daemon descriptors: after warm-up / max / after the drain",
      absl::StrFormat("%d / %.0f / %" PRId64,
                      after.empty() ? 0 : after.front().fds, fds_max,
                      fds_after),
      "-", "-");
  row("after every client left: sessions / host granted / device used / "
      "chunk bytes",
      absl::StrCat(final_status.sessions_size(), " / ",
                   final_status.host_pool_granted_bytes(), " / ", left_used,
                   " / ", left_chunks),
      "0 / 0 / 0 / 0", Verdict(reclaimed));
  row("daemon RSS after every client left (MiB)",
      absl::StrFormat("%.1f", rss_after / 1024.0), "-", "-");
  row("deltad on SIGTERM", daemon_exit, "exit code 0",
      Verdict(daemon_exit == "exit code 0"));
  md << "\n";
  if (scrape_failures > 0) {
    md << scrape_failures
       << " one-second intervals are left out of the decision figures: a "
          "scrape of the metrics endpoint failed.\n\n";
  }

  md << "Daemon memory over the run (the sample at or before each tenth of "
        "it):\n\n"
     << "| time (s) | phase | trainers | sessions | RSS (MiB) | of it "
        "anonymous (MiB) | threads | descriptors | decisions/s (last 10 s) "
        "|\n"
     << "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
  size_t previous = samples.size();
  for (int tenth = 0; tenth <= 10; ++tenth) {
    const double t = duration * tenth / 10.0;
    // The last sample at or before it: the tenths fall on storm starts.
    size_t i = 0;
    while (i + 1 < samples.size() && samples[i + 1].t <= t) ++i;
    if (samples.empty()) break;
    if (i == previous) continue;  // the last sample came before the end
    previous = i;
    const Sample& s = samples[i];
    size_t j = i;
    while (j > 0 && samples[j].t > s.t - 10) --j;
    const double rate = i > j ? (s.scrape.count - samples[j].scrape.count) /
                                    std::max(1e-9, s.t - samples[j].t)
                              : 0;
    md << absl::StrFormat(
        "| %.0f | %s | %d | %d | %.1f | %.1f | %d | %d | %.0f |\n", s.t,
        s.storm ? "storm" : "quiet", s.trainers, s.sessions, s.rss_kib / 1024.0,
        s.anon_kib / 1024.0, s.threads, s.fds, rate);
  }
  md << "\n"
     << "Memory is called flat when the least-squares slope of the RSS over "
        "the second half of the run is under "
     << absl::GetFlag(FLAGS_flat_mib_per_min)
     << " MiB/min and the RSS at the end is at most "
     << absl::StrFormat("%.0f%%", 100 * absl::GetFlag(FLAGS_flat_growth))
     << " above the RSS in the middle. The first half is left out: it holds "
        "the allocator's climb to its high-water mark (the anonymous memory "
        "column: glibc's per-thread arenas for the gRPC threads, one per "
        "open stream, and the stacks it caches for exited threads), which a "
        "process reaches once and does not give back. A leak keeps "
        "climbing: one tensor record (~100 bytes) per release decision "
        "would add several MiB a minute at the decision rates above, while "
        "the storms' extra sessions come and go and average out of the "
        "slope.\n\n"
     << "Result: " << (ok ? "**passed**" : "**FAILED**") << "\n";
  for (const std::string& p : problems) md << "- " << p << "\n";
  md << "\n";

  const std::string doc = absl::GetFlag(FLAGS_update_doc);
  if (!PrintReport(md.str(), doc, "soak")) {
    std::fprintf(stderr, "soak: could not write %s\n", doc.c_str());
    return 1;
  }
  if (!doc.empty()) Note("updated " + doc);
  for (const std::string& f : outcome.failures) {
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
