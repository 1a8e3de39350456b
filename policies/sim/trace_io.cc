#include "policies/sim/trace_io.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace deltad::sim {

namespace {

constexpr absl::string_view kMagic = "deltad-trace 1";

class Parser {
 public:
  explicit Parser(absl::string_view source) : source_(source) {}

  absl::StatusOr<Trace> Run(absl::string_view text) {
    bool seen_magic = false;
    for (absl::string_view raw : absl::StrSplit(text, '\n')) {
      ++line_;
      absl::string_view line = raw;
      if (const auto hash = line.find('#'); hash != line.npos) {
        line = line.substr(0, hash);
      }
      line = absl::StripAsciiWhitespace(line);
      if (line.empty()) continue;
      if (!seen_magic) {
        if (line != kMagic) {
          return Error(
              absl::StrCat("expected '", kMagic, "' as the first line"));
        }
        seen_magic = true;
        continue;
      }
      std::vector<absl::string_view> words =
          absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      absl::Status s;
      if (words[0] == "name") {
        s = ParseName(words);
      } else if (words[0] == "const") {
        s = ParseConst(words);
      } else if (words[0] == "op") {
        s = ParseOp(words);
      } else if (words[0] == "release") {
        s = ParseRelease(words);
      } else {
        s = Error(
            absl::StrCat("expected 'name', 'const', 'op' or 'release', got '",
                         words[0], "'"));
      }
      if (!s.ok()) return s;
    }
    if (!seen_magic)
      return Error(absl::StrCat("empty trace: expected '", kMagic, "'"));
    Trace trace = std::move(builder_).Build();
    if (absl::Status s = trace.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": invalid trace: ", s.message()));
    }
    return trace;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ":", line_, ": ", what));
  }

  absl::StatusOr<int64_t> Number(absl::string_view word,
                                 absl::string_view what) const {
    int64_t n;
    if (!absl::SimpleAtoi(word, &n) || n < 0) {
      return Error(absl::StrCat("expected ", what,
                                " (a non-negative integer), got '", word, "'"));
    }
    return n;
  }

  absl::Status CheckName(absl::string_view name) const {
    if (name.empty() || name.find_first_of(",:=") != name.npos) {
      return Error(
          absl::StrCat("bad name '", name, "': names hold no ',', ':' or '='"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int32_t> Live(absl::string_view name) const {
    auto it = live_.find(name);
    if (it == live_.end()) {
      return Error(absl::StrCat("undefined name '", name,
                                "' (never defined, or already released)"));
    }
    return it->second;
  }

  absl::Status Define(absl::string_view name, int32_t value) {
    if (absl::Status s = CheckName(name); !s.ok()) return s;
    if (!live_.emplace(std::string(name), value).second) {
      return Error(absl::StrCat("name '", name, "' is already live"));
    }
    return absl::OkStatus();
  }

  absl::Status ParseName(const std::vector<absl::string_view>& w) {
    if (w.size() != 2) return Error("expected 'name <trace name>'");
    builder_.set_name(std::string(w[1]));
    return absl::OkStatus();
  }

  absl::Status ParseConst(const std::vector<absl::string_view>& w) {
    if (w.size() != 3) return Error("expected 'const <name> <bytes>'");
    auto bytes = Number(w[2], "a size in bytes");
    if (!bytes.ok()) return bytes.status();
    if (!builder_.trace().ops.empty()) {
      return Error("constants come before the first op");
    }
    return Define(w[1], builder_.Constant(w[1], *bytes));
  }

  absl::Status ParseOp(const std::vector<absl::string_view>& w) {
    if (w.size() < 4)
      return Error("expected 'op <operator> fwd|bwd <time_ns> ...'");
    Phase phase;
    if (w[2] == "fwd") {
      phase = Phase::kForward;
    } else if (w[2] == "bwd") {
      phase = Phase::kBackward;
    } else {
      return Error(absl::StrCat("expected 'fwd' or 'bwd', got '", w[2], "'"));
    }
    auto time = Number(w[3], "a time in ns");
    if (!time.ok()) return time.status();
    std::vector<std::pair<absl::string_view, absl::string_view>> fields;
    int64_t workspace = 0;
    for (size_t i = 4; i < w.size(); ++i) {
      const auto eq = w[i].find('=');
      if (eq == w[i].npos) {
        return Error(absl::StrCat(
            "expected key=value (ws, in, out, alias, mut), got '", w[i], "'"));
      }
      const absl::string_view key = w[i].substr(0, eq);
      const absl::string_view value = w[i].substr(eq + 1);
      if (key == "ws") {
        auto ws = Number(value, "a workspace size in bytes");
        if (!ws.ok()) return ws.status();
        workspace = *ws;
      } else if (key == "in" || key == "out" || key == "alias" ||
                 key == "mut") {
        fields.emplace_back(key, value);
      } else {
        return Error(absl::StrCat("unknown key '", key,
                                  "'; expected ws, in, out, alias or mut"));
      }
    }
    builder_.Op(w[1], phase, *time, workspace);
    // Inputs first: an op may read a value it then updates in place.
    for (const auto& [key, value] : fields) {
      if (key != "in") continue;
      for (absl::string_view name : absl::StrSplit(value, ',')) {
        auto v = Live(name);
        if (!v.ok()) return v.status();
        builder_.Input(*v);
      }
    }
    for (const auto& [key, value] : fields) {
      if (key == "in") continue;
      for (absl::string_view item : absl::StrSplit(value, ',')) {
        if (absl::Status s = Create(key, item); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Create(absl::string_view key, absl::string_view item) {
    if (key == "mut") {
      auto base = Live(item);
      if (!base.ok()) return base.status();
      live_[item] = builder_.Version(*base);
      return absl::OkStatus();
    }
    const auto colon = item.find(':');
    if (colon == item.npos) {
      return Error(absl::StrCat(
          "expected ", key == "out" ? "<name>:<bytes>" : "<name>:<base>",
          " in ", key, "=, got '", item, "'"));
    }
    const absl::string_view name = item.substr(0, colon);
    const absl::string_view rest = item.substr(colon + 1);
    if (key == "out") {
      auto bytes = Number(rest, "a size in bytes");
      if (!bytes.ok()) return bytes.status();
      if (absl::Status s = CheckName(name); !s.ok()) return s;
      return Define(name, builder_.Output(name, *bytes));
    }
    auto base = Live(rest);
    if (!base.ok()) return base.status();
    if (absl::Status s = CheckName(name); !s.ok()) return s;
    return Define(name, builder_.Alias(name, *base));
  }

  absl::Status ParseRelease(const std::vector<absl::string_view>& w) {
    if (w.size() != 2) return Error("expected 'release <name>[,<name>...]'");
    for (absl::string_view name : absl::StrSplit(w[1], ',')) {
      auto it = live_.find(name);
      if (it == live_.end()) continue;  // allowed: see the header
      builder_.Release(it->second);
      live_.erase(it);
    }
    return absl::OkStatus();
  }

  std::string source_;
  int line_ = 0;
  TraceBuilder builder_{"unnamed"};
  absl::flat_hash_map<std::string, int32_t> live_;
};

}  // namespace

absl::StatusOr<Trace> ParseTrace(absl::string_view text,
                                 absl::string_view source) {
  return Parser(source).Run(text);
}

absl::StatusOr<Trace> ReadTraceFile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot open trace file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseTrace(ss.str(), path);
}

std::string FormatTrace(const Trace& trace) {
  using Kind = TraceValue::Kind;
  std::string out = absl::StrCat(kMagic, "\nname ", trace.name, "\n");
  const auto& vals = trace.values;
  for (const TraceValue& v : vals) {
    if (v.kind == Kind::kConstant)
      absl::StrAppend(&out, "const ", v.name, " ", v.bytes, "\n");
  }
  auto release_line = [&](const std::vector<int32_t>& r) {
    if (r.empty()) return;
    absl::StrAppend(&out, "release ",
                    absl::StrJoin(r, ",",
                                  [&](std::string* s, int32_t v) {
                                    absl::StrAppend(s, vals[v].name);
                                  }),
                    "\n");
  };
  release_line(trace.initial_releases);
  for (const TraceOp& op : trace.ops) {
    absl::StrAppend(&out, "op ", op.name, " ",
                    op.phase == Phase::kForward ? "fwd" : "bwd", " ",
                    op.time_ns);
    if (op.workspace_bytes > 0)
      absl::StrAppend(&out, " ws=", op.workspace_bytes);
    if (!op.inputs.empty()) {
      absl::StrAppend(
          &out,
          " in=", absl::StrJoin(op.inputs, ",", [&](std::string* o, int32_t v) {
            absl::StrAppend(o, vals[v].name);
          }));
    }
    // Results in their order, a key per run of one kind: the reader creates
    // them in the order the keys appear, and a view of a value updated by the
    // same op must come after the update.
    for (size_t i = 0; i < op.outputs.size();) {
      const Kind kind = vals[op.outputs[i]].kind;
      std::vector<std::string> items;
      for (; i < op.outputs.size() && vals[op.outputs[i]].kind == kind; ++i) {
        const TraceValue& v = vals[op.outputs[i]];
        if (kind == Kind::kOutput) {
          items.push_back(absl::StrCat(v.name, ":", v.bytes));
        } else if (kind == Kind::kAlias) {
          items.push_back(absl::StrCat(v.name, ":", vals[v.base].name));
        } else {
          items.push_back(v.name);
        }
      }
      const absl::string_view key = kind == Kind::kOutput  ? "out"
                                    : kind == Kind::kAlias ? "alias"
                                                           : "mut";
      absl::StrAppend(&out, " ", key, "=", absl::StrJoin(items, ","));
    }
    absl::StrAppend(&out, "\n");
    release_line(op.releases);
  }
  return out;
}

absl::Status WriteTraceFile(const Trace& trace, const std::string& path) {
  std::ofstream out(path, std::ios::trunc);
  out << FormatTrace(trace);
  out.close();
  if (!out)
    return absl::UnavailableError(
        absl::StrCat("cannot write trace file ", path));
  return absl::OkStatus();
}

}  // namespace deltad::sim
