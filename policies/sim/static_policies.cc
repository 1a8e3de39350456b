#include "policies/sim/static_policies.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/sim/checkpoint_policies.h"
#include "policies/sim/swap_policies.h"

namespace deltad::sim {

std::vector<std::string> StaticPolicyNames() {
  return {"vdnn",      "lms",         "window",
          "chen-sqrt", "chen-greedy", "offload-greedy"};
}

absl::StatusOr<std::unique_ptr<SimPolicy>> MakeStaticPolicy(
    absl::string_view name) {
  if (std::unique_ptr<SimPolicy> swap = MakeSwapPolicy(name)) return swap;
  if (std::unique_ptr<SimPolicy> checkpoint = MakeCheckpointPolicy(name)) {
    return checkpoint;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown static policy '", name, "'; expected one of ",
                   absl::StrJoin(StaticPolicyNames(), ", ")));
}

}  // namespace deltad::sim
