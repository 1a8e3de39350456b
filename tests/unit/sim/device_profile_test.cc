#include "policies/sim/device_profile.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deltad::sim {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

DeviceProfile Get(const std::string& name) {
  absl::StatusOr<DeviceProfile> profile = FindDeviceProfile(name);
  EXPECT_TRUE(profile.ok()) << profile.status();
  return profile.ok() ? *profile : DeviceProfile{};
}

TEST(DeviceProfile, ListsTheFourDevices) {
  std::vector<std::string> names;
  for (const DeviceProfile& p : DeviceProfiles()) names.push_back(p.name);
  EXPECT_THAT(names,
              ElementsAre("titan-v", "v100-16gb", "a100-80gb", "h100-80gb"));
}

TEST(DeviceProfile, FindsEveryProfileByName) {
  for (const DeviceProfile& p : DeviceProfiles()) {
    const DeviceProfile found = Get(p.name);
    EXPECT_EQ(found.name, p.name);
    EXPECT_EQ(found.title, p.title);
    EXPECT_EQ(found.memory_bytes, p.memory_bytes);
    EXPECT_EQ(found.fp32_flops_per_s, p.fp32_flops_per_s);
  }
}

TEST(DeviceProfile, UnknownNameIsNotFoundAndListsTheKnownOnes) {
  const absl::StatusOr<DeviceProfile> p = FindDeviceProfile("rtx-9090");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(p.status().message(), HasSubstr("rtx-9090"));
  for (const DeviceProfile& known : DeviceProfiles()) {
    EXPECT_THAT(p.status().message(), HasSubstr(known.name));
  }
}

TEST(DeviceProfile, NamesAreCaseSensitive) {
  EXPECT_FALSE(FindDeviceProfile("A100-80GB").ok());
  EXPECT_FALSE(FindDeviceProfile("").ok());
}

TEST(DeviceProfile, EveryProfileIsCompleteAndCitesItsSources) {
  for (const DeviceProfile& p : DeviceProfiles()) {
    SCOPED_TRACE(p.name);
    EXPECT_FALSE(p.title.empty());
    EXPECT_GT(p.memory_bytes, 0);
    EXPECT_GT(p.h2d_bytes_per_s, 0);
    EXPECT_EQ(p.h2d_bytes_per_s, p.d2h_bytes_per_s);
    EXPECT_EQ(p.copy_engines, 2);
    // Tensor cores make half precision much faster on every one of them.
    EXPECT_GT(p.fp16_flops_per_s, 4 * p.fp32_flops_per_s);
    EXPECT_GT(p.memory_bytes_per_s, 0);
    EXPECT_THAT(p.source, HasSubstr("0.5"));
    EXPECT_THAT(p.source, HasSubstr("0.7"));
    EXPECT_THAT(p.source, HasSubstr("PCIe"));
    EXPECT_THAT(p.source, HasSubstr("effective"));
  }
}

TEST(DeviceProfile, MemoryIsWhatCudaReportsBelowTheMarketedCapacity) {
  EXPECT_EQ(Get("titan-v").memory_bytes, 12'618'104'832);
  EXPECT_EQ(Get("v100-16gb").memory_bytes, 16'911'433'728);
  EXPECT_EQ(Get("a100-80gb").memory_bytes, 84'987'740'160);
  EXPECT_EQ(Get("h100-80gb").memory_bytes, 85'017'755'648);
  for (const DeviceProfile& p : DeviceProfiles()) {
    SCOPED_TRACE(p.name);
    EXPECT_THAT(p.source, HasSubstr("deviceQuery"));
  }
}

TEST(DeviceProfile, UsableMemoryLeavesTheContextAndBlasWorkspaces) {
  // Eager module loading for the CUDA of the older cards' era, lazy for
  // the H100's (pytorch/pytorch#86509's measurements).
  EXPECT_EQ(Get("a100-80gb").context_bytes, 666'632'192);
  EXPECT_EQ(Get("h100-80gb").context_bytes, 287'047'680);
  // PyTorch's cuBLAS workspace defaults, and 1 MiB for cuBLASLt.
  EXPECT_EQ(Get("a100-80gb").blas_workspace_bytes, 8'519'680 + (1 << 20));
  EXPECT_EQ(Get("h100-80gb").blas_workspace_bytes, 33'554'432 + (1 << 20));
  for (const DeviceProfile& p : DeviceProfiles()) {
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.usable_bytes(),
              p.memory_bytes - p.context_bytes - p.blas_workspace_bytes);
    EXPECT_THAT(p.source, HasSubstr("pytorch/pytorch#86509"));
  }
}

TEST(DeviceProfile, HostLinksAreEffectivePcieRatesPerGeneration) {
  EXPECT_EQ(Get("titan-v").h2d_bytes_per_s, 12e9);    // PCIe 3.0 x16
  EXPECT_EQ(Get("v100-16gb").h2d_bytes_per_s, 12e9);  // PCIe 3.0 x16
  EXPECT_EQ(Get("a100-80gb").h2d_bytes_per_s, 25e9);  // PCIe 4.0 x16
  EXPECT_EQ(Get("h100-80gb").h2d_bytes_per_s, 50e9);  // PCIe 5.0 x16
}

TEST(DeviceProfile, RatesAreVendorPeaksTimesAchievedFractions) {
  struct Peak {
    const char* name;
    double fp32;
    double fp16;
    double bandwidth;
  };
  for (const Peak& peak : {Peak{"titan-v", 14.9e12, 110e12, 652.8e9},
                           Peak{"v100-16gb", 15.7e12, 125e12, 900e9},
                           Peak{"a100-80gb", 19.5e12, 312e12, 2039e9},
                           Peak{"h100-80gb", 67e12, 989e12, 3350e9}}) {
    SCOPED_TRACE(peak.name);
    const DeviceProfile p = Get(peak.name);
    EXPECT_DOUBLE_EQ(p.fp32_flops_per_s, peak.fp32 * 0.5);
    EXPECT_DOUBLE_EQ(p.fp16_flops_per_s, peak.fp16 * 0.5);
    EXPECT_DOUBLE_EQ(p.memory_bytes_per_s, peak.bandwidth * 0.7);
  }
}

TEST(DeviceProfile, NewerGenerationsAreFasterEverywhere) {
  const std::vector<std::string> order = {"v100-16gb", "a100-80gb",
                                          "h100-80gb"};
  for (size_t i = 1; i < order.size(); ++i) {
    const DeviceProfile older = Get(order[i - 1]);
    const DeviceProfile newer = Get(order[i]);
    EXPECT_GT(newer.fp32_flops_per_s, older.fp32_flops_per_s);
    EXPECT_GT(newer.fp16_flops_per_s, older.fp16_flops_per_s);
    EXPECT_GT(newer.memory_bytes_per_s, older.memory_bytes_per_s);
    EXPECT_GT(newer.h2d_bytes_per_s, older.h2d_bytes_per_s);
  }
}

}  // namespace
}  // namespace deltad::sim
