#include "client/cuda_device.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cuda_chunk_mapper.h"
#include "common/cuda_driver.h"
#include "common/cuda_spin_kernel.h"
#include "gtest/gtest.h"

namespace deltad::client {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Skips the test where CUDA is unusable (no driver, no GPU), naming why.
#define SKIP_WITHOUT_GPU()                                          \
  do {                                                              \
    absl::StatusOr<const common::CudaDriver*> driver =              \
        common::CudaDriver::Get();                                  \
    if (!driver.ok()) {                                             \
      GTEST_SKIP() << "no CUDA GPU: " << driver.status().message(); \
    }                                                               \
  } while (0)

std::vector<unsigned char> RandomBytes(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(static_cast<size_t>(n));
  for (unsigned char& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

// A device with `bytes` of local chunks.
std::unique_ptr<CudaDevice> Make(int64_t bytes) {
  absl::StatusOr<std::unique_ptr<CudaDevice>> device = CudaDevice::Create(0);
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return nullptr;
  const absl::Status added = (*device)->AddLocalChunks(bytes);
  EXPECT_TRUE(added.ok()) << added;
  return added.ok() ? *std::move(device) : nullptr;
}

TEST(CudaDeviceTest, WithoutCudaCreateFailsCleanly) {
  absl::StatusOr<const common::CudaDriver*> driver = common::CudaDriver::Get();
  if (driver.ok()) GTEST_SKIP() << "CUDA is usable here";
  absl::StatusOr<std::unique_ptr<CudaDevice>> device = CudaDevice::Create(0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device.status(), driver.status());
  absl::StatusOr<std::unique_ptr<CudaChunkMapper>> mapper =
      CudaChunkMapper::Create(0);
  ASSERT_FALSE(mapper.ok());
  EXPECT_EQ(mapper.status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::unique_ptr<common::SpinKernel>> spin =
      common::SpinKernel::Load(0);
  ASSERT_FALSE(spin.ok());
  EXPECT_EQ(spin.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CudaDeviceTest, RejectsUnknownOrdinals) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  for (int ordinal : {-1, count}) {
    absl::StatusOr<std::unique_ptr<CudaDevice>> device =
        CudaDevice::Create(ordinal);
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument)
        << device.status();
  }
}

TEST(CudaDeviceTest, DescribesItsGpu) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<CudaDevice>> device = CudaDevice::Create(0);
  ASSERT_TRUE(device.ok()) << device.status();
  CudaDevice& d = **device;
  EXPECT_EQ(d.name(), "cuda");
  EXPECT_EQ(d.chunk_backend(), "cuda");
  EXPECT_EQ(d.ordinal(), 0);
  EXPECT_GT(d.memory_bytes(), 0);
  EXPECT_GT(d.chunk_granularity(), 0);
  EXPECT_TRUE(std::regex_match(
      d.uuid(), std::regex("GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-"
                           "[0-9a-f]{4}-[0-9a-f]{12}")))
      << d.uuid();
  EXPECT_EQ(d.arena(), nullptr);  // no chunk yet
  EXPECT_EQ(d.compute_stream(), nullptr);
  EXPECT_TRUE(d.last_error().ok());
  EXPECT_EQ(d.gpu_uuid(), d.uuid());
  EXPECT_EQ(ArenaDevice::kLocalChunkBytes % d.chunk_granularity(), 0);
}

TEST(CudaDeviceTest, CopiesRoundTrip) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaDevice> device = Make(64 * kMiB);
  ASSERT_NE(device, nullptr);
  ASSERT_NE(device->arena(), nullptr);
  EXPECT_GE(device->chunk_bytes_held(), 64 * kMiB);
  // Whole chunks and a piece of one.
  for (int64_t bytes : {int64_t{3} * kMiB + 5, int64_t{1000}}) {
    SCOPED_TRACE(bytes);
    absl::StatusOr<void*> p = device->Allocate(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    const std::vector<unsigned char> in = RandomBytes(bytes, 7);
    std::vector<unsigned char> out(in.size(), 0);
    device->CopyToDevice(*p, in.data(), bytes);
    device->CopyToHost(out.data(), *p, bytes);
    ASSERT_TRUE(device->last_error().ok()) << device->last_error();
    EXPECT_EQ(in, out);
    device->Free(*p, bytes);
  }
}

TEST(CudaDeviceTest, CopiesWithRegisteredHostMemory) {
  SKIP_WITHOUT_GPU();
  // Declared before the device, so that `out`, which the device's
  // destructor unregisters, is still allocated then.
  const int64_t bytes = 8 * kMiB;
  std::vector<unsigned char> in = RandomBytes(bytes, 11);
  std::vector<unsigned char> out(in.size(), 0);
  std::unique_ptr<CudaDevice> device = Make(16 * kMiB);
  ASSERT_NE(device, nullptr);
  ASSERT_TRUE(device->RegisterHost(in.data(), bytes).ok());
  ASSERT_TRUE(device->RegisterHost(in.data(), bytes).ok());  // once is enough
  ASSERT_TRUE(device->RegisterHost(out.data(), bytes).ok());
  absl::StatusOr<void*> p = device->Allocate(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  device->CopyToDevice(*p, in.data(), bytes);
  device->CopyToHost(out.data(), *p, bytes);
  ASSERT_TRUE(device->last_error().ok()) << device->last_error();
  EXPECT_EQ(in, out);
  device->UnregisterHost(in.data());
  device->UnregisterHost(in.data());  // unknown now: ignored
  device->Free(*p, bytes);
  // `out` stays registered; the destructor undoes it.
}

TEST(CudaDeviceTest, ArenaPointersWorkWithCudaMemcpy) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaDevice> device = Make(32 * kMiB);
  ASSERT_NE(device, nullptr);
  const int64_t bytes = 5 * kMiB + 123;
  absl::StatusOr<void*> a = device->Allocate(bytes);
  absl::StatusOr<void*> b = device->Allocate(bytes);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<unsigned char> in = RandomBytes(bytes, 3);
  std::vector<unsigned char> out(in.size(), 0);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(*a, in.data(), bytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(*b, *a, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), *b, bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(in, out);
  // And what cudaMemcpy wrote, CopyToHost reads.
  std::vector<unsigned char> again(in.size(), 0);
  device->CopyToHost(again.data(), *a, bytes);
  ASSERT_TRUE(device->last_error().ok()) << device->last_error();
  EXPECT_EQ(in, again);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, *a), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, 0);
  device->Free(*a, bytes);
  device->Free(*b, bytes);
}

// CopyToHost sees what work queued on the compute stream before it writes,
// even when that work is still running at the call.
TEST(CudaDeviceTest, CopyToHostWaitsForQueuedCompute) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaDevice> device = Make(8 * kMiB);
  ASSERT_NE(device, nullptr);
  absl::StatusOr<std::unique_ptr<common::SpinKernel>> spin =
      common::SpinKernel::Load(0);
  ASSERT_TRUE(spin.ok()) << spin.status();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
            cudaSuccess);
  device->SetComputeStream(compute);
  EXPECT_EQ(device->compute_stream(), compute);

  const int64_t bytes = 4 * kMiB;
  absl::StatusOr<void*> p = device->Allocate(bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(cudaMemset(*p, 0, bytes), cudaSuccess);
  // About 50 ms at 2 GHz: long enough that an unordered copy would read
  // the zeros.
  ASSERT_TRUE((*spin)->Launch(compute, int64_t{100'000'000}).ok());
  ASSERT_EQ(cudaMemsetAsync(*p, 0xab, bytes, compute), cudaSuccess);
  std::vector<unsigned char> out(static_cast<size_t>(bytes), 0);
  device->CopyToHost(out.data(), *p, bytes);
  ASSERT_TRUE(device->last_error().ok()) << device->last_error();
  EXPECT_EQ(out, std::vector<unsigned char>(out.size(), 0xab));

  // And compute work queued after CopyToDevice sees its bytes.
  const std::vector<unsigned char> in = RandomBytes(bytes, 5);
  absl::StatusOr<void*> q = device->Allocate(bytes);
  ASSERT_TRUE(q.ok()) << q.status();
  device->CopyToDevice(*q, in.data(), bytes);
  ASSERT_EQ(cudaMemcpyAsync(*p, *q, bytes, cudaMemcpyDeviceToDevice, compute),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  device->CopyToHost(out.data(), *p, bytes);
  ASSERT_TRUE(device->last_error().ok()) << device->last_error();
  EXPECT_EQ(out, in);

  device->SetComputeStream(nullptr);
  device->Free(*p, bytes);
  device->Free(*q, bytes);
  ASSERT_EQ(cudaStreamDestroy(compute), cudaSuccess);
}

TEST(CudaDeviceTest, BadCopiesRecordTheFirstError) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaDevice> device = Make(8 * kMiB);
  ASSERT_NE(device, nullptr);
  std::vector<unsigned char> host(16);
  device->CopyToHost(host.data(), host.data(), -1);
  const absl::Status first = device->last_error();
  EXPECT_EQ(first.code(), absl::StatusCode::kInvalidArgument);
  device->CopyToDevice(host.data(), host.data(), -2);
  EXPECT_EQ(device->last_error(), first);
}

}  // namespace
}  // namespace deltad::client
