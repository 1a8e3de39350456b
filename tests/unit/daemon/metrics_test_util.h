// What the metrics tests share: parsing a scrape and a Metrics of two GPUs.
#ifndef DELTAD_TESTS_UNIT_DAEMON_METRICS_TEST_UTIL_H_
#define DELTAD_TESTS_UNIT_DAEMON_METRICS_TEST_UTIL_H_

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "daemon/metrics.h"
#include "gtest/gtest.h"

namespace deltad::daemon::metrics_testing {

using Labels = std::map<std::string, std::string>;

inline constexpr char kUuid0[] = "GPU-00000000-aaaa-bbbb-cccc-000000000000";
inline constexpr char kUuid1[] = "GPU-11111111-aaaa-bbbb-cccc-111111111111";

// One sample line of the text exposition.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// Parses sample lines of the form name{k="v",...} value. Label values here
// never contain quotes or commas, so no unescaping is needed.
inline std::vector<Sample> Samples(const std::string& scrape) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (brace != absl::string_view::npos && brace < space) {
      s.name = std::string(line.substr(0, brace));
      const size_t close = line.find('}', brace);
      for (absl::string_view pair :
           absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',',
                          absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        absl::string_view value = pair.substr(eq + 1);
        value.remove_prefix(1);  // the quotes
        value.remove_suffix(1);
        s.labels[std::string(pair.substr(0, eq))] = std::string(value);
      }
    } else {
      s.name = std::string(line.substr(0, space));
    }
    s.value = std::strtod(std::string(line.substr(space + 1)).c_str(), nullptr);
    samples.push_back(std::move(s));
  }
  return samples;
}

// The value of the one sample with this name and these labels; `le` is
// compared as a number, since its formatting is the library's business.
inline std::optional<double> Value(const std::string& scrape,
                                   const std::string& name,
                                   const Labels& labels) {
  std::optional<double> found;
  for (const Sample& s : Samples(scrape)) {
    if (s.name != name || s.labels.size() != labels.size()) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      if (it == s.labels.end()) {
        match = false;
      } else if (k == "le" && v != "+Inf" && it->second != "+Inf") {
        match = std::abs(std::strtod(v.c_str(), nullptr) -
                         std::strtod(it->second.c_str(), nullptr)) < 1e-12;
      } else {
        match = match && it->second == v;
      }
      if (!match) break;
    }
    if (!match) continue;
    EXPECT_FALSE(found.has_value()) << "two samples " << name;
    found = s.value;
  }
  return found;
}

inline Labels Gpu0(Labels more = {}) {
  more["gpu"] = "0";
  more["uuid"] = kUuid0;
  return more;
}

inline std::unique_ptr<Metrics> TwoGpus() {
  auto m = Metrics::Create(
      {{0, kUuid0, int64_t{80} << 30}, {1, kUuid1, int64_t{40} << 30}}, "1.2.3",
      "sim");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

}  // namespace deltad::daemon::metrics_testing

#endif  // DELTAD_TESTS_UNIT_DAEMON_METRICS_TEST_UTIL_H_
