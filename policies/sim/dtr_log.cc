#include "policies/sim/dtr_log.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace deltad::sim {

namespace {

using Json = nlohmann::json;

struct LogLine {
  int number = 0;  // 1-based line in the file, for messages
  Json obj;
};

// A JSON value shortened for an error message.
std::string Shorten(absl::string_view text) {
  constexpr size_t kMax = 80;
  if (text.size() <= kMax) return std::string(text);
  return absl::StrCat(text.substr(0, kMax), "...");
}

class Importer {
 public:
  Importer(std::string path, std::string trace_name)
      : path_(std::move(path)), builder_(std::move(trace_name)) {}

  absl::StatusOr<Trace> Run(const std::vector<LogLine>& lines) {
    lines_ = &lines;
    // Lines before the first START belong to warm-up iterations or setup.
    next_ = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (IsStart(lines[i])) {
        next_ = i + 1;
        break;
      }
    }
    while (next_ < lines.size()) {
      const LogLine& line = lines[next_++];
      auto instruction = String(line, "INSTRUCTION");
      if (!instruction.ok()) return instruction.status();
      if (*instruction == "ANNOTATE" && IsStart(line)) break;  // next iteration
      if (absl::Status s = Dispatch(*instruction, line); !s.ok()) return s;
    }
    Trace trace = std::move(builder_).Build();
    if (absl::Status s = trace.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": the imported trace is inconsistent: ", s.message()));
    }
    return trace;
  }

 private:
  // What the log's names point at. Names made by COPY share one reference;
  // a MUTATE moves the reference (all its names at once) to the new version.
  struct Ref {
    int32_t value = -1;
    int32_t names = 0;  // the value is released when this drops to 0
  };

  static bool IsStart(const LogLine& line) {
    const Json& o = line.obj;
    auto i = o.find("INSTRUCTION");
    auto a = o.find("ANNOTATION");
    return i != o.end() && a != o.end() && *i == "ANNOTATE" && *a == "START";
  }

  absl::Status Error(const LogLine& line, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ":", line.number, ": ", what));
  }

  absl::StatusOr<const Json*> Key(const LogLine& line,
                                  absl::string_view key) const {
    auto it = line.obj.find(key);
    if (it == line.obj.end()) {
      return Error(line, absl::StrCat("expected key \"", key, "\" in ",
                                      Shorten(line.obj.dump())));
    }
    return &*it;
  }

  absl::StatusOr<std::string> String(const LogLine& line,
                                     absl::string_view key) const {
    auto v = Key(line, key);
    if (!v.ok()) return v.status();
    if (!(*v)->is_string()) {
      return Error(line,
                   absl::StrCat("expected \"", key, "\" to be a string, got ",
                                Shorten((*v)->dump())));
    }
    return (*v)->get<std::string>();
  }

  // The logs write numbers as strings ("TIME":"920906"); plain JSON
  // integers are accepted too.
  absl::StatusOr<int64_t> IntOf(const LogLine& line, absl::string_view key,
                                const Json& v) const {
    int64_t n = 0;
    if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else if (!v.is_string() || !absl::SimpleAtoi(v.get<std::string>(), &n)) {
      return Error(line,
                   absl::StrCat("expected \"", key, "\" to be an integer, got ",
                                Shorten(v.dump())));
    }
    return n;
  }

  absl::StatusOr<int64_t> Int(const LogLine& line, absl::string_view key,
                              int64_t min) const {
    auto v = Key(line, key);
    if (!v.ok()) return v.status();
    auto n = IntOf(line, key, **v);
    if (!n.ok()) return n.status();
    if (*n < min) {
      return Error(line, absl::StrCat("expected \"", key, "\" to be at least ",
                                      min, ", got ", *n));
    }
    return *n;
  }

  absl::StatusOr<std::vector<std::string>> Names(const LogLine& line,
                                                 absl::string_view key) const {
    auto v = Key(line, key);
    if (!v.ok()) return v.status();
    std::vector<std::string> names;
    bool ok = (*v)->is_array();
    if (ok) {
      for (const Json& e : **v) {
        if (!e.is_string()) {
          ok = false;
          break;
        }
        names.push_back(e.get<std::string>());
      }
    }
    if (!ok) {
      return Error(line, absl::StrCat("expected \"", key,
                                      "\" to be a list of names, got ",
                                      Shorten((*v)->dump())));
    }
    return names;
  }

  absl::StatusOr<std::vector<int64_t>> Indices(const LogLine& line,
                                               absl::string_view key) const {
    auto v = Key(line, key);
    if (!v.ok()) return v.status();
    if (!(*v)->is_array()) {
      return Error(line, absl::StrCat("expected \"", key,
                                      "\" to be a list of indices, got ",
                                      Shorten((*v)->dump())));
    }
    std::vector<int64_t> out;
    for (const Json& e : **v) {
      auto n = IntOf(line, key, e);
      if (!n.ok()) return n.status();
      out.push_back(*n);
    }
    return out;
  }

  absl::StatusOr<int32_t> Lookup(const LogLine& line, absl::string_view name,
                                 absl::string_view role) const {
    auto it = refs_by_name_.find(name);
    if (it == refs_by_name_.end()) {
      return Error(line, absl::StrCat("expected ", role, " '", name,
                                      "' to be a defined name (it was never "
                                      "defined, or already released)"));
    }
    return it->second;
  }

  absl::Status Bind(const LogLine& line, const std::string& name, int32_t ref) {
    if (!refs_by_name_.emplace(name, ref).second) {
      return Error(line, absl::StrCat("expected a new name, but '", name,
                                      "' is still live"));
    }
    ++refs_[ref].names;
    return absl::OkStatus();
  }

  // The trace's text form (trace_io.h) splits at whitespace, ends a line
  // at '#' and, in value names, uses ',', ':' and '=' as separators: a
  // name holding one would be written out as a trace that cannot be read
  // back.
  absl::Status Writable(const LogLine& line, absl::string_view name,
                        bool value) const {
    const absl::string_view forbidden =
        value ? absl::string_view(" \t\n\v\f\r#,:=")
              : absl::string_view(" \t\n\v\f\r#");
    if (name.empty() || name.find_first_of(forbidden) != name.npos) {
      return Error(line, absl::StrCat("expected ", value ? "value" : "op",
                                      " name '", name,
                                      "' to be non-empty and without "
                                      "whitespace or '#'",
                                      value ? ", ',', ':' or '='" : ""));
    }
    return absl::OkStatus();
  }

  absl::Status Define(const LogLine& line, const std::string& name,
                      int32_t value) {
    if (absl::Status s = Writable(line, name, /*value=*/true); !s.ok()) {
      return s;
    }
    refs_.push_back(Ref{value, 0});
    return Bind(line, name, static_cast<int32_t>(refs_.size() - 1));
  }

  void Drop(absl::string_view name) {
    auto it = refs_by_name_.find(name);
    Ref& ref = refs_[it->second];
    refs_by_name_.erase(it);
    if (--ref.names == 0) builder_.Release(ref.value);
  }

  // Consumes the line after a CONSTANT or CALL, which must be `instruction`
  // for `name`, and returns it.
  absl::StatusOr<const LogLine*> Follow(const LogLine& after,
                                        absl::string_view instruction,
                                        const std::string& name) {
    const std::string what =
        absl::StrCat("expected ", instruction, " for '", name, "'");
    if (next_ >= lines_->size()) {
      return Error(after, absl::StrCat(what,
                                       " after this line, got the end "
                                       "of the file"));
    }
    const LogLine& line = (*lines_)[next_++];
    auto got = String(line, "INSTRUCTION");
    if (!got.ok()) return got.status();
    auto got_name = line.obj.find("NAME");
    if (*got != instruction || got_name == line.obj.end() ||
        *got_name != name) {
      return Error(
          line, absl::StrCat(what, " (line ", after.number, " needs it), got ",
                             Shorten(line.obj.dump())));
    }
    return &line;
  }

  absl::Status Dispatch(const std::string& instruction, const LogLine& line) {
    if (instruction == "ANNOTATE") return Annotate(line);
    if (instruction == "CONSTANT") return Constant(line);
    if (instruction == "CALL") return Call(line);
    if (instruction == "MUTATE") return Mutate(line);
    if (instruction == "COPY") return Copy(line);
    if (instruction == "COPY_FROM") return CopyFrom(line);
    if (instruction == "RELEASE") return Release(line);
    if (instruction == "MEMORY" || instruction == "ALIAS") {
      return Error(line, absl::StrCat("expected ", instruction,
                                      " only right after its CONSTANT or "
                                      "CALL line"));
    }
    return Error(line, absl::StrCat("expected an INSTRUCTION among ANNOTATE, "
                                    "CONSTANT, MEMORY, CALL, ALIAS, MUTATE, "
                                    "COPY, COPY_FROM, RELEASE; got '",
                                    instruction, "'"));
  }

  absl::Status Annotate(const LogLine& line) {
    auto what = String(line, "ANNOTATION");
    if (!what.ok()) return what.status();
    if (*what == "BACKWARD") phase_ = Phase::kBackward;
    return absl::OkStatus();
  }

  absl::Status Constant(const LogLine& line) {
    auto name = String(line, "NAME");
    if (!name.ok()) return name.status();
    auto memory = Follow(line, "MEMORY", *name);
    if (!memory.ok()) return memory.status();
    auto bytes = Int(**memory, "MEMORY", 0);
    if (!bytes.ok()) return bytes.status();
    return Define(line, *name, builder_.Constant(*name, *bytes));
  }

  absl::Status Args(const LogLine& line, std::vector<int32_t>* refs) {
    auto args = Names(line, "ARGS");
    if (!args.ok()) return args.status();
    for (const std::string& arg : *args) {
      auto ref = Lookup(line, arg, "argument");
      if (!ref.ok()) return ref.status();
      refs->push_back(*ref);
    }
    return absl::OkStatus();
  }

  // Starts the op of a CALL or MUTATE line; returns the references of its
  // ARGS, which the results' ALIAS and the MUTATE indices refer to.
  absl::StatusOr<std::vector<int32_t>> StartOp(const LogLine& line) {
    auto name = String(line, "NAME");
    if (!name.ok()) return name.status();
    if (absl::Status s = Writable(line, *name, /*value=*/false); !s.ok()) {
      return s;
    }
    auto time = Int(line, "TIME", 0);
    if (!time.ok()) return time.status();
    std::vector<int32_t> refs;
    if (absl::Status s = Args(line, &refs); !s.ok()) return s;
    builder_.Op(*name, phase_, *time);
    // Each value is read once, though an op may name it twice
    // (addcmul_(x, y, y) in the unrolled GAN).
    std::vector<int32_t> inputs;
    for (int32_t ref : refs) {
      const int32_t v = refs_[ref].value;
      if (std::find(inputs.begin(), inputs.end(), v) == inputs.end()) {
        inputs.push_back(v);
        builder_.Input(v);
      }
    }
    return refs;
  }

  absl::Status Call(const LogLine& line) {
    auto results = Names(line, "RESULT");
    if (!results.ok()) return results.status();
    auto args_or = StartOp(line);
    if (!args_or.ok()) return args_or.status();
    const std::vector<int32_t>& args = *args_or;
    for (const std::string& result : *results) {
      auto memory = Follow(line, "MEMORY", result);
      if (!memory.ok()) return memory.status();
      auto bytes = Int(**memory, "MEMORY", 0);
      if (!bytes.ok()) return bytes.status();
      auto alias_line = Follow(line, "ALIAS", result);
      if (!alias_line.ok()) return alias_line.status();
      auto alias = Int(**alias_line, "ALIAS", -1);
      if (!alias.ok()) return alias.status();
      if (*alias == -1) {
        if (absl::Status s =
                Define(line, result, builder_.Output(result, *bytes));
            !s.ok()) {
          return s;
        }
        continue;
      }
      if (*alias >= static_cast<int64_t>(args.size())) {
        return Error(**alias_line,
                     absl::StrCat("expected ALIAS -1 or an index below the ",
                                  args.size(), " ARGS of line ", line.number,
                                  ", got ", *alias));
      }
      const int32_t base = refs_[args[*alias]].value;
      const int64_t base_bytes = builder_.trace().values[base].bytes;
      // A view shares its base's storage, so the log must report its size.
      if (*bytes != base_bytes) {
        return Error(**memory,
                     absl::StrCat("expected the view '", result, "' to have ",
                                  "the storage size of its base '",
                                  builder_.trace().values[base].name, "' (",
                                  base_bytes, " bytes), got ", *bytes));
      }
      if (absl::Status s = Define(line, result, builder_.Alias(result, base));
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Mutate(const LogLine& line) {
    auto mutated = Indices(line, "MUTATE");
    if (!mutated.ok()) return mutated.status();
    auto args_or = StartOp(line);
    if (!args_or.ok()) return args_or.status();
    const std::vector<int32_t>& args = *args_or;
    std::vector<int32_t> done;  // references already versioned by this op
    for (int64_t k : *mutated) {
      if (k < 0 || k >= static_cast<int64_t>(args.size())) {
        return Error(line, absl::StrCat("expected MUTATE indices below the ",
                                        args.size(), " ARGS, got ", k));
      }
      const int32_t ref = args[k];
      if (std::find(done.begin(), done.end(), ref) != done.end()) continue;
      done.push_back(ref);
      refs_[ref].value = builder_.Version(refs_[ref].value);
    }
    return absl::OkStatus();
  }

  absl::Status Copy(const LogLine& line) {
    auto src = String(line, "SRC");
    if (!src.ok()) return src.status();
    auto dst = String(line, "DST");
    if (!dst.ok()) return dst.status();
    auto ref = Lookup(line, *src, "SRC");
    if (!ref.ok()) return ref.status();
    return Bind(line, *dst, *ref);
  }

  absl::Status CopyFrom(const LogLine& line) {
    auto src = String(line, "SRC");
    if (!src.ok()) return src.status();
    auto dst = String(line, "DST");
    if (!dst.ok()) return dst.status();
    auto src_ref = Lookup(line, *src, "SRC");
    if (!src_ref.ok()) return src_ref.status();
    auto dst_ref = Lookup(line, *dst, "DST");
    if (!dst_ref.ok()) return dst_ref.status();
    // Already a name of SRC's value: dropping it first could free the value.
    if (*src_ref == *dst_ref) return absl::OkStatus();
    Drop(*dst);
    return Bind(line, *dst, *src_ref);
  }

  absl::Status Release(const LogLine& line) {
    auto name = String(line, "NAME");
    if (!name.ok()) return name.status();
    if (refs_by_name_.contains(*name)) Drop(*name);
    return absl::OkStatus();
  }

  std::string path_;
  TraceBuilder builder_;
  const std::vector<LogLine>* lines_ = nullptr;
  size_t next_ = 0;  // index in *lines_ of the next line to read
  Phase phase_ = Phase::kForward;
  std::vector<Ref> refs_;
  absl::flat_hash_map<std::string, int32_t> refs_by_name_;
};

}  // namespace

absl::StatusOr<Trace> ImportDtrLog(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::vector<LogLine> lines;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    Json obj = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (obj.is_discarded() || !obj.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": expected a JSON object, got '",
                       Shorten(text), "'"));
    }
    lines.push_back(LogLine{number, std::move(obj)});
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return Importer(path, std::filesystem::path(path).stem().string()).Run(lines);
}

std::string DefaultDtrTraceDir() {
  if (const char* dir = std::getenv("DELTAD_DTR_TRACES");
      dir != nullptr && *dir != '\0') {
    return dir;
  }
  return "../shared/traces/dtr";
}

std::vector<std::string> ListDtrLogs(const std::string& dir) {
  std::vector<std::string> logs;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::filesystem::path& p = it->path();
    if (p.extension() == ".log" && it->is_regular_file(ec)) {
      logs.push_back(p.string());
    }
  }
  std::sort(logs.begin(), logs.end());
  return logs;
}

}  // namespace deltad::sim
