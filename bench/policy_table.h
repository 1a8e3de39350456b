#ifndef DELTAD_BENCH_POLICY_TABLE_H_
#define DELTAD_BENCH_POLICY_TABLE_H_

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// policy_bench's table: the traces it runs, a row per (trace, budget ratio,
// policy), the files written from the rows and the table's targets.

// A trace of the table.
struct BenchTrace {
  std::string name;
  std::string source;     // "dtr-log", "model" or "recorded"
  std::string device;     // profile name
  std::string dtr_model;  // key into the measured data, for the fidelity
  int dtr_batch = 0;
  bool cnn = false;
  Program program;
};

// One run: a policy on a trace at a budget ratio.
struct Row {
  std::string trace;
  std::string source;
  std::string device;
  double ratio = 0;
  SimResult result;
  int64_t swap_lb_ns = 0;   // the offloading paper's LB at this budget
  int64_t mixed_lb_ns = 0;  // any schedule's (LowerBounds::mixed_ns)
};

// The slowdown as a table cell, `-` when the run did not fit.
std::string Cell(const SimResult& r);

// Every row as CSV (policy_bench --csv).
void WriteCsv(const std::string& path, const std::vector<Row>& rows);

// One SVG per trace with gnuplot: slowdown against budget ratio, a line per
// policy; the names written go to `written`.
void WritePlots(const std::string& dir, const std::vector<Row>& rows,
                const std::vector<std::string>& policies,
                std::vector<std::string>* written);

// The row of `policy` on `trace` at `ratio`, or null; Find: its result.
const Row* FindRow(const std::vector<Row>& rows, const std::string& trace,
                   double ratio, const std::string& policy);
const SimResult* Find(const std::vector<Row>& rows, const std::string& trace,
                      double ratio, const std::string& policy);

struct Targets {
  std::ostringstream md;
  bool all_met = true;
};

// The table's targets on the measured traces: `delta` no slower than `dtr`,
// `swap-lru` and `offload-greedy`, and within 1.10x of ideal at 0.5 on the
// CNN traces; rows of a Markdown table into `t`.
void CheckTargets(const std::vector<BenchTrace>& traces,
                  const std::vector<Row>& rows,
                  const std::vector<double>& ratios, Targets& t);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_POLICY_TABLE_H_
