// What the static plans know of a program: the saved activations.

#include "policies/sim/program_analysis.h"

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/sim/program.h"
#include "tests/unit/sim/static_policies_test_helpers.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAreArray;

int32_t StorageNamed(const Program& p, absl::string_view name) {
  for (size_t s = 0; s < p.storages.size(); ++s) {
    if (p.storages[s].name == name) return static_cast<int32_t>(s);
  }
  ADD_FAILURE() << "no storage " << name;
  return -1;
}

TEST(StaticPolicies, SavedActivationsAreForwardOutputsReadInBackward) {
  const Program p = Compiled(ConvChainTrace(3, 1000, 100, 400));
  std::vector<int32_t> expected;
  for (const char* name : {"c0", "r0", "c1", "r1", "c2", "r2", "loss"}) {
    expected.push_back(StorageNamed(p, name));
  }
  EXPECT_THAT(SavedActivations(p), ElementsAreArray(expected));
  // The last block's output is read by the loss only; the loss itself is
  // read again by its backward.
  const Program r = Compiled(ResidualTrace(2, 1000, 100));
  std::vector<int32_t> residual;
  for (const char* name : {"h0", "out0", "h1", "loss"}) {
    residual.push_back(StorageNamed(r, name));
  }
  EXPECT_THAT(SavedActivations(r), ElementsAreArray(residual));
}

}  // namespace
}  // namespace deltad::sim
