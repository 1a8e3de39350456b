#include "policies/sim/static_policies.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/epoch_marks.h"

namespace deltad::sim {

namespace {

constexpr int32_t kNever = std::numeric_limits<int32_t>::max();

// vDNN prefetches the input of the layer whose backward runs next while the
// current layer's backward runs: one layer ahead, which in a trace is about
// two ops (a convolution's backward and its elementwise companion).
constexpr int32_t kVdnnPrefetchSteps = 2;
// TFLMS swaps a tensor in `lb` ops before its consumer; its default lb is 1.
constexpr int32_t kLmsSwapInSteps = 1;
// The window paper leaves schedule-window a hyperparameter. Half the budget
// looks far enough ahead to hide copies behind several ops while leaving the
// other half to what the ops themselves allocate.
constexpr double kWindowFraction = 0.5;
// chen-greedy evaluates Algorithm 3 at this many thresholds b spread evenly
// over (0, saved bytes], plus b = 0.
constexpr int kChenGreedyThresholds = 64;

// What every static plan needs to know about the program.
struct Analysis {
  std::vector<std::vector<int32_t>> reads;  // steps reading each storage
  // Last forward step that creates or reads it; -1 unless the forward pass
  // created it.
  std::vector<int32_t> last_forward_use;
  std::vector<int32_t> saved;  // SavedActivations(), in creation order
  // Bytes read or created by the steps before j: the window paper's
  // variable sequence measured in bytes.
  std::vector<int64_t> access_prefix;

  int32_t NextUse(int32_t s, int32_t from) const {
    const std::vector<int32_t>& r = reads[s];
    auto it = std::lower_bound(r.begin(), r.end(), from);
    return it == r.end() ? kNever : *it;
  }
};

Analysis Analyze(const Program& program) {
  Analysis a;
  const size_t n = program.storages.size();
  const auto steps = static_cast<int32_t>(program.steps.size());
  a.reads.resize(n);
  a.last_forward_use.assign(n, -1);
  a.access_prefix.assign(program.steps.size() + 1, 0);
  for (int32_t t = 0; t < steps; ++t) {
    const Step& step = program.steps[t];
    const bool forward = step.phase == Phase::kForward;
    int64_t bytes = 0;
    for (int32_t s : step.reads) {
      a.reads[s].push_back(t);
      bytes += program.storages[s].bytes;
      if (forward && a.last_forward_use[s] >= 0) a.last_forward_use[s] = t;
    }
    for (int32_t s : step.creates) {
      bytes += program.storages[s].bytes;
      if (forward) a.last_forward_use[s] = t;
    }
    a.access_prefix[t + 1] = a.access_prefix[t] + bytes;
  }
  // Storage indices follow creation order.
  for (size_t s = 0; s < n; ++s) {
    const int32_t last_forward = a.last_forward_use[s];
    if (last_forward < 0) continue;
    for (int32_t t : a.reads[s]) {
      if (t > last_forward && program.steps[t].phase == Phase::kBackward) {
        a.saved.push_back(static_cast<int32_t>(s));
        break;
      }
    }
  }
  return a;
}

bool OnDevice(StorageState state) {
  return state == StorageState::kResident ||
         state == StorageState::kOffloading ||
         state == StorageState::kReloading;
}

// Whether the steps after `t` up to `until` find `room` bytes beyond what is
// in use now enough for themselves if nothing else is released: at no step
// do their new storages, workspace, and the reads that are not on or coming
// to the device (`except` aside), less what they free, need more. A
// prefetch holds its memory from now until its use, so it may start only if
// this still fits beside it: the ops come first, as in the frameworks these
// baselines come from. Unchecked, a prefetch still in flight (which nothing
// can release) could leave an op no room at all. The walk stops at the
// first step that does not fit.
bool StepsFit(const SimContext& ctx, int32_t t, int32_t until, int32_t except,
              int64_t room, policy::EpochMarks& added) {
  const Program& program = ctx.program();
  added.Clear(program.storages.size());  // brought in by the walk
  int64_t running = 0;
  std::vector<int32_t> taken_over;
  for (int32_t j = t + 1; j <= until; ++j) {
    const Step& step = program.steps[j];
    auto in_memory = [&](int32_t s) {
      return OnDevice(ctx.state(s)) || added.contains(s);
    };
    auto frees = [&](int32_t s) {
      return std::find(step.frees.begin(), step.frees.end(), s) !=
             step.frees.end();
    };
    int64_t add = 0;
    for (int32_t s : step.reads) {
      if (s != except && !in_memory(s) && added.insert(s)) {
        add += program.storages[s].bytes;
      }
    }
    taken_over.clear();
    for (int32_t s : step.creates) {
      added.insert(s);
      bool reuses = false;
      for (const InPlace& ip : step.in_place) {
        if (ip.created == s && frees(ip.old) && in_memory(ip.old)) {
          taken_over.push_back(ip.old);
          reuses = true;
        }
      }
      if (!reuses) add += program.storages[s].bytes;
    }
    if (running + add + step.workspace_bytes > room) return false;
    running += add;
    for (int32_t s : step.frees) {
      if (in_memory(s) && std::find(taken_over.begin(), taken_over.end(), s) ==
                              taken_over.end()) {
        running -= program.storages[s].bytes;
      }
      added.erase(s);
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// Swap baselines.

enum class Selection {
  kConvInputs,    // vDNN: inputs of forward convolutions
  kAll,           // LMS, window: every saved activation
  kGreedyPrefix,  // GREEDY: the first k saved activations
};

enum class Prefetching {
  kDistance,  // a fixed number of steps before the next use
  kWindow,    // while the bytes accessed until the next use fit a window
  kEarliest,  // in order of next use, as soon as memory permits
};

struct SwapOptions {
  std::string name;
  Selection selection = Selection::kAll;
  Prefetching prefetching = Prefetching::kDistance;
  int32_t distance_steps = 1;    // kDistance
  double window_fraction = 0.5;  // kWindow, of the budget
};

// Offloads its plan's activations after their last forward use and brings
// them back ahead of their backward use. When memory still runs short it
// offloads more of its own candidates, and nothing else.
class StaticSwapPolicy final : public SimPolicy {
 public:
  explicit StaticSwapPolicy(SwapOptions options)
      : options_(std::move(options)) {}

  std::string name() const override { return options_.name; }

  void BeginIteration(SimContext& ctx) override {
    const Program& program = ctx.program();
    analysis_ = Analyze(program);
    bytes_of_.clear();
    for (const Storage& st : program.storages) bytes_of_.push_back(st.bytes);
    pool_.clear();
    // The engine resets every activation as an iteration begins: none is
    // offloaded.
    offloaded_.clear();
    offloaded_at_.assign(program.storages.size(), -1);
    offload_after_.assign(program.steps.size(), {});
    std::vector<int32_t> planned;
    switch (options_.selection) {
      case Selection::kConvInputs: {
        std::vector<bool> conv_input(program.storages.size(), false);
        for (const Step& step : program.steps) {
          if (!step.conv || step.phase != Phase::kForward) continue;
          for (int32_t s : step.reads) conv_input[s] = true;
        }
        for (int32_t s : analysis_.saved) {
          if (conv_input[s]) pool_.push_back(s);
        }
        planned = pool_;
        break;
      }
      case Selection::kAll:
        pool_ = analysis_.saved;
        planned = pool_;
        break;
      case Selection::kGreedyPrefix:
        // Beyond the first k, the later activations extend the eager
        // prefix when memory still runs short.
        pool_ = analysis_.saved;
        planned = OffloadGreedyPrefix(program, ctx.budget());
        break;
    }
    // Each copy out starts once the forward pass is done with its tensor.
    // Earlier is not possible here: the engine cancels a copy out when its
    // tensor is read (for GREEDY's chains, one step after production).
    for (int32_t s : planned) {
      offload_after_[analysis_.last_forward_use[s]].push_back(s);
    }
    window_bytes_ = static_cast<int64_t>(options_.window_fraction *
                                         static_cast<double>(ctx.budget()));
    in_pool_.assign(program.storages.size(), false);
    for (int32_t s : pool_) in_pool_[s] = true;
  }

  // The pool's offloaded storages, kept as they change: scanning the whole
  // pool after every step cost a swap baseline most of its run time.
  void OnStateChange(SimContext& /*ctx*/, int32_t s, StorageState from,
                     StorageState to) override {
    if (static_cast<size_t>(s) >= in_pool_.size() || !in_pool_[s]) return;
    if (to == StorageState::kOffloaded) {
      offloaded_at_[s] = static_cast<int32_t>(offloaded_.size());
      offloaded_.push_back(s);
    } else if (from == StorageState::kOffloaded) {
      const int32_t i = offloaded_at_[s];
      offloaded_[i] = offloaded_.back();
      offloaded_at_[offloaded_[i]] = i;
      offloaded_.pop_back();
      offloaded_at_[s] = -1;
    }
  }

  void AfterStep(SimContext& ctx, int32_t step) override {
    for (int32_t s : offload_after_[step]) {
      // A copy out is cancelled when its tensor is read, so offloading one
      // that the prefetch rule would bring straight back only costs link
      // time (the window paper's Fig. 2(d) skips these too). GREEDY's plan
      // is fixed: it offloads its k whatever their distance.
      if (options_.selection == Selection::kGreedyPrefix ||
          !WouldPrefetch(s, step)) {
        ctx.Offload(s);
      }
    }
    PrefetchAhead(ctx, step);
  }

  bool MakeRoom(SimContext& ctx, int64_t bytes) override {
    const int32_t now = ctx.step();
    std::vector<std::pair<int32_t, int32_t>> candidates;  // (order key, s)
    for (size_t i = 0; i < pool_.size(); ++i) {
      const int32_t s = pool_[i];
      if (ctx.state(s) != StorageState::kResident || ctx.locked(s)) continue;
      const int32_t next = analysis_.NextUse(s, now);
      if (next == now) continue;  // the op about to run reads it
      // GREEDY extends its eager prefix in creation order; the others give
      // up first what is needed last.
      const int32_t key = options_.selection == Selection::kGreedyPrefix
                              ? static_cast<int32_t>(i)
                              : -next;
      candidates.emplace_back(key, s);
    }
    std::sort(candidates.begin(), candidates.end());
    int64_t freed = 0;
    bool any = false;
    for (const auto& [key, s] : candidates) {
      if (freed >= bytes) break;
      if (ctx.Offload(s)) {
        freed += ctx.program().storages[s].bytes;
        any = true;
      }
    }
    return any;
  }

  Restore ChooseRestore(SimContext& /*ctx*/, int32_t /*s*/) override {
    return Restore::kReload;
  }

 private:
  // Whether, after step `t`, the prefetch rule would fetch `s` for its next
  // use.
  bool WouldPrefetch(int32_t s, int32_t t) const {
    const int32_t next = t + 1;
    const int32_t use = analysis_.NextUse(s, next);
    if (use == kNever) return false;
    switch (options_.prefetching) {
      case Prefetching::kDistance:
        return use - next <= options_.distance_steps;
      case Prefetching::kWindow:
        return analysis_.access_prefix[use] - analysis_.access_prefix[next] +
                   bytes_of_[s] <=
               window_bytes_;
      case Prefetching::kEarliest:
        return true;
    }
    return false;
  }

  void PrefetchAhead(SimContext& ctx, int32_t t) {
    const Program& program = ctx.program();
    const int32_t next = t + 1;
    if (next >= static_cast<int32_t>(program.steps.size())) return;
    // GREEDY prefetches in backward only: in forward its activations have
    // just been sent out to make room for the peak.
    if (options_.prefetching == Prefetching::kEarliest &&
        program.steps[next].phase != Phase::kBackward) {
      return;
    }
    std::vector<std::pair<int32_t, int32_t>> due;  // (next use, s)
    for (int32_t s : offloaded_) {
      if (!WouldPrefetch(s, t)) continue;
      due.emplace_back(analysis_.NextUse(s, next), s);
    }
    std::sort(due.begin(), due.end());
    // In order of use: a later tensor never takes the memory an earlier one
    // is waiting for.
    for (const auto& [use, s] : due) {
      const int64_t room = ctx.budget() - ctx.device_used() - bytes_of_[s];
      if (room < 0 || !StepsFit(ctx, t, use, /*except=*/s, room, marks_) ||
          !ctx.Prefetch(s)) {
        break;
      }
    }
  }

  SwapOptions options_;
  Analysis analysis_;
  std::vector<int32_t> pool_;          // candidates, creation order
  std::vector<bool> in_pool_;          // by storage
  std::vector<int32_t> offloaded_;     // of the pool, in no order
  std::vector<int32_t> offloaded_at_;  // by storage: index there, or -1
  std::vector<std::vector<int32_t>> offload_after_;  // per step
  std::vector<int64_t> bytes_of_;
  int64_t window_bytes_ = 0;
  policy::EpochMarks marks_;  // StepsFit's
};

// ---------------------------------------------------------------------------
// Checkpointing baselines.

struct CheckpointPlan {
  std::vector<int32_t> dropped;  // saved activations evicted after forward
};

// Drops every saved activation that is not a checkpoint, unless the engine
// could not rebuild it (then it stays, a checkpoint in effect).
CheckpointPlan MakeCheckpointPlan(const Program& program, const Analysis& a,
                                  const std::vector<bool>& checkpoint) {
  CheckpointPlan plan;
  for (int32_t s : a.saved) {
    if (!checkpoint[s] && program.Recomputable(s)) plan.dropped.push_back(s);
  }
  return plan;
}

std::vector<bool> SqrtCheckpoints(const Program& program, const Analysis& a) {
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
std::vector<bool> GreedyCheckpoints(const Program& program, const Analysis& a,
                                    int64_t b) {
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
PlanWalk WalkCheckpointPlan(const Program& program, const Analysis& a,
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
CheckpointPlan ChooseGreedyPlan(const Program& program, const Analysis& a,
                                int64_t budget) {
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
    analysis_ = Analyze(program);
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

  Restore ChooseRestore(SimContext& /*ctx*/, int32_t /*s*/) override {
    return Restore::kRecompute;  // it never offloads; nothing to reload
  }

 private:
  std::string name_;
  CheckpointRule rule_;
  Analysis analysis_;
  std::vector<int32_t> pool_;  // non-checkpoints
  std::vector<std::vector<int32_t>> drop_after_;
};

int64_t CeilNs(double bytes, double bytes_per_s) {
  return static_cast<int64_t>(std::ceil(1e9 * bytes / bytes_per_s));
}

}  // namespace

std::vector<std::string> StaticPolicyNames() {
  return {"vdnn",      "lms",         "window",
          "chen-sqrt", "chen-greedy", "offload-greedy"};
}

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeStaticPolicy(
    absl::string_view name) {
  SwapOptions swap;
  swap.name = std::string(name);
  if (name == "vdnn") {
    swap.selection = Selection::kConvInputs;
    swap.prefetching = Prefetching::kDistance;
    swap.distance_steps = kVdnnPrefetchSteps;
    return std::make_unique<StaticSwapPolicy>(std::move(swap));
  }
  if (name == "lms") {
    swap.selection = Selection::kAll;
    swap.prefetching = Prefetching::kDistance;
    swap.distance_steps = kLmsSwapInSteps;
    return std::make_unique<StaticSwapPolicy>(std::move(swap));
  }
  if (name == "window") {
    swap.selection = Selection::kAll;
    swap.prefetching = Prefetching::kWindow;
    swap.window_fraction = kWindowFraction;
    return std::make_unique<StaticSwapPolicy>(std::move(swap));
  }
  if (name == "offload-greedy") {
    swap.selection = Selection::kGreedyPrefix;
    swap.prefetching = Prefetching::kEarliest;
    return std::make_unique<StaticSwapPolicy>(std::move(swap));
  }
  if (name == "chen-sqrt") {
    return std::make_unique<StaticCheckpointPolicy>(std::string(name),
                                                    CheckpointRule::kSqrt);
  }
  if (name == "chen-greedy") {
    return std::make_unique<StaticCheckpointPolicy>(std::string(name),
                                                    CheckpointRule::kGreedy);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown static policy '", name, "'; expected one of ",
                   absl::StrJoin(StaticPolicyNames(), ", ")));
}

LowerBounds ComputeLowerBounds(const Program& program,
                               const DeviceProfile& device,
                               int64_t budget_bytes) {
  LowerBounds lb;
  lb.compute_ns = program.compute_ns;
  lb.swap_only_ns = program.compute_ns;
  const int64_t excess =
      std::max<int64_t>(0, program.peak_bytes - budget_bytes);
  if (excess == 0) return lb;
  if (device.d2h_bytes_per_s <= 0 || device.h2d_bytes_per_s <= 0) {
    // Nothing can leave the device: no swap-only schedule fits.
    lb.swap_only_ns = std::numeric_limits<int64_t>::max();
    return lb;
  }
  // The excess must be copied out before the peak step and back after it,
  // once each way. With the paper's single link of bandwidth beta that is
  // 2 * excess / beta. The two directions are separate engines here, so
  // each is charged at its own rate: this equals the paper's bound when
  // they match, and stays a lower bound when they differ (charging both at
  // the slower rate would not be).
  const auto bytes = static_cast<double>(excess);
  const int64_t copy_ns = CeilNs(bytes, device.d2h_bytes_per_s) +
                          CeilNs(bytes, device.h2d_bytes_per_s);
  lb.swap_only_ns = std::max(lb.compute_ns, copy_ns);
  return lb;
}

std::vector<int32_t> SavedActivations(const Program& program) {
  return Analyze(program).saved;
}

std::vector<int32_t> ChenSqrtCheckpoints(const Program& program) {
  const Analysis a = Analyze(program);
  const std::vector<bool> checkpoint = SqrtCheckpoints(program, a);
  std::vector<int32_t> out;
  for (int32_t s : a.saved) {
    if (checkpoint[s]) out.push_back(s);
  }
  return out;
}

std::vector<int32_t> OffloadGreedyPrefix(const Program& program,
                                         int64_t budget_bytes) {
  const int64_t need = program.peak_bytes - budget_bytes;
  std::vector<int32_t> prefix;
  if (need <= 0) return prefix;
  int64_t sum = 0;
  for (int32_t s : SavedActivations(program)) {
    prefix.push_back(s);
    sum += program.storages[s].bytes;
    if (sum >= need) break;
  }
  return prefix;
}

}  // namespace deltad::sim
