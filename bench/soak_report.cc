#include "bench/soak_report.h"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/report.h"
#include "bench/soak_figures.h"
#include "bench/soak_load.h"
#include "bench/soak_trainers.h"

namespace deltad::bench {
namespace {

double At(const std::vector<Sample>& samples, double t,
          int64_t Sample::*field) {
  for (const Sample& s : samples) {
    if (s.t >= t) return static_cast<double>(s.*field);
  }
  return samples.empty() ? 0 : static_cast<double>(samples.back().*field);
}

// Least-squares slope of a memory figure (KiB, MiB/min out) over time
// (minutes) for t in [from, to]; samples where it is unknown (< 0) left out.
double SlopeMibPerMin(const std::vector<Sample>& samples, double from,
                      double to, int64_t Sample::*field) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const Sample& s : samples) {
    if (s.t < from || s.t > to || s.*field < 0) continue;
    const double x = s.t / 60, y = s.*field / 1024.0;
    n += 1;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double d = n * sxx - sx * sx;
  return n < 2 || d == 0 ? 0 : (n * sxy - sx * sy) / d;
}

// "p50 / p99 / mean" of the decisions, in whole microseconds.
std::string Latency(const Histogram& h) {
  auto us = [](double seconds) {
    return absl::StrFormat("%.0f", seconds * 1e6);
  };
  return absl::StrCat(us(h.Quantile(0.5)), " / ", us(h.Quantile(0.99)), " / ",
                      us(h.Mean()));
}

// The release decisions and orders between consecutive samples, in all
// and apart for the storms and the quiet time between them.
struct Decisions {
  Histogram all, quiet, storm;
  double storm_time = 0, quiet_time = 0;
  double storm_orders = 0, quiet_orders = 0;
  int scrape_failures = 0;
  double sampled = 0;
  Scrape first, last;
};

Decisions DecisionFigures(const std::vector<Sample>& samples) {
  Decisions d;
  for (size_t i = 1; i < samples.size(); ++i) {
    const Sample& a = samples[i - 1];
    const Sample& b = samples[i];
    if (!a.scrape.ok || !b.scrape.ok) {
      ++d.scrape_failures;
      continue;
    }
    d.all.Add(a.scrape, b.scrape);
    const double orders = (b.scrape.offloads + b.scrape.evictions) -
                          (a.scrape.offloads + a.scrape.evictions);
    if (a.storm) {
      d.storm.Add(a.scrape, b.scrape);
      d.storm_time += b.t - a.t;
      d.storm_orders += orders;
    } else {
      d.quiet.Add(a.scrape, b.scrape);
      d.quiet_time += b.t - a.t;
      d.quiet_orders += orders;
    }
  }
  d.sampled = d.storm_time + d.quiet_time;
  d.first = samples.empty() ? Scrape() : samples.front().scrape;
  d.last = samples.empty() ? Scrape() : samples.back().scrape;
  return d;
}

// The daemon's memory: the baseline after warm-up (the first trainers' sessions
// and the allocator's arenas settled), then the second half's trend.
struct Memory {
  double rss_base = 0, rss_mid = 0, rss_end = 0, rss_max = 0;  // MiB
  int fds_base = 0;
  double fds_max = 0, sessions_max = 0, sessions_sum = 0;
  int sessions_n = 0;
  double slope = 0;   // MiB/min
  double growth = 0;  // end over middle
  bool flat = false;
  // The heap in use (MiB; -1: unknown) and its slope (MiB/min).
  double heap_mid = -1, heap_end = -1, heap_slope = 0;
};

Memory MemoryFigures(const SoakSettings& settings,
                     const std::vector<Sample>& samples) {
  Memory m;
  std::vector<Sample> after;
  for (const Sample& s : samples) {
    if (s.t >= settings.warmup) after.push_back(s);
  }
  m.rss_base = At(samples, settings.warmup, &Sample::rss_kib) / 1024;
  m.rss_mid = At(samples, settings.duration / 2.0, &Sample::rss_kib) / 1024;
  m.rss_end = samples.empty() ? 0 : samples.back().rss_kib / 1024.0;
  m.fds_base = after.empty() ? 0 : after.front().fds;
  for (const Sample& s : after) {
    m.rss_max = std::max(m.rss_max, s.rss_kib / 1024.0);
    m.fds_max = std::max<double>(m.fds_max, s.fds);
    m.sessions_max = std::max<double>(m.sessions_max, s.sessions);
    if (s.sessions >= 0) {
      m.sessions_sum += s.sessions;
      ++m.sessions_n;
    }
  }
  m.slope =
      SlopeMibPerMin(samples, settings.duration / 2.0,
                     static_cast<double>(settings.duration), &Sample::rss_kib);
  // The heap in use has no high-water mark: the RSS's climb that is the
  // allocator's stays out of it, a leak does not.
  if (!samples.empty() && samples.back().heap_kib >= 0) {
    m.heap_mid = At(samples, settings.duration / 2.0, &Sample::heap_kib) / 1024;
    m.heap_end = samples.back().heap_kib / 1024.0;
    m.heap_slope = SlopeMibPerMin(samples, settings.duration / 2.0,
                                  static_cast<double>(settings.duration),
                                  &Sample::heap_kib);
  }
  // From the middle: the first half holds the allocator's climb to its
  // high-water mark (its per-thread caches, glibc's arenas, one per thread
  // that ever allocated, and the cached stacks of exited threads), which a
  // process reaches once; a leak goes on climbing through the second half.
  m.growth = m.rss_mid > 0 ? (m.rss_end - m.rss_mid) / m.rss_mid : 0;
  m.flat =
      m.slope < settings.flat_mib_per_min && m.growth <= settings.flat_growth;
  return m;
}

void WriteIntro(std::ostringstream& md, const SoakSettings& settings,
                const SoakResult& result) {
  const int per_gpu = (settings.processes + settings.gpus - 1) / settings.gpus;
  md << "## soak: " << settings.processes << " training processes on "
     << settings.gpus << " GPUs with pressure storms\n\n"
     << "Command: `" << settings.command << "`  \n"
     << "Machine: " << CpuModel() << ", " << std::thread::hardware_concurrency()
     << " cores, busy "
     << absl::StrFormat(
            "%.0f of the %.0f CPU seconds (cores x wall time) of the load "
            "and drain: trainers %.0f, deltad %.0f, soak %.0f, other "
            "processes %.0f",
            result.machine_busy,
            std::thread::hardware_concurrency() *
                (result.load_seconds + result.drain_seconds),
            result.trainers_cpu, result.daemon_cpu, result.own_cpu,
            result.others_cpu)
     << "  \nDate: " << Today() << "\n\n"
     << "`deltad` (sim backend) runs " << settings.gpus << " simulated GPUs of "
     << (settings.gpu_memory >> 20) << " MiB (90% of it budgets), "
     << (settings.chunk >> 10) << " KiB device chunks, a host pool of "
     << (settings.host_pool >> 20) << " MiB. For " << settings.duration
     << " s, " << settings.processes << " `deltad-trainer` processes (about "
     << per_gpu
     << " per GPU) replay their model's training iterations with real "
        "bytes at scale 1/"
     << absl::StrFormat("%.0f", 1 / settings.scale)
     << ", every tensor checksummed and verified after each reload and "
        "recompute; each runs "
     << settings.iterations
     << " iterations and is replaced as soon as it exits. The models cycle "
        "over ResNet-50 (batch 16, budget 60% of its peak), U-Net (batch 4, "
        "70%), a 6-layer GPT (batch 2, sequence 256, 80%) "
        "and DenseNet-121 (batch 8, 80%), so every process must release; "
        "each declares a floor (60%, 70%, 70% and 60% of its budget: below "
        "about that, runs without floors failed), and the daemon also keeps "
        "each job at the peak of its last iteration; a newcomer waits up to "
     << settings.storm_every << " s for room above the floors. Every "
     << settings.storm_every << " s a storm starts " << settings.storm_per_gpu
     << " ResNet-50 (batch 32, floor 30%) per GPU asking for its whole peak "
        "at priority "
     << settings.storm_priority << " for " << settings.storm_length
     << " s, so every GPU's shares shrink down to the floors; a storm "
        "trainer the daemon will not admit above them waits the storm's "
        "length and gives up (it fails closed, and is counted apart). At a "
        "storm's end those on even GPUs are "
        "SIGKILLed, those on odd GPUs run "
     << settings.storm_iterations
     << " iterations and exit. Then every trainer finishes, and the daemon "
        "must hold nothing. Sampled every second: RSS and descriptors "
        "(/proc), sessions (`NodeStatus`), and from the metrics endpoint "
        "the daemon's heap in use (`deltad_heap_in_use_bytes`, set once a "
        "second: what its malloc handed out and did not get back, with no "
        "high-water mark in it, unlike the RSS) and the release-decision "
        "histogram (`deltad_release_decision_seconds`: one decision per "
        "event batch applied and per `Release` call); percentiles "
        "interpolate within its buckets as `histogram_quantile` does.\n\n";
}

void WriteTable(std::ostringstream& md, const SoakSettings& settings,
                const SoakResult& result, const Decisions& d, const Memory& m) {
  const Outcome& outcome = result.outcome;
  const std::vector<Sample>& samples = result.samples;
  const bool check_memory = settings.check_memory;
  md << "| figure | value | target | result |\n|---|---:|---|---|\n";
  auto row = [&](const std::string& name, const std::string& value,
                 const std::string& target, const std::string& verdict) {
    md << "| " << name << " | " << value << " | " << target << " | " << verdict
       << " |\n";
  };
  row("load / drain (s)",
      absl::StrFormat("%.0f / %.0f", result.load_seconds, result.drain_seconds),
      "-", "-");
  row("trainers started: regular / storm",
      absl::StrCat(outcome.started[0], " / ",
                   outcome.started[1] + outcome.started[2]),
      "-", "-");
  row("storms", absl::StrCat(result.storms), "-", "-");
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
  row("runs that allocated past their budget in chunks they held "
      "(everything else in use by running ops) / allocations",
      absl::StrCat(outcome.past_budget_runs, " / ",
                   outcome.past_budget_allocations),
      "-", "-");
  // Every client here behaves: a call counted as ended unseen would be one
  // the daemon's census took for refused while it waited to be served.
  double ended_unseen = 0;
  for (const Sample& s : samples) {
    ended_unseen = std::max(ended_unseen, s.scrape.ended_unseen);
  }
  row("calls gRPC ended before the daemon saw them "
      "(`grpc_ended_unseen`)",
      absl::StrFormat("%.0f", ended_unseen), "0", Verdict(ended_unseen == 0));
  int status_missed = 0;
  for (const Sample& s : samples) status_missed += s.sessions < 0 ? 1 : 0;
  row("NodeStatus samples that got no answer within 5 s",
      absl::StrCat(status_missed, " of ", samples.size()), "-", "-");
  row("sessions: max / mean after warm-up",
      absl::StrFormat("%.0f / %.1f", m.sessions_max,
                      m.sessions_n == 0 ? 0.0 : m.sessions_sum / m.sessions_n),
      "-", "-");
  row("release decisions",
      absl::StrFormat("%.0f", d.last.count - d.first.count), "-", "-");
  row("decisions/s: all / quiet / storm",
      absl::StrFormat("%.0f / %.0f / %.0f",
                      d.all.count / std::max(1e-9, d.sampled),
                      d.quiet.count / std::max(1e-9, d.quiet_time),
                      d.storm.count / std::max(1e-9, d.storm_time)),
      "-", "-");
  row("decision latency p50 / p99 / mean (us): all", Latency(d.all), "-", "-");
  row("decision latency p50 / p99 / mean (us): quiet", Latency(d.quiet), "-",
      "-");
  row("decision latency p50 / p99 / mean (us): storms", Latency(d.storm), "-",
      "-");
  row("release orders (offload + evict) per s: quiet / storm",
      absl::StrFormat("%.0f / %.0f",
                      d.quiet_orders / std::max(1e-9, d.quiet_time),
                      d.storm_orders / std::max(1e-9, d.storm_time)),
      "-", "-");
  row("orders in all: offload / evict / budget / prefetch",
      absl::StrFormat("%.0f / %.0f / %.0f / %.0f",
                      d.last.offloads - d.first.offloads,
                      d.last.evictions - d.first.evictions,
                      d.last.budgets - d.first.budgets,
                      d.last.prefetches - d.first.prefetches),
      "-", "-");
  row("daemon CPU (% of one core, load and drain)",
      absl::StrFormat("%.0f%%", 100 * result.daemon_cpu /
                                    std::max(1e-9, result.load_seconds +
                                                       result.drain_seconds)),
      "-", "-");
  row(absl::StrFormat("daemon RSS (MiB): after %.0f s warm-up / middle / end "
                      "/ max",
                      settings.warmup),
      absl::StrFormat("%.1f / %.1f / %.1f / %.1f", m.rss_base, m.rss_mid,
                      m.rss_end, m.rss_max),
      "-", "-");
  row("daemon RSS slope over the second half (MiB/min)",
      absl::StrFormat("%+.2f", m.slope),
      absl::StrFormat("< %.1f", settings.flat_mib_per_min), "-");
  row("daemon RSS growth, end over middle",
      absl::StrFormat("%+.1f%%", 100 * m.growth),
      absl::StrFormat("<= %.0f%%", 100 * settings.flat_growth), "-");
  row("memory flat (both of the above)", m.flat ? "yes" : "no", "flat",
      check_memory ? Verdict(m.flat) : "not checked");
  if (m.heap_end >= 0) {
    row("daemon heap in use (MiB): middle / end",
        absl::StrFormat("%.1f / %.1f", m.heap_mid, m.heap_end), "-", "-");
    row("daemon heap in use, slope over the second half (MiB/min)",
        absl::StrFormat("%+.2f", m.heap_slope), "-", "-");
  }
  row("daemon descriptors: after warm-up / max / after the drain",
      absl::StrFormat("%d / %.0f / %" PRId64, m.fds_base, m.fds_max,
                      result.fds_after),
      "-", "-");
  row("after every client left: sessions / host granted / device used / "
      "chunk bytes",
      absl::StrCat(result.left_sessions, " / ", result.left_host_granted, " / ",
                   result.left_used, " / ", result.left_chunks),
      "0 / 0 / 0 / 0", Verdict(result.reclaimed));
  row("daemon RSS after every client left (MiB)",
      absl::StrFormat("%.1f", result.rss_after / 1024.0), "-", "-");
  row("deltad's malloc (its start line)",
      result.daemon_heap.empty() ? "-" : result.daemon_heap, "-", "-");
  row("deltad on SIGTERM", result.daemon_exit, "exit code 0",
      Verdict(result.daemon_exit == "exit code 0"));
  md << "\n";
  if (d.scrape_failures > 0) {
    md << d.scrape_failures
       << " one-second intervals are left out of the decision figures: a "
          "scrape of the metrics endpoint failed.\n\n";
  }
}

void WriteMemoryOverTime(std::ostringstream& md, const SoakSettings& settings,
                         const std::vector<Sample>& samples) {
  md << "Daemon memory over the run (the sample at or before each tenth of "
        "it):\n\n"
     << "| time (s) | phase | trainers | sessions | RSS (MiB) | of it "
        "anonymous (MiB) | heap in use (MiB) | threads | descriptors | "
        "decisions/s (last 10 s) |\n"
     << "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  size_t previous = samples.size();
  for (int tenth = 0; tenth <= 10; ++tenth) {
    const double t = settings.duration * tenth / 10.0;
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
        "| %.0f | %s | %d | %d | %.1f | %.1f | %s | %d | %d | %.0f |\n", s.t,
        s.storm ? "storm" : "quiet", s.trainers, s.sessions, s.rss_kib / 1024.0,
        s.anon_kib / 1024.0,
        s.heap_kib < 0 ? "-" : absl::StrFormat("%.1f", s.heap_kib / 1024.0),
        s.threads, s.fds, rate);
  }
  md << "\n"
     << "Memory is called flat when the least-squares slope of the RSS over "
        "the second half of the run is under "
     << settings.flat_mib_per_min
     << " MiB/min and the RSS at the end is at most "
     << absl::StrFormat("%.0f%%", 100 * settings.flat_growth)
     << " above the RSS in the middle. The first half is left out: it holds "
        "the allocator's climb to its high-water mark (the anonymous memory "
        "column: the malloc's caches for gRPC's threads, which serve "
        "every stream and call (no thread is a session's own), and the "
        "stacks it caches for exited threads), which a process reaches "
        "once (glibc's arenas keep theirs; jemalloc, the daemon's malloc "
        "where the build found it, gives freed pages back within a "
        "second). A leak keeps "
        "climbing: one tensor record (~100 bytes) per release decision "
        "would add several MiB a minute at the decision rates above, while "
        "the storms' extra sessions come and go and average out of the "
        "slope.\n\n";
}

}  // namespace

std::string SoakReport(const SoakSettings& settings, SoakResult& result) {
  const Outcome& outcome = result.outcome;
  if (outcome.failed > 0 || outcome.bad > 0) {
    result.problems.push_back(absl::StrCat(outcome.failed,
                                           " trainer runs failed, ",
                                           outcome.bad, " bad checksums"));
  }
  const Decisions decisions = DecisionFigures(result.samples);
  const Memory memory = MemoryFigures(settings, result.samples);
  if (settings.check_memory && !memory.flat) {
    result.problems.push_back("daemon memory did not stay flat");
  }
  const bool ok = result.problems.empty();

  std::ostringstream md;
  WriteIntro(md, settings, result);
  WriteTable(md, settings, result, decisions, memory);
  WriteMemoryOverTime(md, settings, result.samples);
  md << "Result: " << (ok ? "**passed**" : "**FAILED**") << "\n";
  for (const std::string& p : result.problems) md << "- " << p << "\n";
  md << "\n";
  return md.str();
}

}  // namespace deltad::bench
