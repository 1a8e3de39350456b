#ifndef DELTAD_TESTS_UNIT_SIM_MODEL_TRACES_TEST_HELPERS_H_
#define DELTAD_TESTS_UNIT_SIM_MODEL_TRACES_TEST_HELPERS_H_

// What the model_traces_*_test.cc files share: building a model's trace and
// walking what it holds.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"
#include "policies/sim/trace.h"

namespace deltad::sim {

inline DeviceProfile A100() {
  absl::StatusOr<DeviceProfile> p = FindDeviceProfile("a100-80gb");
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

inline Trace Build(const std::string& model, ModelOptions options,
                   const DeviceProfile& device = A100()) {
  absl::StatusOr<Trace> trace = BuildModelTrace(model, options, device);
  EXPECT_TRUE(trace.ok()) << model << ": " << trace.status();
  return trace.ok() ? *std::move(trace) : Trace{};
}

inline Trace Build(const std::string& model, int batch,
                   DType dtype = DType::kFp32) {
  ModelOptions options;
  options.batch = batch;
  options.dtype = dtype;
  return Build(model, options);
}

// The value that `name` last referred to (versions repeat the name).
inline const TraceValue* Find(const Trace& trace, const std::string& name) {
  for (auto it = trace.values.rbegin(); it != trace.values.rend(); ++it) {
    if (it->name == name) return &*it;
  }
  return nullptr;
}

inline int64_t BytesOf(const Trace& trace, const std::string& name) {
  const TraceValue* v = Find(trace, name);
  EXPECT_NE(v, nullptr) << "no value named '" << name << "' in " << trace.name;
  return v == nullptr ? -1 : v->bytes;
}

inline bool IsParameter(const TraceValue& v) {
  return v.kind == TraceValue::Kind::kConstant &&
         (absl::EndsWith(v.name, ".weight") || absl::EndsWith(v.name, ".bias"));
}

inline bool IsStateConstant(const TraceValue& v) {
  return v.kind == TraceValue::Kind::kConstant &&
         (IsParameter(v) || absl::EndsWith(v.name, ".grad") ||
          absl::EndsWith(v.name, ".running_mean") ||
          absl::EndsWith(v.name, ".running_var"));
}

struct Peak {
  int64_t all = 0;          // constants included
  int64_t activations = 0;  // what the iteration creates, with workspace
  int64_t live_at_end = 0;  // activations still held after the last op
};

// Walks the trace counting each storage once while any name refers to it.
inline Peak WalkLiveMemory(const Trace& trace) {
  const size_t n = trace.values.size();
  std::vector<size_t> root(n);
  for (size_t v = 0; v < n; ++v) {
    size_t r = v;
    while (trace.values[r].kind == TraceValue::Kind::kAlias ||
           trace.values[r].kind == TraceValue::Kind::kVersion) {
      r = trace.values[r].base;
    }
    root[v] = r;
  }
  std::vector<int> names(n, 0);
  int64_t all = 0;
  int64_t act = 0;
  Peak peak;
  auto hold = [&](size_t v) {
    const TraceValue& r = trace.values[root[v]];
    if (names[root[v]]++ > 0) return;
    all += r.bytes;
    if (r.kind != TraceValue::Kind::kConstant) act += r.bytes;
  };
  auto drop = [&](size_t v) {
    const TraceValue& r = trace.values[root[v]];
    if (--names[root[v]] > 0) return;
    all -= r.bytes;
    if (r.kind != TraceValue::Kind::kConstant) act -= r.bytes;
  };
  for (size_t v = 0; v < n; ++v) {
    if (trace.values[v].kind == TraceValue::Kind::kConstant) hold(v);
  }
  for (int32_t v : trace.initial_releases) drop(v);
  for (const TraceOp& op : trace.ops) {
    for (int32_t v : op.outputs) {
      if (trace.values[v].kind == TraceValue::Kind::kVersion)
        drop(trace.values[v].base);
      hold(v);
    }
    peak.all = std::max(peak.all, all + op.workspace_bytes);
    peak.activations = std::max(peak.activations, act + op.workspace_bytes);
    for (int32_t v : op.releases) drop(v);
  }
  peak.live_at_end = act;
  return peak;
}

// Layers whose backward is an op named "<forward>_backward"; residual adds
// and the head merge pass their gradient on without a kernel.
inline bool HasBackwardOp(const TraceOp& op) {
  return op.name != "add" && op.name != "contiguous";
}

struct LayerPair {
  const TraceOp* forward;
  const TraceOp* backward;
};

// Pairs each forward layer with its backward op: backward replays the
// forward layers in reverse.
inline std::vector<LayerPair> PairLayers(const Trace& trace) {
  std::vector<const TraceOp*> forward;
  std::vector<const TraceOp*> backward;
  for (const TraceOp& op : trace.ops) {
    if (op.phase == Phase::kForward && HasBackwardOp(op)) {
      forward.push_back(&op);
    } else if (op.phase == Phase::kBackward &&
               absl::EndsWith(op.name, "_backward")) {
      backward.push_back(&op);
    }
  }
  EXPECT_EQ(forward.size(), backward.size()) << trace.name;
  std::vector<LayerPair> pairs;
  for (size_t i = 0; i < std::min(forward.size(), backward.size()); ++i) {
    const TraceOp* f = forward[forward.size() - 1 - i];
    EXPECT_EQ(backward[i]->name, f->name + "_backward")
        << trace.name << " backward op " << i;
    pairs.push_back({f, backward[i]});
  }
  return pairs;
}

}  // namespace deltad::sim

#endif  // DELTAD_TESTS_UNIT_SIM_MODEL_TRACES_TEST_HELPERS_H_
