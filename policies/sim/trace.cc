#include "policies/sim/trace.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::sim {

int64_t Trace::ComputeNs() const {
  int64_t sum = 0;
  for (const TraceOp& op : ops) sum += op.time_ns;
  return sum;
}

absl::Status Trace::Validate() const {
  using Kind = TraceValue::Kind;
  const auto n = static_cast<int32_t>(values.size());
  // 0: not yet created, 1: live, 2: dropped (released or superseded).
  std::vector<uint8_t> life(values.size(), 0);
  auto where = [&](size_t op) {
    return op < ops.size() ? absl::StrCat("op ", op, " (", ops[op].name, ")")
                           : std::string("start");
  };
  auto check_index = [&](int32_t v, size_t op) -> absl::Status {
    if (v < 0 || v >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(op), ": value index ", v, " out of range"));
    }
    return absl::OkStatus();
  };
  for (int32_t v = 0; v < n; ++v) {
    const TraceValue& val = values[v];
    if (val.bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("value '", val.name, "': negative size ", val.bytes));
    }
    if (val.kind == Kind::kConstant) {
      if (val.op != -1) {
        return absl::InvalidArgumentError(
            absl::StrCat("constant '", val.name, "' names a producing op"));
      }
      life[v] = 1;
    } else if (val.op < 0 || static_cast<size_t>(val.op) >= ops.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("value '", val.name, "' has no producing op"));
    }
    if ((val.kind == Kind::kAlias || val.kind == Kind::kVersion) &&
        (val.base < 0 || val.base >= n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("value '", val.name, "' has no base value"));
    }
  }
  auto release = [&](int32_t v, size_t op) -> absl::Status {
    if (absl::Status s = check_index(v, op); !s.ok()) return s;
    if (life[v] != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(op), ": releases '", values[v].name,
                       life[v] == 0 ? "' before it exists" : "' twice"));
    }
    life[v] = 2;
    return absl::OkStatus();
  };
  for (int32_t v : initial_releases) {
    if (absl::Status s = release(v, ops.size()); !s.ok()) return s;
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const TraceOp& op = ops[i];
    if (op.time_ns < 0 || op.workspace_bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(i), ": negative time or workspace"));
    }
    for (int32_t v : op.inputs) {
      if (absl::Status s = check_index(v, i); !s.ok()) return s;
      if (life[v] != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(i), ": reads '", values[v].name, "' which is ",
                         life[v] == 0 ? "not created yet" : "no longer live"));
      }
    }
    for (int32_t v : op.outputs) {
      if (absl::Status s = check_index(v, i); !s.ok()) return s;
      const TraceValue& val = values[v];
      if (val.op != static_cast<int32_t>(i) || life[v] != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(i), ": output '", val.name, "' is not created by this op"));
      }
      if (val.kind == Kind::kAlias || val.kind == Kind::kVersion) {
        if (life[val.base] != 1) {
          return absl::InvalidArgumentError(
              absl::StrCat(where(i), ": '", val.name, "' is based on '",
                           values[val.base].name, "' which is not live"));
        }
        if (values[val.base].bytes != val.bytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              where(i), ": '", val.name, "' must have the size of its base"));
        }
      }
      // The name moves to the new version: the old value is dropped.
      if (val.kind == Kind::kVersion) life[val.base] = 2;
      life[v] = 1;
    }
    for (int32_t v : op.releases) {
      if (absl::Status s = release(v, i); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

int32_t TraceBuilder::AddValue(TraceValue v) {
  trace_.values.push_back(std::move(v));
  return static_cast<int32_t>(trace_.values.size() - 1);
}

int32_t TraceBuilder::Constant(absl::string_view name, int64_t bytes) {
  TraceValue v;
  v.name = std::string(name);
  v.bytes = bytes;
  v.kind = TraceValue::Kind::kConstant;
  return AddValue(std::move(v));
}

TraceBuilder& TraceBuilder::Op(absl::string_view name, Phase phase,
                               int64_t time_ns, int64_t workspace_bytes) {
  TraceOp op;
  op.name = std::string(name);
  op.phase = phase;
  op.time_ns = time_ns;
  op.workspace_bytes = workspace_bytes;
  trace_.ops.push_back(std::move(op));
  return *this;
}

TraceBuilder& TraceBuilder::Input(int32_t value) {
  trace_.ops.back().inputs.push_back(value);
  return *this;
}

int32_t TraceBuilder::Output(absl::string_view name, int64_t bytes) {
  TraceValue v;
  v.name = std::string(name);
  v.bytes = bytes;
  v.kind = TraceValue::Kind::kOutput;
  v.op = static_cast<int32_t>(trace_.ops.size() - 1);
  const int32_t id = AddValue(std::move(v));
  trace_.ops.back().outputs.push_back(id);
  return id;
}

int32_t TraceBuilder::Alias(absl::string_view name, int32_t base) {
  TraceValue v;
  v.name = std::string(name);
  v.bytes = trace_.values[base].bytes;
  v.kind = TraceValue::Kind::kAlias;
  v.base = base;
  v.op = static_cast<int32_t>(trace_.ops.size() - 1);
  const int32_t id = AddValue(std::move(v));
  trace_.ops.back().outputs.push_back(id);
  return id;
}

int32_t TraceBuilder::Version(int32_t base) {
  TraceValue v;
  v.name = trace_.values[base].name;
  v.bytes = trace_.values[base].bytes;
  v.kind = TraceValue::Kind::kVersion;
  v.base = base;
  v.op = static_cast<int32_t>(trace_.ops.size() - 1);
  const int32_t id = AddValue(std::move(v));
  trace_.ops.back().outputs.push_back(id);
  return id;
}

void TraceBuilder::Release(int32_t value) {
  if (trace_.ops.empty()) {
    trace_.initial_releases.push_back(value);
  } else {
    trace_.ops.back().releases.push_back(value);
  }
}

}  // namespace deltad::sim
