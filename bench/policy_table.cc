#include "bench/policy_table.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace deltad::sim {
namespace {

std::string CsvEscape(std::string s) {
  for (char& c : s) {
    if (c == ',' || c == '"' || c == '\n') c = ';';
  }
  return s;
}

}  // namespace

std::string Cell(const SimResult& r) {
  return r.fits ? absl::StrFormat("%.3f", r.slowdown()) : std::string("-");
}

void WriteCsv(const std::string& path, const std::vector<Row>& rows) {
  std::filesystem::create_directories(
      std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::trunc);
  out << "trace,source,device,budget_ratio,budget_bytes,policy,fits,slowdown,"
         "makespan_ns,compute_ns,peak_bytes,d2h_bytes,h2d_bytes,recompute_ns,"
         "stall_ns,offloads,evictions,recomputes,min_budget_bytes,"
         "swap_lower_bound_ns,mixed_lower_bound_ns,failure\n";
  for (const Row& row : rows) {
    const SimResult& r = row.result;
    out << row.trace << ',' << row.source << ',' << row.device << ','
        << absl::StrFormat("%.2f", row.ratio) << ',' << r.budget_bytes << ','
        << r.policy << ',' << (r.fits ? 1 : 0) << ','
        << (r.fits ? absl::StrFormat("%.4f", r.slowdown()) : "") << ','
        << r.makespan_ns << ',' << r.compute_ns << ',' << r.peak_bytes << ','
        << r.d2h_bytes << ',' << r.h2d_bytes << ',' << r.recompute_ns << ','
        << r.stall_ns << ',' << r.offloads << ',' << r.evictions << ','
        << r.recomputes << ',' << r.min_budget_bytes << ',' << row.swap_lb_ns
        << ',' << row.mixed_lb_ns << ',' << CsvEscape(r.failure) << '\n';
  }
}

// One SVG per trace: slowdown against budget ratio, a line per policy.
void WritePlots(const std::string& dir, const std::vector<Row>& rows,
                const std::vector<std::string>& policies,
                std::vector<std::string>* written) {
  std::filesystem::create_directories(dir);
  std::map<std::string, std::vector<const Row*>> by_trace;
  for (const Row& r : rows) by_trace[r.trace].push_back(&r);
  for (const auto& [trace, list] : by_trace) {
    const std::string dat = absl::StrCat(dir, "/", trace, ".dat");
    {
      std::ofstream out(dat, std::ios::trunc);
      for (const std::string& policy : policies) {
        out << "\"" << policy << "\"\n";
        for (const Row* r : list) {
          if (r->result.policy == policy && r->result.fits) {
            out << r->ratio << ' ' << r->result.slowdown() << '\n';
          }
        }
        out << "\n\n";
      }
    }
    const std::string svg = absl::StrCat(trace, ".svg");
    const std::string script = absl::StrCat(
        "set terminal svg size 720,440 font 'sans,11' background rgb 'white'; "
        "set output '",
        dir, "/", svg, "'; set title 'slowdown against budget: ", trace,
        "'; set xlabel 'budget (fraction of the unlimited peak)'; "
        "set ylabel 'makespan / ideal compute time'; set key outside right; "
        "set grid; set xrange [0.25:1.05]; plot for [i=0:",
        policies.size() - 1, "] '", dat,
        "' index i using 1:2 with linespoints title columnheader(1)");
    const std::string cmd =
        absl::StrCat("gnuplot -e \"", script, "\" 2>/dev/null");
    if (std::system(cmd.c_str()) == 0) {
      written->push_back(svg);
    } else {
      std::fprintf(stderr,
                   "policy_bench: gnuplot failed for %s (is it "
                   "installed?)\n",
                   trace.c_str());
    }
    std::filesystem::remove(dat);
  }
}

const Row* FindRow(const std::vector<Row>& rows, const std::string& trace,
                   double ratio, const std::string& policy) {
  for (const Row& r : rows) {
    if (r.trace == trace && std::abs(r.ratio - ratio) < 1e-9 &&
        r.result.policy == policy) {
      return &r;
    }
  }
  return nullptr;
}

const SimResult* Find(const std::vector<Row>& rows, const std::string& trace,
                      double ratio, const std::string& policy) {
  const Row* row = FindRow(rows, trace, ratio, policy);
  return row == nullptr ? nullptr : &row->result;
}

void CheckTargets(const std::vector<BenchTrace>& traces,
                  const std::vector<Row>& rows,
                  const std::vector<double>& ratios, Targets& t) {
  // 1. delta no slower than dtr, swap-lru and offload-greedy wherever
  //    anything fits, on the measured traces.
  int pairs = 0;
  int met = 0;
  std::vector<std::string> misses;
  for (const BenchTrace& trace : traces) {
    if (trace.source != "dtr-log") continue;
    for (double ratio : ratios) {
      const SimResult* delta = Find(rows, trace.name, ratio, "delta");
      bool any = false;
      for (const Row& r : rows) {
        if (r.trace == trace.name && std::abs(r.ratio - ratio) < 1e-9 &&
            r.result.fits && r.result.policy != "none") {
          any = true;
        }
      }
      if (!any || delta == nullptr) continue;
      for (const char* other : {"dtr", "swap-lru", "offload-greedy"}) {
        const SimResult* o = Find(rows, trace.name, ratio, other);
        if (o == nullptr || !o->fits) continue;
        ++pairs;
        // Within 0.5% counts as equal: the simulator is not that precise.
        if (delta->fits && delta->slowdown() <= o->slowdown() * 1.005) {
          ++met;
        } else {
          misses.push_back(absl::StrFormat(
              "%s at %.1f: delta %s vs %s %.3f", trace.name, ratio,
              delta->fits ? absl::StrFormat("%.3f", delta->slowdown())
                          : std::string("does not fit"),
              other, o->slowdown()));
        }
      }
    }
  }
  const bool t1 = pairs > 0 && met == pairs;
  t.all_met &= t1;
  t.md << "| `delta` no slower than `dtr`, `swap-lru`, `offload-greedy` on "
          "every measured trace and budget where anything fits (ties within "
          "0.5% count as equal) | "
       << met << " of " << pairs << " comparisons | **"
       << (t1 ? "met" : "MISSED") << "** |\n";
  // 2. delta within 1.10x of ideal at a 0.5 budget on the CNN traces.
  int cnn = 0;
  int cnn_met = 0;
  std::vector<std::string> cnn_values;
  for (const BenchTrace& trace : traces) {
    if (!trace.cnn || trace.source != "dtr-log") continue;
    const Row* row = FindRow(rows, trace.name, 0.5, "delta");
    if (row == nullptr) continue;
    const SimResult* delta = &row->result;
    ++cnn;
    const bool ok = delta->fits && delta->slowdown() <= 1.10;
    cnn_met += ok ? 1 : 0;
    // Beside the least any schedule could take there (LowerBounds).
    cnn_values.push_back(absl::StrCat(
        trace.name, " ",
        delta->fits ? absl::StrFormat("%.3f", delta->slowdown()) : "-",
        absl::StrFormat(" (LB %.3f)",
                        static_cast<double>(row->mixed_lb_ns) /
                            static_cast<double>(trace.program.compute_ns))));
  }
  const bool t2 = cnn > 0 && cnn_met == cnn;
  t.all_met &= t2;
  t.md << "| `delta` within 1.10x of ideal at a 0.5 budget on the measured "
          "CNN traces | "
       << absl::StrJoin(cnn_values, "; ") << " | **" << (t2 ? "met" : "MISSED")
       << "** |\n";
  if (!misses.empty()) {
    t.md << "\nWhere `delta` is slower: " << absl::StrJoin(misses, "; ")
         << ".\n";
  }
}

}  // namespace deltad::sim
