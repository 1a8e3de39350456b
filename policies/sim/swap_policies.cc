#include "policies/sim/swap_policies.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "policies/epoch_marks.h"
#include "policies/sim/program_analysis.h"

namespace deltad::sim {

namespace {

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
    analysis_ = AnalyzeProgram(program);
    bytes_of_.clear();
    for (const Storage& st : program.storages) bytes_of_.push_back(st.bytes);
    pool_.clear();
    // The engine resets every activation as an iteration begins: none is
    // offloaded.
    offloaded_.clear();
    offloaded_use_.assign(program.storages.size(), kNotListed);
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

  // The pool's offloaded storages in order of their next use, kept as they
  // change: scanning and sorting them all after every step cost a swap
  // baseline most of its run time. An offloaded storage keeps its next use
  // until it leaves the set: a read reloads it first. One never read again
  // is never due, and not listed.
  void OnStateChange(SimContext& ctx, int32_t s, StorageState from,
                     StorageState to) override {
    if (static_cast<size_t>(s) >= in_pool_.size() || !in_pool_[s]) return;
    if (to == StorageState::kOffloaded) {
      const int32_t use = analysis_.NextUse(s, ctx.step());
      if (use == ProgramAnalysis::kNever) return;
      offloaded_use_[s] = use;
      offloaded_.emplace(use, s);
    } else if (from == StorageState::kOffloaded &&
               offloaded_use_[s] != kNotListed) {
      offloaded_.erase({offloaded_use_[s], s});
      offloaded_use_[s] = kNotListed;
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

  Restore ChooseRestore(SimContext& /*ctx*/, int32_t /*s*/,
                        int64_t /*reload_ns*/) override {
    return Restore::kReload;
  }

 private:
  // Whether, after step `t`, the prefetch rule would fetch `s` for its next
  // use.
  bool WouldPrefetch(int32_t s, int32_t t) const {
    const int32_t next = t + 1;
    const int32_t use = analysis_.NextUse(s, next);
    if (use == ProgramAnalysis::kNever || PastReach(use, next)) return false;
    // The window holds the storage's own bytes too.
    return options_.prefetching != Prefetching::kWindow ||
           analysis_.access_prefix[use] - analysis_.access_prefix[next] +
                   bytes_of_[s] <=
               window_bytes_;
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
    // In order of use: a later tensor never takes the memory an earlier one
    // is waiting for. A prefetch leaves the set (the copy changes the
    // storage's state): the next one is found past it.
    auto it = offloaded_.begin();
    while (it != offloaded_.end()) {
      const auto [use, s] = *it;
      ++it;
      if (!WouldPrefetch(s, t)) {
        // Past the distance or the window, so is every later use.
        if (PastReach(use, next)) break;
        continue;
      }
      const int64_t room = ctx.budget() - ctx.device_used() - bytes_of_[s];
      if (room < 0 || !StepsFit(ctx, t, use, /*except=*/s, room, marks_) ||
          !ctx.Prefetch(s)) {
        break;
      }
    }
  }

  // Whether no storage used at `use` or later is prefetched before step
  // `next`: past the distance, or the window without the storage's own
  // bytes (which only add).
  bool PastReach(int32_t use, int32_t next) const {
    switch (options_.prefetching) {
      case Prefetching::kDistance:
        return use - next > options_.distance_steps;
      case Prefetching::kWindow:
        return analysis_.access_prefix[use] - analysis_.access_prefix[next] >
               window_bytes_;
      case Prefetching::kEarliest:
        return false;
    }
    return false;
  }

  static constexpr int32_t kNotListed = -1;

  SwapOptions options_;
  ProgramAnalysis analysis_;
  std::vector<int32_t> pool_;  // candidates, creation order
  std::vector<bool> in_pool_;  // by storage
  // Of the pool, those offloaded that will be read again: (next use, s).
  std::set<std::pair<int32_t, int32_t>> offloaded_;
  std::vector<int32_t> offloaded_use_;  // by storage: its key there, or -1
  std::vector<std::vector<int32_t>> offload_after_;  // per step
  std::vector<int64_t> bytes_of_;
  int64_t window_bytes_ = 0;
  policy::EpochMarks marks_;  // StepsFit's
};

}  // namespace

std::unique_ptr<SimPolicy> MakeSwapPolicy(absl::string_view name) {
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
  return nullptr;
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
