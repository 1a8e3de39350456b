#include "policies/sim/device_profile.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace deltad::sim {
namespace {

// Vendor peaks are never reached by whole layers: convolutions and GEMMs of
// real shapes sustain about half of the dense peak (tile quantisation, wave
// tails, cuDNN algorithm choice), and streaming kernels about 70% of the
// DRAM peak. One pair of fractions for every device keeps the profiles
// comparable; a measured profile would replace both.
constexpr double kDenseFraction = 0.5;
constexpr double kMemoryFraction = 0.7;

// Pinned cudaMemcpy over PCIe moves about 80% of the link rate left after
// line encoding: TLP headers, flow control and DMA descriptor traffic take
// the rest. Gen3 x16 is 15.75 GB/s after 128b/130b, Gen4 31.5, Gen5 63;
// bandwidthTest reports about 12, 25 and 50 GB/s on such hosts.
constexpr double kPcie3x16Effective = 12e9;
constexpr double kPcie4x16Effective = 25e9;
constexpr double kPcie5x16Effective = 50e9;

// The CUDA context of a PyTorch process, measured by PyTorch's developers
// when they made lazy module loading its default (pytorch/pytorch#86509,
// PyTorch 1.13, CUDA 11.7): 666,632,192 bytes with every module loaded at
// start (eager, as every CUDA before 11.7 does and 11.7-12.1 by default),
// 287,047,680 with CUDA_MODULE_LOADING=LAZY (the default from CUDA 12.2,
// CUDA Programming Guide, "Lazy Loading").
constexpr int64_t kEagerContext = 666'632'192;
constexpr int64_t kLazyContext = 287'047'680;

// PyTorch's cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp):
// CUBLAS_WORKSPACE_CONFIG defaults to ":4096:2:16:8" (2 x 4096 KiB + 8 x
// 16 KiB) before compute capability 9.0 and ":4096:8" from it, plus 1 MiB
// for cuBLASLt (CUBLASLT_WORKSPACE_SIZE).
constexpr int64_t kCublasLt = int64_t{1} << 20;
constexpr int64_t kBlasWorkspace = (4096 * 2 + 16 * 8) * 1024 + kCublasLt;
constexpr int64_t kBlasWorkspaceSm90 = 4096 * 8 * 1024 + kCublasLt;

constexpr char kCommonSource[] =
    "Sustained rates are vendor peaks times 0.5 for dense math and 0.7 for "
    "memory bandwidth (achieved fractions assumed for real layer shapes). "
    "Memory is the totalGlobalMem CUDA's deviceQuery reports for the card "
    "(the lowest of the public logs found); a PyTorch process first loses "
    "its CUDA context (666,632,192 bytes eager, 287,047,680 lazy: "
    "pytorch/pytorch#86509) and PyTorch's cuBLAS/cuBLASLt workspaces "
    "(CublasHandlePool.cpp defaults). Host link is effective pinned "
    "cudaMemcpy bandwidth, about 80% of the post-encoding PCIe rate. Copy "
    "engines: CUDA deviceQuery reports asyncEngineCount >= 2, so H2D and D2H "
    "overlap; modelled as 2.";

std::vector<DeviceProfile> MakeProfiles() {
  std::vector<DeviceProfile> profiles;
  profiles.push_back(DeviceProfile{
      .name = "titan-v",
      .title = "NVIDIA TITAN V 12GB (PCIe)",
      .memory_bytes = 12'618'104'832,
      .context_bytes = kEagerContext,
      .blas_workspace_bytes = kBlasWorkspace,
      .h2d_bytes_per_s = kPcie3x16Effective,
      .d2h_bytes_per_s = kPcie3x16Effective,
      .copy_engines = 2,
      .fp32_flops_per_s = 14.9e12 * kDenseFraction,
      .fp16_flops_per_s = 110e12 * kDenseFraction,
      .memory_bytes_per_s = 652.8e9 * kMemoryFraction,
      .source = absl::StrCat(
          "NVIDIA TITAN V product page: 12 GB HBM2, 652.8 GB/s, 14.9 TFLOPS "
          "fp32 (5120 cores at 1455 MHz boost), 110 TFLOPS tensor (fp16); "
          "PCIe 3.0 x16 host interface (12 GB/s effective). deviceQuery "
          "(CUDA 10.0): 12,618,104,832 bytes. The CUDA of its era (DTR's "
          "measurements, CUDA 10) loads modules eagerly. ",
          kCommonSource),
  });
  profiles.push_back(DeviceProfile{
      .name = "v100-16gb",
      .title = "NVIDIA Tesla V100 16GB (SXM2)",
      .memory_bytes = 16'911'433'728,
      .context_bytes = kEagerContext,
      .blas_workspace_bytes = kBlasWorkspace,
      .h2d_bytes_per_s = kPcie3x16Effective,
      .d2h_bytes_per_s = kPcie3x16Effective,
      .copy_engines = 2,
      .fp32_flops_per_s = 15.7e12 * kDenseFraction,
      .fp16_flops_per_s = 125e12 * kDenseFraction,
      .memory_bytes_per_s = 900e9 * kMemoryFraction,
      .source = absl::StrCat(
          "NVIDIA Tesla V100 datasheet (SXM2): 16 GB HBM2, 900 GB/s, 15.7 "
          "TFLOPS fp32, 125 TFLOPS tensor (fp16); the host link is PCIe 3.0 "
          "x16 (12 GB/s effective), NVLink only joins GPUs. deviceQuery "
          "(CUDA 10.2): 16,911,433,728 bytes; eager module loading. ",
          kCommonSource),
  });
  profiles.push_back(DeviceProfile{
      .name = "a100-80gb",
      .title = "NVIDIA A100 80GB SXM4",
      .memory_bytes = 84'987'740'160,
      .context_bytes = kEagerContext,
      .blas_workspace_bytes = kBlasWorkspace,
      .h2d_bytes_per_s = kPcie4x16Effective,
      .d2h_bytes_per_s = kPcie4x16Effective,
      .copy_engines = 2,
      .fp32_flops_per_s = 19.5e12 * kDenseFraction,
      .fp16_flops_per_s = 312e12 * kDenseFraction,
      .memory_bytes_per_s = 2039e9 * kMemoryFraction,
      .source = absl::StrCat(
          "NVIDIA A100 datasheet (80GB SXM4): 80 GB HBM2e, 2039 GB/s, 19.5 "
          "TFLOPS fp32, 312 TFLOPS fp16 tensor dense (624 with sparsity, not "
          "used); PCIe 4.0 x16 host interface (25 GB/s effective). "
          "deviceQuery (CUDA 12.1): 84,987,740,160 bytes. Eager module "
          "loading, as in the DELTA paper's runs (CUDA 11.2). ",
          kCommonSource),
  });
  profiles.push_back(DeviceProfile{
      .name = "h100-80gb",
      .title = "NVIDIA H100 80GB SXM5",
      .memory_bytes = 85'017'755'648,
      .context_bytes = kLazyContext,
      .blas_workspace_bytes = kBlasWorkspaceSm90,
      .h2d_bytes_per_s = kPcie5x16Effective,
      .d2h_bytes_per_s = kPcie5x16Effective,
      .copy_engines = 2,
      .fp32_flops_per_s = 67e12 * kDenseFraction,
      .fp16_flops_per_s = 989e12 * kDenseFraction,
      .memory_bytes_per_s = 3350e9 * kMemoryFraction,
      .source = absl::StrCat(
          "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 67 TFLOPS "
          "fp32, 989 TFLOPS fp16 tensor dense (1979 with sparsity, not used); "
          "PCIe 5.0 x16 host interface (50 GB/s effective). deviceQuery "
          "(CUDA 12.5): 85,017,755,648 bytes (torch_bench's H100 run read "
          "79.18 GiB). Lazy module loading (CUDA 12.2+), and the larger "
          "cuBLAS workspace PyTorch takes from compute capability 9.0. ",
          kCommonSource),
  });
  return profiles;
}

}  // namespace

const std::vector<DeviceProfile>& DeviceProfiles() {
  static const auto* const profiles =
      new std::vector<DeviceProfile>(MakeProfiles());
  return *profiles;
}

absl::StatusOr<DeviceProfile> FindDeviceProfile(absl::string_view name) {
  std::vector<absl::string_view> known;
  for (const DeviceProfile& profile : DeviceProfiles()) {
    if (profile.name == name) return profile;
    known.push_back(profile.name);
  }
  return absl::NotFoundError(
      absl::StrCat("unknown device profile '", name,
                   "'; known: ", absl::StrJoin(known, ", ")));
}

}  // namespace deltad::sim
