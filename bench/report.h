#ifndef DELTAD_BENCH_REPORT_H_
#define DELTAD_BENCH_REPORT_H_

#include <string>

namespace deltad::bench {

// "AMD EPYC ..." from /proc/cpuinfo, for the machine line of a report.
std::string CpuModel();
// Today's date, UTC, as YYYY-MM-DD.
std::string Today();
// Replaces the text between `<!-- tag:begin -->` and `<!-- tag:end -->` in
// the Markdown file at `path` with `section` (appending both markers when
// they are missing). False when the file cannot be written.
bool UpdateDocSection(const std::string& path, const std::string& tag,
                      const std::string& section);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_REPORT_H_
