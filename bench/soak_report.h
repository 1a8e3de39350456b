#ifndef DELTAD_BENCH_SOAK_REPORT_H_
#define DELTAD_BENCH_SOAK_REPORT_H_

#include <string>

#include "bench/soak_load.h"

namespace deltad::bench {

// The soak report's Markdown. First adds to `result.problems` what the
// figures show (failed trainer runs or bad checksums, daemon memory that
// did not stay flat where it is checked): the run passed when there are
// none.
std::string SoakReport(const SoakSettings& settings, SoakResult& result);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_SOAK_REPORT_H_
