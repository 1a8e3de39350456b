#include "policies/sim/policy_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/dynamic_policy.h"
#include "policies/sim/static_policies.h"
#include "policies/sim/steady_state_policy.h"

namespace deltad::sim {

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names = {
      "none",        "dtr",   "dtr-sampled",  "swap-lru",
      "delta-paper", "delta", "delta-replay", "delta-steady"};
  for (const std::string& s : StaticPolicyNames()) names.push_back(s);
  return names;
}

int IterationsFor(absl::string_view name) {
  if (name == "delta-replay") return 2;
  // Measured in the iteration its plans are judged by.
  if (name == "delta-steady") return SteadyStatePolicy::kReplayIterations;
  return 1;
}

absl::StatusOr<std::unique_ptr<SimPolicy>> MakePolicy(absl::string_view name) {
  if (name == "none") return std::make_unique<NoReleasePolicy>();
  if (name == "delta-steady") return std::make_unique<SteadyStatePolicy>();
  if (auto preset = DynamicPolicyPreset(std::string(name))) {
    return std::make_unique<DynamicPolicy>(std::move(*preset));
  }
  for (const std::string& s : StaticPolicyNames()) {
    if (s == name) return MakeStaticPolicy(name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name, "'; expected one of ",
                   absl::StrJoin(PolicyNames(), ", ")));
}

}  // namespace deltad::sim
