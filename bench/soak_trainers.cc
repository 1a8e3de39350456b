#include "bench/soak_trainers.h"

#include <sys/wait.h>

#include <cinttypes>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/soak_process.h"

namespace deltad::bench {
namespace {

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

}  // namespace

const std::vector<Model>& Models() {
  static const auto* models = new std::vector<Model>{
      {{"--model=resnet50", "--batch=16", "--budget=0.6", "--min_budget=0.6"}},
      {{"--model=unet", "--batch=4", "--budget=0.7", "--min_budget=0.7"}},
      // Many small tensors: it loads the daemon with events. (It asked
      // for 130% at triple weight until 2026-11-28, when its optimizer
      // step was one op that pinned nearly its whole peak.)
      {{"--model=gpt", "--batch=2", "--gpt_layers=6", "--gpt_seq=256",
        "--budget=0.8", "--min_budget=0.7"}},
      {{"--model=densenet121", "--batch=8", "--budget=0.8",
        "--min_budget=0.6"}},
  };
  return *models;
}

void Account(const Job& job, int status, Outcome& outcome) {
  const std::string out = ReadFile(job.output);
  if (job.killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
    ++outcome.killed;
    std::filesystem::remove(job.output);
    return;
  }
  if (out.find("in-process policy") != std::string::npos) ++outcome.in_process;
  if (out.find("(reconnected)") != std::string::npos) ++outcome.reconnected;
  if (const size_t at = out.find(" allocations past the budget in chunks");
      at != std::string::npos) {
    const size_t open = out.rfind('(', at);
    int64_t n = 0;
    if (open != std::string::npos &&
        std::sscanf(out.c_str() + open + 1, "%" SCNd64, &n) == 1) {
      ++outcome.past_budget_runs;
      outcome.past_budget_allocations += n;
    }
  }
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

}  // namespace deltad::bench
