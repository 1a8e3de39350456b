#ifndef DELTAD_BENCH_REPORT_H_
#define DELTAD_BENCH_REPORT_H_

#include <string>
#include <vector>

namespace deltad::bench {

// The median, 99th percentile (nearest rank) and mean of a set of samples.
struct Percentiles {
  double p50 = 0;
  double p99 = 0;
  double mean = 0;
};
// All zero for no samples.
Percentiles Summarise(std::vector<double> v);

// "met", or a bold "MISSED", for the result column of a report's table.
std::string Verdict(bool met);

// The command line for a report's "Command:" line: "build/bench/<binary>"
// and the arguments, or DELTAD_BENCH_COMMAND where set (scripts/bench may
// name itself so the doc shows what a reader can run).
std::string CommandLine(const std::string& binary, int argc, char** argv);

// "AMD EPYC ..." from /proc/cpuinfo, for the machine line of a report.
std::string CpuModel();
// CPU seconds the whole machine has spent busy, all cores (/proc/stat):
// beside a run's own CPU time, what other work on a shared machine took.
double MachineBusySeconds();
// Today's date, UTC, as YYYY-MM-DD.
std::string Today();
// Replaces the text between `<!-- tag:begin -->` and `<!-- tag:end -->` in
// the Markdown file at `path` with `section` (appending both markers when
// they are missing). False when the file cannot be written.
bool UpdateDocSection(const std::string& path, const std::string& tag,
                      const std::string& section);
// Prints `report` on stdout and, when `doc` is not empty, writes it as the
// `tag` section of that Markdown file (UpdateDocSection). False when the
// file cannot be written.
bool PrintReport(const std::string& report, const std::string& doc,
                 const std::string& tag);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_REPORT_H_
