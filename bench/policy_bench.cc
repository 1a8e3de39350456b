// The side-by-side policy table: every trace (the measured DTR logs, the
// model traces and any recorded trace files) at every budget ratio under
// every policy, in one run; the fidelity of the simulated DTR against DTR's
// measurements; and, with --max_batch, the largest batch each policy fits for
// a model.
//
//   build/bench/policy_bench --csv=docs/bench/policy.csv
//       --plots=docs/bench --update_doc=docs/BENCHMARKS.md
//
// A model recorded with deltad.torch.record_trace replays beside them:
//
//   build/bench/policy_bench --trace_files=mymodel.trace --models=

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_traces.h"
#include "bench/max_batch.h"
#include "bench/own_peak_check.h"
#include "bench/policy_table.h"
#include "bench/random_graph_section.h"
#include "bench/report.h"
#include "bench/steady_state_section.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/dtr_log.h"
#include "policies/sim/dtr_measured.h"
#include "policies/sim/lower_bounds.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"
#include "policies/sim/trace_io.h"

ABSL_FLAG(std::string, traces, "",
          "folder of the measured DTR logs (default: $DELTAD_DTR_TRACES or "
          "../shared/traces/dtr)");
ABSL_FLAG(std::string, models, "resnet50,densenet121,vgg16,unet,gpt",
          "model traces to generate (empty: none)");
ABSL_FLAG(std::string, model_device, "a100-80gb", "device for model traces");
ABSL_FLAG(int, model_batch, 32, "batch of the model traces");
ABSL_FLAG(std::string, trace_files, "",
          "comma-separated trace files in the project's text format "
          "(policies/sim/trace_io.h, e.g. from deltad.torch.record_trace), "
          "run on the --model_device profile");
ABSL_FLAG(std::string, policies, "", "policies to run (default: all)");
ABSL_FLAG(std::string, ratios, "0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
          "budgets as fractions of each trace's unlimited peak");
ABSL_FLAG(std::string, csv, "", "write every row to this CSV file");
ABSL_FLAG(std::string, plots, "", "write slowdown plots (SVG) to this folder");
ABSL_FLAG(std::string, update_doc, "",
          "rewrite this benchmark's sections of this Markdown file");
ABSL_FLAG(std::string, max_batch, "",
          "find the largest batch each policy fits for these models");
ABSL_FLAG(std::string, max_batch_device, "a100-80gb",
          "device profile for --max_batch");
ABSL_FLAG(std::string, allocator, "",
          "allocator model: exact, best-fit, vm-chunks or pytorch-caching "
          "(default: exact for the table, pytorch-caching for --max_batch)");
ABSL_FLAG(std::string, optimizer, "adam",
          "optimizer of the model traces: sgd, momentum or adam");
ABSL_FLAG(int, steady_iterations, 5,
          "iterations of the steady-state section (0: no section)");
ABSL_FLAG(std::string, steady_ratios, "0.5",
          "budget ratios of the steady-state section");
ABSL_FLAG(std::string, steady_policies,
          "dtr,delta-paper,delta,delta-steady,offload-greedy,window",
          "policies of the steady-state section");
ABSL_FLAG(int, random_graphs, 0,
          "compare every policy on this many random layer graphs, and check "
          "every planner at its own peak on them under every allocator "
          "model (sections of their own)");
ABSL_FLAG(int, host_gib, 128,
          "pinned host pool per GPU in GiB (a DGX A100: 1 TiB for 8 GPUs)");

namespace deltad::sim {
namespace {

std::vector<std::string> List(const std::string& csv) {
  std::vector<std::string> out;
  for (absl::string_view s : absl::StrSplit(csv, ',', absl::SkipEmpty())) {
    out.emplace_back(s);
  }
  return out;
}

std::vector<std::string> AllPolicies() { return PolicyNames(); }

// --allocator for the table: exact unless named. Checked once in main();
// an unknown name cannot reach here.
AllocatorKind TableAllocator() {
  const std::string name = absl::GetFlag(FLAGS_allocator);
  return name.empty() ? AllocatorKind::kExact : *ParseAllocatorKind(name);
}

Optimizer ModelOptimizer() {
  return *ParseOptimizer(absl::GetFlag(FLAGS_optimizer));
}

// `iterations` 0: as many as the policy needs to show what it does
// (IterationsFor).
absl::StatusOr<SimResult> RunOne(const Program& program,
                                 const DeviceProfile& device,
                                 const std::string& policy, int64_t budget,
                                 int iterations = 0) {
  auto made = MakePolicy(policy);
  if (!made.ok()) return made.status();
  SimOptions o;
  o.budget_bytes = budget;
  o.host_bytes = int64_t{absl::GetFlag(FLAGS_host_gib)} << 30;
  // Checked once in main(); an unknown name cannot reach here.
  o.allocator = TableAllocator();
  o.iterations = iterations > 0 ? iterations : IterationsFor(policy);
  auto r = Simulate(program, device, **made, o);
  if (r.ok()) return r;
  if (r.status().code() == absl::StatusCode::kFailedPrecondition) {
    SimResult infeasible;
    infeasible.policy = policy;
    infeasible.budget_bytes = budget;
    infeasible.min_budget_bytes = program.min_budget_bytes;
    infeasible.compute_ns = program.compute_ns;
    infeasible.failure = std::string(r.status().message());
    return infeasible;
  }
  return r.status();
}

}  // namespace
}  // namespace deltad::sim

namespace deltad::sim {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string Command(int argc, char** argv) {
  std::vector<std::string> parts{"build/bench/policy_bench"};
  for (int i = 1; i < argc; ++i) parts.emplace_back(argv[i]);
  return absl::StrJoin(parts, " ");
}

}  // namespace
}  // namespace deltad::sim

namespace deltad::sim {
namespace {

std::string FidelitySection(const std::vector<BenchTrace>& traces,
                            bool* mostly_met) {
  std::string dir = absl::GetFlag(FLAGS_traces);
  if (dir.empty()) dir = DefaultDtrTraceDir();
  auto measured =
      LoadDtrMeasurements(absl::StrCat(dir, "/measured-data-full.json"));
  std::ostringstream md;
  md << "### Fidelity: simulated `dtr` against DTR's measured slowdown\n\n";
  if (!measured.ok()) {
    md << "Measured data not found (" << measured.status().message()
       << ").\n\n";
    *mostly_met = false;
    return md.str();
  }
  md << "Measured: DTR's runs on a Titan V (`measured-data-full.json`), "
        "slowdown = DTR median time / baseline median time at the same "
        "batch. Simulated: the `dtr` policy on the same log at the same "
        "absolute budget, Titan V profile.\n\n"
     << "| model | batch | budget (GB) | measured | simulated | error |\n"
     << "|---|---:|---:|---:|---:|---:|\n";
  int pairs = 0;
  int within = 0;
  for (const BenchTrace& trace : traces) {
    if (trace.dtr_model.empty()) continue;
    const DtrMeasurement* base =
        FindDtrBaseline(*measured, trace.dtr_model, trace.dtr_batch);
    if (base == nullptr) continue;
    auto device = FindDeviceProfile(trace.device);
    if (!device.ok()) continue;
    for (const DtrMeasurement& m : *measured) {
      if (m.type != "dtr" || m.model != trace.dtr_model ||
          m.batch != trace.dtr_batch) {
        continue;
      }
      const double meas = m.median_ms / base->median_ms;
      auto r = RunOne(trace.program, *device, "dtr", m.budget_bytes);
      std::string sim = "-";
      std::string err = "does not fit";
      if (r.ok() && r->fits) {
        ++pairs;
        const double e = r->slowdown() / meas - 1;
        within += std::abs(e) <= 0.15 ? 1 : 0;
        sim = absl::StrFormat("%.3f", r->slowdown());
        err = absl::StrFormat("%+.1f%%", 100 * e);
      } else {
        ++pairs;
      }
      md << "| " << trace.dtr_model << " | " << m.batch << " | "
         << absl::StrFormat("%.1f", m.budget_bytes / 1e9) << " | "
         << absl::StrFormat("%.3f", meas) << " | " << sim << " | " << err
         << " |\n";
    }
  }
  *mostly_met = pairs > 0 && 2 * within > pairs;
  md << "\nWithin ±15%: " << within << " of " << pairs << " pairs: **"
     << (*mostly_met ? "met" : "MISSED") << "** (target: most pairs).\n\n";
  return md.str();
}

int RunTable(const std::string& command) {
  const auto bench_start = Clock::now();
  std::vector<std::string> policies = List(absl::GetFlag(FLAGS_policies));
  if (policies.empty()) policies = AllPolicies();
  std::vector<double> ratios;
  for (const std::string& r : List(absl::GetFlag(FLAGS_ratios))) {
    ratios.push_back(std::strtod(r.c_str(), nullptr));
  }
  TraceSources sources;
  sources.trace_files = List(absl::GetFlag(FLAGS_trace_files));
  sources.dtr_dir = absl::GetFlag(FLAGS_traces);
  sources.models = List(absl::GetFlag(FLAGS_models));
  sources.model_device = absl::GetFlag(FLAGS_model_device);
  sources.model_batch = absl::GetFlag(FLAGS_model_batch);
  sources.optimizer = ModelOptimizer();
  auto loaded = LoadTraces(sources);
  if (!loaded.ok()) {
    std::fprintf(stderr, "policy_bench: %s\n",
                 std::string(loaded.status().message()).c_str());
    return 2;
  }
  const std::vector<BenchTrace> traces = std::move(*loaded);
  if (traces.empty()) {
    std::fprintf(stderr, "policy_bench: no traces to run\n");
    return 2;
  }
  std::vector<Row> rows;
  double slowest_run = 0;
  std::string slowest_what;
  for (size_t i = 0; i < traces.size(); ++i) {
    const BenchTrace& trace = traces[i];
    auto device = FindDeviceProfile(trace.device);
    if (!device.ok()) continue;
    const auto start = Clock::now();
    // Ratios of the peak under the allocator model, so that at 1.0
    // nothing has to be released.
    auto peak = UnlimitedPeak(trace.program, *device, TableAllocator());
    if (!peak.ok()) {
      std::fprintf(stderr, "policy_bench: %s: %s\n", trace.name.c_str(),
                   std::string(peak.status().message()).c_str());
      return 1;
    }
    for (double ratio : ratios) {
      const auto budget =
          static_cast<int64_t>(ratio * static_cast<double>(*peak));
      const LowerBounds bounds =
          ComputeLowerBounds(trace.program, *device, budget);
      for (const std::string& policy : policies) {
        const auto run_start = Clock::now();
        auto r = RunOne(trace.program, *device, policy, budget);
        // Per replayed iteration: delta-replay runs two.
        const double took =
            Seconds(Clock::now() - run_start) / IterationsFor(policy);
        if (took > slowest_run) {
          slowest_run = took;
          slowest_what =
              absl::StrFormat("%s, %s at %.1f (%d ops)", trace.name, policy,
                              ratio, trace.program.steps.size());
        }
        if (!r.ok()) {
          std::fprintf(stderr, "policy_bench: %s %s: %s\n", trace.name.c_str(),
                       policy.c_str(),
                       std::string(r.status().message()).c_str());
          return 1;
        }
        // A run faster than the bound means the bound or the simulator
        // is wrong: the table would show neither truly.
        if (r->fits && r->makespan_ns < bounds.mixed_ns) {
          std::fprintf(stderr,
                       "policy_bench: %s %s at %.1f ran in %lld ns, under "
                       "the lower bound of any schedule (%lld ns)\n",
                       trace.name.c_str(), policy.c_str(), ratio,
                       static_cast<long long>(r->makespan_ns),
                       static_cast<long long>(bounds.mixed_ns));
          return 1;
        }
        rows.push_back({trace.name, trace.source, trace.device, ratio, *r,
                        bounds.swap_only_ns, bounds.mixed_ns});
      }
    }
    std::fprintf(stderr, "policy_bench: [%zu/%zu] %s (%zu ops): %.1f s\n",
                 i + 1, traces.size(), trace.name.c_str(),
                 trace.program.steps.size(), Seconds(Clock::now() - start));
  }

  std::ostringstream md;
  md << "## policy_bench: every policy side by side\n\n"
     << "Command: `" << command << "`  \nMachine: " << bench::CpuModel()
     << "  \nDate: " << bench::Today() << "\n\n"
     << "Each cell is the slowdown (simulated makespan / ideal compute time) "
        "of one training iteration (`delta-replay`'s second, once it has "
        "recorded one; `delta-steady`'s third, as its plans are judged) at a "
        "budget that is a fraction of the "
        "trace's unlimited peak under the allocator model `"
     << AllocatorKindName(TableAllocator())
     << "`; `-` means it does not fit. Measured DTR "
        "logs run on the Titan V profile, model traces on "
     << absl::GetFlag(FLAGS_model_device) << " at batch "
     << absl::GetFlag(FLAGS_model_batch) << " (GPT at a quarter of it) with "
     << absl::GetFlag(FLAGS_optimizer)
     << " (gradients set to None between iterations, PyTorch 2's default)"
     << (absl::GetFlag(FLAGS_trace_files).empty()
             ? ""
             : absl::StrCat(", recorded traces (`--trace_files`) on ",
                            absl::GetFlag(FLAGS_model_device)))
     << ". `swap LB` is the offloading "
        "paper's lower bound for any swap-only schedule, max(compute, excess "
        "out + excess back), and `LB` a lower bound for any schedule, "
        "offloads and recomputes mixed (policies/sim/lower_bounds.h: around "
        "the steps where most must live, what must leave before the step "
        "and come back after it, over the links or rebuilt at its "
        "producers' op time at least), both as slowdowns; the bench fails "
        "if any run is faster than `LB`. Every row is in "
        "`docs/bench/policy.csv`.\n\n";
  for (const BenchTrace& trace : traces) {
    md << "**" << trace.name << "** (" << trace.source << ", "
       << trace.program.steps.size() << " ops, peak "
       << absl::StrFormat("%.2f", trace.program.peak_bytes / 1e9)
       << " GB, ideal "
       << absl::StrFormat("%.1f", trace.program.compute_ns / 1e6)
       << " ms, largest op "
       << absl::StrFormat("%.2f", trace.program.min_budget_bytes / 1e9)
       << " GB)\n\n| budget | " << absl::StrJoin(policies, " | ")
       << " | swap LB | LB |\n|---:|";
    for (size_t i = 0; i <= policies.size() + 1; ++i) md << "---:|";
    md << "\n";
    for (double ratio : ratios) {
      md << "| " << absl::StrFormat("%.1f", ratio);
      int64_t swap_lb = 0;
      int64_t mixed_lb = 0;
      for (const std::string& policy : policies) {
        const Row* row = FindRow(rows, trace.name, ratio, policy);
        md << " | " << (row ? Cell(row->result) : "");
        if (row != nullptr) {  // the cell's bounds, on each of its rows
          swap_lb = row->swap_lb_ns;
          mixed_lb = row->mixed_lb_ns;
        }
      }
      const auto ideal = static_cast<double>(trace.program.compute_ns);
      md << " | " << absl::StrFormat("%.3f", swap_lb / ideal) << " | "
         << absl::StrFormat("%.3f", mixed_lb / ideal) << " |\n";
    }
    md << "\n";
  }

  Targets targets;
  targets.md
      << "### Targets\n\n| target | measured | result |\n|---|---|---|\n";
  CheckTargets(traces, rows, ratios, targets);
  bool fidelity_met = false;
  const std::string fidelity = FidelitySection(traces, &fidelity_met);
  std::string steady;
  if (const int n = absl::GetFlag(FLAGS_steady_iterations); n > 0) {
    std::vector<SteadyStateTrace> steady_traces;
    for (const BenchTrace& trace : traces) {
      auto device = FindDeviceProfile(trace.device);
      if (device.ok()) {
        steady_traces.push_back({trace.name, &trace.program, *device});
      }
    }
    std::vector<double> steady_ratios;
    for (const std::string& r : List(absl::GetFlag(FLAGS_steady_ratios))) {
      steady_ratios.push_back(std::strtod(r.c_str(), nullptr));
    }
    auto section = SteadyStateSection(
        steady_traces, List(absl::GetFlag(FLAGS_steady_policies)),
        steady_ratios, n, TableAllocator(),
        int64_t{absl::GetFlag(FLAGS_host_gib)} << 30);
    if (!section.ok()) {
      std::fprintf(stderr, "policy_bench: %s\n",
                   section.status().ToString().c_str());
      return 1;
    }
    steady = *std::move(section);
    std::fprintf(stderr, "policy_bench: steady state: %.1f s\n",
                 Seconds(Clock::now() - bench_start));
  }
  std::string own_peak;
  if (const int graphs = absl::GetFlag(FLAGS_random_graphs); graphs > 0) {
    auto model_device = FindDeviceProfile(absl::GetFlag(FLAGS_model_device));
    if (!model_device.ok()) {
      std::fprintf(stderr, "policy_bench: %s\n",
                   std::string(model_device.status().message()).c_str());
      return 2;
    }
    const int iterations = std::max(1, absl::GetFlag(FLAGS_steady_iterations));
    auto compared = RandomGraphSection(graphs, policies, ratios, iterations,
                                       *model_device, TableAllocator(), RunOne);
    if (!compared.ok()) {
      std::fprintf(stderr, "policy_bench: %s\n",
                   compared.status().ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "policy_bench: random graphs compared: %.1f s\n",
                 Seconds(Clock::now() - bench_start));
    auto section = OwnPeakSection(graphs, policies, *model_device);
    if (!section.ok()) {
      std::fprintf(stderr, "policy_bench: %s\n",
                   section.status().ToString().c_str());
      return 1;
    }
    own_peak = *std::move(compared) + *std::move(section);
  }
  const double total = Seconds(Clock::now() - bench_start);
  targets.md << "| simulated `dtr` within ±15% of DTR's measured slowdown on "
                "most pairs | see the fidelity table | **"
             << (fidelity_met ? "met" : "MISSED") << "** |\n"
             << "| the whole bench under 5 minutes | "
             << absl::StrFormat("%.0f s", total) << " | **"
             << (total < 300 ? "met" : "MISSED") << "** |\n"
             << "| one replay of the largest trace under 1 s | slowest "
                "iteration "
             << absl::StrFormat("%.2f s", slowest_run) << " (" << slowest_what
             << ") | **" << (slowest_run < 1.0 ? "met" : "MISSED") << "** |\n";

  md << targets.md.str() << "\n" << fidelity << steady << own_peak;

  const std::string csv = absl::GetFlag(FLAGS_csv);
  if (!csv.empty()) WriteCsv(csv, rows);
  const std::string plots = absl::GetFlag(FLAGS_plots);
  if (!plots.empty()) {
    std::vector<std::string> written;
    WritePlots(plots, rows, policies, &written);
    if (!written.empty()) {
      md << "### Plots\n\n";
      for (const std::string& svg : written) {
        md << "![" << svg << "](bench/" << svg << ")\n";
      }
      md << "\n";
    }
  }
  std::printf("%s", md.str().c_str());
  const std::string doc = absl::GetFlag(FLAGS_update_doc);
  if (!doc.empty() && !bench::UpdateDocSection(doc, "policy_bench", md.str())) {
    std::fprintf(stderr, "policy_bench: could not write %s\n", doc.c_str());
    return 1;
  }
  std::fprintf(stderr, "policy_bench: %zu runs in %.0f s\n", rows.size(),
               total);
  return 0;
}

}  // namespace
}  // namespace deltad::sim

int main(int argc, char** argv) {
  const std::string command = deltad::sim::Command(argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (auto a = deltad::sim::ParseAllocatorKind(absl::GetFlag(FLAGS_allocator));
      !absl::GetFlag(FLAGS_allocator).empty() && !a.ok()) {
    std::fprintf(stderr, "policy_bench: %s\n",
                 std::string(a.status().message()).c_str());
    return 2;
  }
  if (auto o = deltad::sim::ParseOptimizer(absl::GetFlag(FLAGS_optimizer));
      !o.ok()) {
    std::fprintf(stderr, "policy_bench: %s\n",
                 std::string(o.status().message()).c_str());
    return 2;
  }
  if (!absl::GetFlag(FLAGS_max_batch).empty()) {
    auto device =
        deltad::sim::FindDeviceProfile(absl::GetFlag(FLAGS_max_batch_device));
    if (!device.ok()) {
      std::fprintf(stderr, "policy_bench: %s\n",
                   std::string(device.status().message()).c_str());
      return 2;
    }
    deltad::sim::MaxBatchOptions o;
    o.models = deltad::sim::List(absl::GetFlag(FLAGS_max_batch));
    o.policies = deltad::sim::List(absl::GetFlag(FLAGS_policies));
    if (o.policies.empty()) o.policies = deltad::sim::AllPolicies();
    o.device = *device;
    o.optimizer = deltad::sim::ModelOptimizer();
    const std::string allocator = absl::GetFlag(FLAGS_allocator);
    o.allocator = allocator.empty()
                      ? deltad::sim::AllocatorKind::kPyTorchCaching
                      : *deltad::sim::ParseAllocatorKind(allocator);
    o.host_bytes = int64_t{absl::GetFlag(FLAGS_host_gib)} << 30;
    o.command = command;
    o.update_doc = absl::GetFlag(FLAGS_update_doc);
    return deltad::sim::RunMaxBatch(o);
  }
  return deltad::sim::RunTable(command);
}
