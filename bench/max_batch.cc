#include "bench/max_batch.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/report.h"
#include "policies/sim/policy_registry.h"
#include "policies/sim/program.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kGiB = double{int64_t{1} << 30};
// The DELTA paper, Tables III and IV: the largest batch of plain training
// ("baseline") on one A100 with Adam, fp32 ImageNet inputs.
constexpr int kPaperResNet50 = 891;
constexpr int kPaperResNet101 = 594;
constexpr double kPaperTolerance = 0.10;

struct Search {
  int batch = 0;        // the largest that fits; 0: not even 1
  double slowdown = 0;  // at that batch
  absl::Status error;   // a run that failed (not: did not fit)
};

// Doubling from 1, then bisection between the last batch that fit and the
// first that did not.
Search LargestBatch(const std::string& model, const std::string& policy,
                    const DeviceProfile& device, Optimizer optimizer,
                    AllocatorKind allocator, int64_t host_bytes,
                    bool grads_set_to_none = true) {
  Search out;
  double slowdown = 0;
  auto fits = [&](int batch) {
    if (!out.error.ok()) return false;
    ModelOptions opt;
    opt.batch = batch;
    opt.optimizer = optimizer;
    opt.grads_set_to_none = grads_set_to_none;
    auto trace = BuildModelTrace(model, opt, device);
    if (!trace.ok()) {
      out.error = trace.status();
      return false;
    }
    auto program = Compile(*trace);
    if (!program.ok()) {
      out.error = program.status();
      return false;
    }
    auto made = MakePolicy(policy);
    if (!made.ok()) {
      out.error = made.status();
      return false;
    }
    SimOptions o;
    o.budget_bytes = device.usable_bytes();
    o.host_bytes = host_bytes;
    o.allocator = allocator;
    o.iterations = IterationsFor(policy);
    auto r = Simulate(*program, device, **made, o);
    if (r.status().code() == absl::StatusCode::kFailedPrecondition) {
      return false;  // one step alone needs more than the device
    }
    if (!r.ok()) {
      out.error = absl::Status(
          r.status().code(),
          absl::StrCat(trace->name, ", ", policy, ": ", r.status().message()));
      return false;
    }
    if (!r->fits) return false;
    slowdown = r->slowdown();
    return true;
  };
  if (!fits(1)) return out;
  int lo = 1;
  int hi = 2;
  while (hi <= (1 << 16) && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  fits(lo);  // the slowdown at the answer, not at the last probe
  out.batch = lo;
  out.slowdown = slowdown;
  return out;
}

std::string MemoryLine(const DeviceProfile& d) {
  return absl::StrFormat(
      "%.2f GiB usable of the %.2f GiB CUDA reports (%.0f MiB CUDA context, "
      "%.1f MiB cuBLAS workspaces)",
      d.usable_bytes() / kGiB, d.memory_bytes / kGiB,
      d.context_bytes / (kGiB / 1024), d.blas_workspace_bytes / (kGiB / 1024));
}

// The unmanaged largest batch of ResNet-50/101 on this device under every
// allocator model, with Adam, against the paper's.
std::string PaperSection(const MaxBatchOptions& o, absl::Status* error) {
  std::ostringstream md;
  md << "### Unmanaged largest batch against the DELTA paper\n\n";
  if (o.device.name != "a100-80gb") {
    md << "Not run: the paper's figures are for an A100 80GB "
          "(--max_batch_device a100-80gb), not "
       << o.device.name << ".\n\n";
    return md.str();
  }
  const std::vector<AllocatorKind> allocators = {
      AllocatorKind::kExact, AllocatorKind::kBestFit, AllocatorKind::kVmChunks,
      AllocatorKind::kPyTorchCaching};
  md << "`none` with Adam (the paper's optimizer), fp32, 224x224, gradient "
        "buffers kept between iterations (PyTorch 1.x's zero_grad, the "
        "paper's time; PyTorch 2 sets them to None, as the table above "
        "does), on the "
     << o.device.title << " profile: " << MemoryLine(o.device)
     << ". Paper: Tables III and IV (plain training, \"baseline\"). Target: "
        "within "
     << absl::StrFormat("%.0f%%", 100 * kPaperTolerance)
     << " of the paper from sourced costs alone.\n\n| model | paper |";
  for (AllocatorKind a : allocators)
    md << " `" << AllocatorKindName(a) << "` |";
  md << "\n|---|---:|";
  for (size_t i = 0; i < allocators.size(); ++i) md << "---:|";
  md << "\n";
  for (const auto& [model, paper] : std::vector<std::pair<std::string, int>>{
           {"resnet50", kPaperResNet50}, {"resnet101", kPaperResNet101}}) {
    md << "| " << model << " | " << paper << " |";
    for (AllocatorKind a : allocators) {
      const Search s = LargestBatch(model, "none", o.device, Optimizer::kAdam,
                                    a, o.host_bytes,
                                    /*grads_set_to_none=*/false);
      if (!s.error.ok()) {
        *error = s.error;
        md << " error |";
        continue;
      }
      const double off = static_cast<double>(s.batch) / paper - 1;
      md << " " << s.batch << absl::StrFormat(" (%+.1f%%, ", 100 * off)
         << (std::abs(off) <= kPaperTolerance ? "met" : "missed") << ") |";
      std::fprintf(stderr, "policy_bench: %s none %s adam: max batch %d\n",
                   model.c_str(), std::string(AllocatorKindName(a)).c_str(),
                   s.batch);
    }
    md << "\n";
  }
  md << "\nWhat the model leaves out: cuDNN's convolution workspaces beyond "
        "the traces' bounded guess (PyTorch retries with algorithms that "
        "need less when one does not fit), the memory of the data loader's "
        "pinned buffers and of other libraries, and the paper's own "
        "figure of 71.54 (GB or GiB: the paper does not say) at batch 891.\n\n";
  return md.str();
}

}  // namespace

int RunMaxBatch(const MaxBatchOptions& o) {
  std::ostringstream md;
  md << "## policy_bench --max_batch: largest batch that fits (simulated)\n\n"
     << "Command: `" << o.command << "`  \nMachine: " << bench::CpuModel()
     << "  \nDate: " << bench::Today() << "\n\n"
     << "Simulated on the " << o.device.title
     << " profile: " << MemoryLine(o.device) << "; allocator model `"
     << AllocatorKindName(o.allocator) << "`, optimizer "
     << OptimizerName(o.optimizer)
     << " (gradients set to None between iterations, PyTorch 2's default), "
        "pinned host pool "
     << absl::StrFormat("%.0f", o.host_bytes / kGiB)
     << " GiB, fp32, one training iteration; a batch fits when the "
        "simulated iteration completes within the usable memory. Each "
        "cell: the largest batch, and in brackets the slowdown at that "
        "batch.\n\n"
     << "| model | " << absl::StrJoin(o.policies, " | ") << " |\n|---|";
  for (size_t i = 0; i < o.policies.size(); ++i) md << "---:|";
  md << "\n";
  absl::Status error;
  std::map<std::string, std::map<std::string, int>> best;
  for (const std::string& model : o.models) {
    md << "| " << model;
    for (const std::string& policy : o.policies) {
      const auto start = Clock::now();
      const Search s = LargestBatch(model, policy, o.device, o.optimizer,
                                    o.allocator, o.host_bytes);
      if (!s.error.ok()) {
        error = s.error;
        md << " | error";
        continue;
      }
      best[model][policy] = s.batch;
      std::fprintf(stderr, "policy_bench: %s %s: max batch %d (%.1f s)\n",
                   model.c_str(), policy.c_str(), s.batch,
                   std::chrono::duration<double>(Clock::now() - start).count());
      md << " | " << s.batch << absl::StrFormat(" (%.2f)", s.slowdown);
    }
    md << " |\n";
  }
  if (best.count("resnet50") && best["resnet50"].count("delta") &&
      best["resnet50"].count("none")) {
    const int delta = best["resnet50"]["delta"];
    const int none = best["resnet50"]["none"];
    md << "\nTarget (ResNet-50): `delta` fits at least 2x the batch of "
          "`none`: "
       << delta << " vs " << none << " ("
       << absl::StrFormat("%.2fx", none > 0 ? double(delta) / none : 0.0)
       << "): **" << (delta >= 2 * none ? "met" : "MISSED") << "**\n";
  }
  md << "\n" << PaperSection(o, &error);
  std::printf("%s", md.str().c_str());
  int exit_code = 0;
  if (!error.ok()) {
    std::fprintf(stderr, "policy_bench: %s\n", error.ToString().c_str());
    exit_code = 1;
  }
  if (!o.update_doc.empty() &&
      !bench::UpdateDocSection(o.update_doc, "policy_bench_max_batch",
                               md.str())) {
    std::fprintf(stderr, "policy_bench: could not write %s\n",
                 o.update_doc.c_str());
    exit_code = 1;
  }
  return exit_code;
}

}  // namespace deltad::sim
