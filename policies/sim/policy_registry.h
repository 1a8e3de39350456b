#ifndef DELTAD_POLICIES_SIM_POLICY_REGISTRY_H_
#define DELTAD_POLICIES_SIM_POLICY_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/sim/simulator.h"

namespace deltad::sim {

// Every policy and baseline the simulator can run, by name, in the order
// the bench prints them.
std::vector<std::string> PolicyNames();

// How many iterations a policy needs to run to be measured (replay plans
// learn the order in the first).
int IterationsFor(absl::string_view name);

absl::StatusOr<std::unique_ptr<SimPolicy>> MakePolicy(absl::string_view name);

// `none`: releases nothing. Run with unlimited memory it gives the peak and
// the ideal time; under a smaller budget it does not fit.
class NoReleasePolicy final : public SimPolicy {
 public:
  std::string name() const override { return "none"; }
  bool MakeRoom(SimContext&, int64_t) override { return false; }
  bool FreesRanges() const override { return false; }  // no manager
};

}  // namespace deltad::sim

#endif  // DELTAD_POLICIES_SIM_POLICY_REGISTRY_H_
