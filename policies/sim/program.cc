#include "policies/sim/program.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace deltad::sim {

absl::StatusOr<Program> Compile(const Trace& trace) {
  if (absl::Status s = trace.Validate(); !s.ok()) return s;
  using Kind = TraceValue::Kind;
  Program p;
  p.name = trace.name;
  std::vector<int32_t> storage_of(trace.values.size(), -1);
  std::vector<int32_t> names;  // live values per storage
  auto new_storage = [&](const TraceValue& v, int32_t producer) {
    Storage s;
    s.bytes = v.bytes;
    s.constant = v.kind == Kind::kConstant;
    s.producer = producer;
    s.name = v.name;
    p.storages.push_back(std::move(s));
    names.push_back(1);
    return static_cast<int32_t>(p.storages.size() - 1);
  };
  // The constant each value views or updates, if any; and each constant's
  // latest version.
  std::vector<int32_t> constant_of(trace.values.size(), -1);
  std::vector<int32_t> latest;
  for (size_t v = 0; v < trace.values.size(); ++v) {
    if (trace.values[v].kind == Kind::kConstant) {
      storage_of[v] = new_storage(trace.values[v], -1);
      p.constant_bytes += trace.values[v].bytes;
      constant_of[v] = storage_of[v];
    }
  }
  latest.resize(p.storages.size());
  std::iota(latest.begin(), latest.end(), 0);
  auto release = [&](int32_t value, std::vector<int32_t>& frees) {
    const int32_t s = storage_of[value];
    if (--names[s] == 0) frees.push_back(s);
  };
  for (int32_t v : trace.initial_releases) release(v, p.initial_frees);

  int64_t live = p.constant_bytes;
  for (int32_t s : p.initial_frees) live -= p.storages[s].bytes;
  p.peak_bytes = live;
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    const TraceOp& op = trace.ops[i];
    Step step;
    step.op = static_cast<int32_t>(i);
    step.phase = op.phase;
    step.time_ns = op.time_ns;
    step.workspace_bytes = op.workspace_bytes;
    step.conv = absl::StrContains(op.name, "conv") &&
                !absl::StrContains(op.name, "backward");
    absl::flat_hash_set<int32_t> seen;
    for (int32_t v : op.inputs) {
      if (seen.insert(storage_of[v]).second)
        step.reads.push_back(storage_of[v]);
    }
    const auto step_index = static_cast<int32_t>(p.steps.size());
    for (int32_t v : op.outputs) {
      const TraceValue& val = trace.values[v];
      if (val.kind == Kind::kAlias) {
        storage_of[v] = storage_of[val.base];
        ++names[storage_of[v]];
        constant_of[v] = constant_of[val.base];
        continue;
      }
      // An output, or an in-place update: a new immutable storage.
      storage_of[v] = new_storage(val, step_index);
      step.creates.push_back(storage_of[v]);
      if (val.kind == Kind::kVersion) {
        constant_of[v] = constant_of[val.base];
        if (constant_of[v] >= 0) latest[constant_of[v]] = storage_of[v];
        const int32_t old = storage_of[val.base];
        if (seen.insert(old).second) step.reads.push_back(old);
        step.in_place.push_back({storage_of[v], old});
        // The name moves to the new storage.
        release(val.base, step.frees);
      }
    }
    for (int32_t s : step.creates) p.storages[s].parents = step.reads;
    for (int32_t v : op.releases) release(v, step.frees);

    // An in-place result whose old storage loses its last name here reuses
    // that memory: it needs no bytes of its own.
    absl::flat_hash_set<int32_t> reused;
    for (const InPlace& ip : step.in_place) {
      if (std::find(step.frees.begin(), step.frees.end(), ip.old) !=
          step.frees.end()) {
        reused.insert(ip.created);
      }
    }
    int64_t need = step.workspace_bytes;
    for (int32_t s : step.reads) need += p.storages[s].bytes;
    for (int32_t s : step.creates) {
      if (!reused.contains(s)) need += p.storages[s].bytes;
    }
    step.need_bytes = need;
    if (need > p.min_budget_bytes) {
      p.min_budget_bytes = need;
      p.min_budget_step = step_index;
    }
    for (int32_t s : step.creates) {
      if (!reused.contains(s)) live += p.storages[s].bytes;
    }
    step.live_bytes = live + step.workspace_bytes;
    p.peak_bytes = std::max(p.peak_bytes, step.live_bytes);
    for (int32_t s : step.frees) live -= p.storages[s].bytes;
    for (int32_t s : reused) live += p.storages[s].bytes;
    p.compute_ns += step.time_ns;
    p.steps.push_back(std::move(step));
  }
  for (const Step& step : p.steps) {
    for (int32_t s : step.frees) {
      p.storages[s].freed_at = static_cast<int32_t>(&step - p.steps.data());
    }
  }
  // A constant whose name moved to a version that lives to the end starts
  // the next iteration as that version.
  for (size_t c = 0; c < latest.size(); ++c) {
    const int32_t last = latest[c];
    if (last != static_cast<int32_t>(c) && p.storages[c].freed_at >= 0 &&
        p.storages[last].freed_at < 0) {
      p.carries.push_back({last, static_cast<int32_t>(c)});
    }
  }
  // A storage can be rebuilt at any time of its life when every parent can
  // be had until its end: resident, restorable, or rebuilt in turn. So each
  // storage is available until a step: the end of its life, or later while
  // its parents are (rebuilt for a child when dead); constants and storages
  // never freed, always. Parents come before children: one pass decides.
  // (Taking a recomputable parent as available forever marked gradients
  // made in backward recomputable through activations long freed, and a
  // policy that evicted one failed: "cannot rebuild".)
  constexpr int32_t kForever = std::numeric_limits<int32_t>::max();
  std::vector<int32_t> until(p.storages.size(), kForever);
  for (int32_t s = 0; s < static_cast<int32_t>(p.storages.size()); ++s) {
    Storage& st = p.storages[s];
    const int32_t lives_until = st.freed_at < 0 ? kForever : st.freed_at;
    int32_t parents_until = kForever;
    for (int32_t parent : st.parents) {
      parents_until = std::min(parents_until, until[parent]);
    }
    st.recomputable = st.producer >= 0 && parents_until >= lives_until;
    until[s] =
        st.producer >= 0 ? std::max(lives_until, parents_until) : lives_until;
  }
  return p;
}

}  // namespace deltad::sim
