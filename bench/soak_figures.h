#ifndef DELTAD_BENCH_SOAK_FIGURES_H_
#define DELTAD_BENCH_SOAK_FIGURES_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace deltad::bench {

// The daemon's figures that soak samples every second: its memory,
// threads, descriptors and CPU time from /proc, and its release decisions
// and orders from the Prometheus endpoint.

// A number field of /proc/<pid>/status ("VmRSS", "RssAnon", "Threads").
int64_t StatusField(pid_t pid, const std::string& field);
int64_t RssKib(pid_t pid);
int CountFds(pid_t pid);
// User plus system CPU seconds of a process (/proc/<pid>/stat).
double CpuSeconds(pid_t pid);
// User plus system CPU seconds of the children reaped so far.
double ChildrenCpuSeconds();

// The body of GET /metrics on 127.0.0.1:port; empty on any failure.
std::string ScrapeMetrics(int port);

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
  double heap_in_use = -1;  // deltad_heap_in_use_bytes; -1: not scraped
  // deltad_refused_total{limit="grpc_ended_unseen"}: calls gRPC ended
  // before the daemon saw them; none where every client behaves.
  double ended_unseen = 0;
};

Scrape ParseMetrics(const std::string& text);

// Decisions between two scrapes: bucket, count and sum deltas.
struct Histogram {
  std::map<double, double> buckets;
  double count = 0;
  double sum = 0;

  void Add(const Scrape& from, const Scrape& to);
  // As Prometheus's histogram_quantile: linear within the bucket that holds
  // the rank (the bucket bounds are all that is known).
  double Quantile(double q) const;
  double Mean() const { return count > 0 ? sum / count : 0; }
};

struct Sample {
  double t = 0;  // seconds since the load started
  bool storm = false;
  int64_t rss_kib = 0;
  int64_t anon_kib = 0;  // of it, the daemon's private memory (heap, stacks)
  // The daemon's heap in use (its gauge, set once a second): no high-water
  // mark in it, unlike the RSS. -1: unknown.
  int64_t heap_kib = -1;
  int64_t threads = 0;
  int fds = 0;
  int sessions = -1;  // -1: NodeStatus failed
  int trainers = 0;   // processes running
  double daemon_cpu = 0;
  Scrape scrape;
};

// Writes one line per sample (memory in KiB, -1 where unknown), with a
// header; false when the file cannot be written.
bool WriteSamplesCsv(const std::vector<Sample>& samples,
                     const std::string& path);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_SOAK_FIGURES_H_
