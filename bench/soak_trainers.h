#ifndef DELTAD_BENCH_SOAK_TRAINERS_H_
#define DELTAD_BENCH_SOAK_TRAINERS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace deltad::bench {

// soak's deltad-trainer processes: the jobs it runs, the models they train
// and how their runs ended.

enum class Kind { kRegular, kStormKilled, kStormExits };

struct Job {
  pid_t pid = -1;
  Kind kind = Kind::kRegular;
  int slot = -1;  // regular: which of --processes it replaces
  int gpu = 0;
  std::string label;
  std::string output;
  bool killed = false;  // SIGKILL sent on purpose
};

// Regular models, cycled over the slots of a GPU: a CNN, an encoder-decoder,
// a transformer and a dense net, as the demo mixes them; budgets from 60% to
// 80% of the model's peak so every process must release. Each declares the
// floor it needs to make progress (--min_budget, a fraction of its budget),
// as a job that must not die declares it: no admission cuts it below that.
// The floors are those below which runs without them failed (ResNet-50 at
// 4.9-5.4 MiB, U-Net at 5.0-6.8 MiB, GPT at 12-15 MiB of its 17.9 MiB
// peak), with the chunks' rounding on top; on a GPU they leave about a
// quarter of the budget to newcomers.
struct Model {
  std::vector<std::string> flags;
};
const std::vector<Model>& Models();

struct Outcome {
  int64_t started[3] = {};
  int64_t ok = 0;
  int64_t killed = 0;
  int64_t failed = 0;
  int64_t verified = 0;
  int64_t bad = 0;
  int64_t in_process = 0;  // never got a daemon session
  // Storm newcomers the daemon would not admit (that would have cut a
  // running job below its floor) within their wait: they fail closed.
  int64_t refused = 0;
  int64_t reconnected = 0;  // lost the daemon on the way
  // Runs that allocated past their budget in chunks they held, everything
  // else in use by running ops, and the allocations.
  int64_t past_budget_runs = 0;
  int64_t past_budget_allocations = 0;
  std::vector<std::string> failures;
  // Failed runs by the cause their trainer printed.
  std::map<std::string, int64_t> causes;
};

// Reads a finished trainer's summary into `outcome`.
void Account(const Job& job, int status, Outcome& outcome);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_SOAK_TRAINERS_H_
