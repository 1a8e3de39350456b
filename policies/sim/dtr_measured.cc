#include "policies/sim/dtr_measured.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace deltad::sim {

namespace {

using Json = nlohmann::json;

// Reads the members of one run; `where` names it in messages.
class RunReader {
 public:
  explicit RunReader(std::string where) : where_(std::move(where)) {}

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": expected ", what));
  }

  absl::StatusOr<const Json*> Member(const Json& obj, const std::string& key,
                                     absl::string_view context) const {
    if (!obj.is_object()) return Error(absl::StrCat(context, " as an object"));
    auto it = obj.find(key);
    if (it == obj.end()) {
      return Error(absl::StrCat("key \"", key, "\" in ", context));
    }
    return &*it;
  }

  absl::StatusOr<double> Number(const Json& obj, const std::string& key,
                                absl::string_view context) const {
    auto v = Member(obj, key, context);
    if (!v.ok()) return v.status();
    if (!(*v)->is_number()) {
      return Error(absl::StrCat(context, ".", key, " to be a number, got ",
                                (*v)->dump()));
    }
    return (*v)->get<double>();
  }

  // A median/mean statistic: obj[key][stat].
  absl::StatusOr<double> Stat(const Json& obj, const std::string& key,
                              const std::string& stat) const {
    auto v = Member(obj, key, "summary");
    if (!v.ok()) return v.status();
    return Number(**v, stat, absl::StrCat("summary.", key));
  }

 private:
  std::string where_;
};

// Appends one run's measurement to *out; a run without results adds none.
absl::Status ReadRun(const std::string& where, const std::string& model,
                     const Json& run, std::vector<DtrMeasurement>* out) {
  RunReader r(where);
  auto params = r.Member(run, "specific_params", "the run");
  if (!params.ok()) return params.status();
  auto type = r.Member(**params, "type", "specific_params");
  if (!type.ok()) return type.status();
  if (!(*type)->is_string()) {
    return r.Error(absl::StrCat("specific_params.type to be a string, got ",
                                (*type)->dump()));
  }
  DtrMeasurement m;
  m.model = model;
  m.type = (*type)->get<std::string>();
  auto batch = r.Number(**params, "batch_size", "specific_params");
  if (!batch.ok()) return batch.status();
  if (*batch < 1 || *batch != std::floor(*batch)) {
    return r.Error(absl::StrCat("a positive whole batch_size, got ", *batch));
  }
  m.batch = static_cast<int>(*batch);
  // Baselines run without a budget; the files write none for them.
  if (m.type != "baseline") {
    auto budget = r.Number(**params, "memory_budget", "specific_params");
    if (!budget.ok()) return budget.status();
    if (*budget < 0) {
      return r.Error(
          absl::StrCat("a non-negative memory_budget, got ", *budget));
    }
    m.budget_bytes = static_cast<int64_t>(*budget);
  }
  auto summary = r.Member(run, "summary", "the run");
  if (!summary.ok()) return summary.status();
  // A failed run (out of memory, timeout) has the summary "error".
  if ((*summary)->is_string()) return absl::OkStatus();
  if (!(*summary)->is_array() || (*summary)->empty()) {
    return r.Error(
        absl::StrCat("summary to be a non-empty list or \"error\", "
                     "got ",
                     (*summary)->dump().substr(0, 80)));
  }
  const Json& s = (**summary)[0];
  auto median = r.Stat(s, "time", "median");
  if (!median.ok()) return median.status();
  auto mean = r.Stat(s, "time", "mean");
  if (!mean.ok()) return mean.status();
  auto mem = r.Stat(s, "total_mem", "median");
  if (!mem.ok()) return mem.status();
  m.median_ms = *median;
  m.mean_ms = *mean;
  m.total_mem_mb = *mem;
  out->push_back(std::move(m));
  return absl::OkStatus();
}

}  // namespace

std::string CanonicalDtrModel(absl::string_view key) {
  if (key == "inceptiov4") return "inceptionv4";
  return std::string(key);
}

absl::StatusOr<std::vector<DtrMeasurement>> LoadDtrMeasurements(
    const std::string& json_path) {
  std::ifstream in(json_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", json_path));
  std::stringstream text;
  text << in.rdbuf();
  const Json doc =
      Json::parse(text.str(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        json_path, ": expected a JSON object of the models' runs"));
  }
  std::vector<DtrMeasurement> out;
  for (const auto& [key, runs] : doc.items()) {
    if (!runs.is_array()) continue;  // metadata: timestamp, start_time, ...
    const std::string model = CanonicalDtrModel(key);
    if (model != key && doc.contains(model)) continue;  // a misspelt copy
    for (size_t i = 0; i < runs.size(); ++i) {
      const std::string where =
          absl::StrCat(json_path, ": model '", key, "' run ", i);
      if (absl::Status s = ReadRun(where, model, runs[i], &out); !s.ok()) {
        return s;
      }
    }
  }
  return out;
}

absl::StatusOr<DtrLogModel> DtrModelFromLogName(absl::string_view path) {
  const std::string file =
      std::filesystem::path(std::string(path)).filename().string();
  std::vector<absl::string_view> parts = absl::StrSplit(file, '-');
  DtrLogModel m;
  if (parts.size() < 3 || parts[0].empty() ||
      !absl::SimpleAtoi(parts[1], &m.batch) || m.batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a DTR log name '<model>-<batch>-<budget>-...log', got '",
        file, "'"));
  }
  m.model = CanonicalDtrModel(parts[0]);
  m.same_config_as_measured = m.model != "unroll_gan";
  return m;
}

const DtrMeasurement* FindDtrBaseline(
    const std::vector<DtrMeasurement>& measurements, absl::string_view model,
    int batch) {
  for (const DtrMeasurement& m : measurements) {
    if (m.type == "baseline" && m.model == model && m.batch == batch) return &m;
  }
  return nullptr;
}

}  // namespace deltad::sim
