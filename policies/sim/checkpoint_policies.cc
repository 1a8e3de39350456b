#include "policies/sim/checkpoint_policies.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "policies/sim/program_analysis.h"

namespace deltad::sim {

namespace {

// chen-greedy evaluates Algorithm 3 at this many thresholds b spread evenly
// over (0, saved bytes], plus b = 0.
constexpr int kChenGreedyThresholds = 64;

struct CheckpointPlan {
  std::vector<int32_t> dropped;  // saved activations evicted after forward
};

// Drops every saved activation that is not a checkpoint, unless the engine
// could not rebuild it (then it stays, a checkpoint in effect).
CheckpointPlan MakeCheckpointPlan(const Program& program,
                                  const ProgramAnalysis& a,
                                  const std::vector<bool>& checkpoint) {
  CheckpointPlan plan;
  for (int32_t s : a.saved) {
    if (!checkpoint[s] && program.Recomputable(s)) plan.dropped.push_back(s);
  }
  return plan;
}

std::vector<bool> SqrtCheckpoints(const Program& program,
                                  const ProgramAnalysis& a) {
  std::vector<bool> checkpoint(program.storages.size(), false);
  const size_t n = a.saved.size();
  if (n == 0) return checkpoint;
  const auto k =
      static_cast<size_t>(std::ceil(std::sqrt(static_cast<double>(n)) - 1e-9));
  // The k-th, 2k-th, ... : the first segment is rebuilt from the inputs,
  // which stay on the device.
  for (size_t i = k - 1; i < n; i += k) checkpoint[a.saved[i]] = true;
  return checkpoint;
}

// Chen et al.'s Algorithm 3: accumulate output bytes in topological order and
// cut a stage where the running sum passes b. Activations that cannot be
// rebuilt stay on the device anyway, so they close a stage as well.
std::vector<bool> GreedyCheckpoints(const Program& program,
                                    const ProgramAnalysis& a, int64_t b) {
  std::vector<bool> checkpoint(program.storages.size(), false);
  int64_t temp = 0;
  for (int32_t s : a.saved) {
    temp += program.storages[s].bytes;
    if (temp > b || !program.Recomputable(s)) {
      checkpoint[s] = true;
      temp = 0;
    }
  }
  return checkpoint;
}

struct PlanWalk {
  int64_t peak_bytes = 0;
  int64_t recompute_ns = 0;
};

// Memory of a checkpoint plan step by step, as the engine would run it with
// nothing else released: dropped activations leave after their last forward
// use and come back on demand (with their dropped ancestors), staying until
// the trace frees them; dead storages rebuilt for a child go after the step.
PlanWalk WalkCheckpointPlan(const Program& program, const ProgramAnalysis& a,
                            const CheckpointPlan& plan) {
  enum : uint8_t { kAbsent, kIn, kDropped, kGone };
  const size_t n = program.storages.size();
  std::vector<uint8_t> state(n, kAbsent);
  std::vector<std::vector<int32_t>> drop_after(program.steps.size());
  for (int32_t s : plan.dropped) drop_after[a.last_forward_use[s]].push_back(s);
  PlanWalk walk;
  int64_t live = 0;
  for (size_t s = 0; s < n; ++s) {
    if (program.storages[s].constant) {
      state[s] = kIn;
      live += program.storages[s].bytes;
    }
  }
  for (int32_t s : program.initial_frees) {
    state[s] = kGone;
    live -= program.storages[s].bytes;
  }
  walk.peak_bytes = live;
  std::vector<int32_t> temporaries;
  // Recursion depth is bounded by the chain of dropped ancestors, as in the
  // engine's own Materialize.
  auto bring = [&](auto& self, int32_t s) -> void {
    const Storage& st = program.storages[s];
    if (state[s] == kIn || state[s] == kAbsent || st.producer < 0) return;
    const bool dead = state[s] == kGone;
    for (int32_t p : st.parents) self(self, p);
    const Step& producer = program.steps[st.producer];
    live += st.bytes;
    walk.peak_bytes =
        std::max(walk.peak_bytes, live + producer.workspace_bytes);
    walk.recompute_ns += producer.time_ns;
    state[s] = kIn;
    if (dead) temporaries.push_back(s);
  };
  for (size_t t = 0; t < program.steps.size(); ++t) {
    const Step& step = program.steps[t];
    temporaries.clear();
    for (int32_t s : step.reads) bring(bring, s);
    for (int32_t s : step.creates) {
      state[s] = kIn;
      live += program.storages[s].bytes;
      // An in-place result takes over the memory of the storage it
      // replaces when that one loses its last name here.
      for (const InPlace& ip : step.in_place) {
        if (ip.created == s && state[ip.old] == kIn &&
            std::find(step.frees.begin(), step.frees.end(), ip.old) !=
                step.frees.end()) {
          state[ip.old] = kGone;
          live -= program.storages[ip.old].bytes;
          break;
        }
      }
    }
    walk.peak_bytes = std::max(walk.peak_bytes, live + step.workspace_bytes);
    for (int32_t s : temporaries) {
      if (state[s] == kIn) {
        state[s] = kGone;
        live -= program.storages[s].bytes;
      }
    }
    for (int32_t s : step.frees) {
      if (state[s] == kIn) live -= program.storages[s].bytes;
      state[s] = kGone;
    }
    for (int32_t s : drop_after[t]) {
      if (state[s] == kIn) {
        state[s] = kDropped;
        live -= program.storages[s].bytes;
      }
    }
  }
  return walk;
}

// chen-greedy's threshold. Algorithm 3 trades the bytes kept at stage
// boundaries against the bytes of one stage rebuilt in backward, and the
// paper searches b for the plan that fits. Every dropped activation is
// rebuilt once, so the best plan is the one that recomputes least among
// those whose memory walk fits the budget; when none fits, the one with the
// smallest peak (it may still fit with the fallback evictions).
CheckpointPlan ChooseGreedyPlan(const Program& program,
                                const ProgramAnalysis& a, int64_t budget) {
  int64_t total = 0;
  for (int32_t s : a.saved) total += program.storages[s].bytes;
  CheckpointPlan best;
  PlanWalk best_walk;
  bool best_fits = false;
  bool have = false;
  std::vector<std::vector<int32_t>> seen;
  for (int j = 0; j <= kChenGreedyThresholds; ++j) {
    const int64_t b = total / kChenGreedyThresholds * j +
                      total % kChenGreedyThresholds * j / kChenGreedyThresholds;
    CheckpointPlan plan =
        MakeCheckpointPlan(program, a, GreedyCheckpoints(program, a, b));
    if (std::find(seen.begin(), seen.end(), plan.dropped) != seen.end()) {
      continue;
    }
    seen.push_back(plan.dropped);
    const PlanWalk walk = WalkCheckpointPlan(program, a, plan);
    const bool fits = walk.peak_bytes <= budget;
    bool better;
    if (!have) {
      better = true;
    } else if (fits != best_fits) {
      better = fits;
    } else if (fits) {
      better = walk.recompute_ns < best_walk.recompute_ns ||
               (walk.recompute_ns == best_walk.recompute_ns &&
                walk.peak_bytes < best_walk.peak_bytes);
    } else {
      better = walk.peak_bytes < best_walk.peak_bytes;
    }
    if (better) {
      best = std::move(plan);
      best_walk = walk;
      best_fits = fits;
      have = true;
    }
  }
  return best;
}

enum class CheckpointRule { kSqrt, kGreedy };

// Drops its non-checkpoint activations after their last forward use; the
// engine rebuilds them on demand from the nearest checkpoints. When memory
// still runs short it drops more non-checkpoints, and nothing else.
class StaticCheckpointPolicy final : public SimPolicy {
 public:
  StaticCheckpointPolicy(std::string name, CheckpointRule rule)
      : name_(std::move(name)), rule_(rule) {}

  std::string name() const override { return name_; }

  void BeginIteration(SimContext& ctx) override {
    const Program& program = ctx.program();
    analysis_ = AnalyzeProgram(program);
    const CheckpointPlan plan =
        rule_ == CheckpointRule::kSqrt
            ? MakeCheckpointPlan(program, analysis_,
                                 SqrtCheckpoints(program, analysis_))
            : ChooseGreedyPlan(program, analysis_, ctx.budget());
    pool_ = plan.dropped;
    drop_after_.assign(program.steps.size(), {});
    for (int32_t s : plan.dropped) {
      drop_after_[analysis_.last_forward_use[s]].push_back(s);
    }
  }

  void AfterStep(SimContext& ctx, int32_t step) override {
    for (int32_t s : drop_after_[step]) ctx.Evict(s);
  }

  bool MakeRoom(SimContext& ctx, int64_t bytes) override {
    const int32_t now = ctx.step();
    std::vector<std::pair<int32_t, int32_t>> candidates;  // (-next use, s)
    for (int32_t s : pool_) {
      if (!ctx.CanEvict(s)) continue;
      const int32_t next = analysis_.NextUse(s, now);
      if (next == now) continue;  // the op about to run reads it
      candidates.emplace_back(-next, s);
    }
    std::sort(candidates.begin(), candidates.end());
    int64_t freed = 0;
    bool any = false;
    for (const auto& [key, s] : candidates) {
      if (freed >= bytes) break;
      if (ctx.Evict(s)) {
        freed += ctx.program().storages[s].bytes;
        any = true;
      }
    }
    return any;
  }

  Restore ChooseRestore(SimContext& /*ctx*/, int32_t /*s*/,
                        int64_t /*reload_ns*/) override {
    return Restore::kRecompute;  // it never offloads; nothing to reload
  }

 private:
  std::string name_;
  CheckpointRule rule_;
  ProgramAnalysis analysis_;
  std::vector<int32_t> pool_;  // non-checkpoints
  std::vector<std::vector<int32_t>> drop_after_;
};

}  // namespace

std::unique_ptr<SimPolicy> MakeCheckpointPolicy(absl::string_view name) {
  if (name == "chen-sqrt") {
    return std::make_unique<StaticCheckpointPolicy>(std::string(name),
                                                    CheckpointRule::kSqrt);
  }
  if (name == "chen-greedy") {
    return std::make_unique<StaticCheckpointPolicy>(std::string(name),
                                                    CheckpointRule::kGreedy);
  }
  return nullptr;
}

std::vector<int32_t> ChenSqrtCheckpoints(const Program& program) {
  const ProgramAnalysis a = AnalyzeProgram(program);
  const std::vector<bool> checkpoint = SqrtCheckpoints(program, a);
  std::vector<int32_t> out;
  for (int32_t s : a.saved) {
    if (checkpoint[s]) out.push_back(s);
  }
  return out;
}

}  // namespace deltad::sim
