#include "daemon/backend/cuda_backend.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <limits>
#include <memory>
#include <regex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda_driver.h"
#include "gtest/gtest.h"

namespace deltad::daemon {
namespace {

using common::CudaDriver;

constexpr int64_t kMiB = int64_t{1} << 20;

bool FdIsOpen(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

bool SaysNoDriverOrGpu(const absl::Status& s) {
  const std::string m(s.message());
  return m.find("driver") != std::string::npos ||
         m.find("GPU") != std::string::npos;
}

// Skips the test where CUDA is unusable (no driver, no GPU), naming why.
#define SKIP_WITHOUT_GPU()                                          \
  do {                                                              \
    const std::string reason = CudaBackend::ProbeCuda();            \
    if (!reason.empty()) GTEST_SKIP() << "no CUDA GPU: " << reason; \
  } while (0)

// A backend with a quick probe; the tests that check bandwidth ask for
// the default one.
std::unique_ptr<CudaBackend> Make(CudaBackendOptions options = {
                                      .measure_bandwidth = false}) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create(std::move(options));
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

TEST(CudaBackendTest, WithoutCudaEverythingFailsCleanly) {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (driver.ok()) GTEST_SKIP() << "CUDA is usable here";
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kFailedPrecondition)
      << driver.status();
  EXPECT_TRUE(SaysNoDriverOrGpu(driver.status())) << driver.status();
  // One line, for a log.
  EXPECT_EQ(std::string(driver.status().message()).find('\n'),
            std::string::npos);
  // Cached: the same answer, failure included.
  EXPECT_EQ(CudaDriver::Get().status(), driver.status());
  EXPECT_EQ(CudaBackend::ProbeCuda(), driver.status().message());

  absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
      CudaBackend::Create({});
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(SaysNoDriverOrGpu(backend.status())) << backend.status();

  absl::StatusOr<common::PrimaryContext> context =
      common::PrimaryContext::Retain(0);
  ASSERT_FALSE(context.ok());
  EXPECT_EQ(context.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CudaBackendTest, RejectsBadOptionsWithOrWithoutCuda) {
  for (CudaBackendOptions o : {
           CudaBackendOptions{.chunk_bytes = -1},
           CudaBackendOptions{.bandwidth_probe_bytes = 0},
           CudaBackendOptions{.fallback_bytes_per_s = 0},
           CudaBackendOptions{.fallback_bytes_per_s =
                                  std::numeric_limits<double>::infinity()},
       }) {
    absl::StatusOr<std::unique_ptr<CudaBackend>> backend =
        CudaBackend::Create(o);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument)
        << backend.status();
  }
}

TEST(CudaBackendTest, CheckHelpersFormatErrors) {
  EXPECT_TRUE(common::CudaRtCheck(cudaSuccess, "x").ok());
  const absl::Status oom =
      common::CudaRtCheck(cudaErrorMemoryAllocation, "cudaMalloc of 1 byte");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(oom.message())
                .rfind("cudaMalloc of 1 byte: "
                       "cudaErrorMemoryAllocation (",
                       0),
            0u)
      << oom;
  EXPECT_EQ(common::CudaRtCheck(cudaErrorInsufficientDriver, "x").code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CudaBackendTest, FormatsUuidsAsNvidiaSmi) {
  CUuuid uuid{};
  for (int i = 0; i < 16; ++i) uuid.bytes[i] = static_cast<char>(0xa0 + i);
  EXPECT_EQ(common::FormatGpuUuid(uuid),
            "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf");
}

TEST(CudaBackendTest, DiscoversEveryGpu) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaBackend> backend = Make({});  // measures bandwidth
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), "cuda");
  ASSERT_FALSE(backend->gpus().empty());
  const std::regex uuid(
      "GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
      "[0-9a-f]{12}");
  const std::regex bus("[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\\.[0-9A-F]");
  for (size_t i = 0; i < backend->gpus().size(); ++i) {
    const GpuInfo& g = backend->gpus()[i];
    SCOPED_TRACE(g.name);
    EXPECT_EQ(g.index, static_cast<int>(i));
    EXPECT_FALSE(g.name.empty());
    EXPECT_TRUE(std::regex_match(g.uuid, uuid)) << g.uuid;
    EXPECT_TRUE(std::regex_match(g.pci_bus_id, bus)) << g.pci_bus_id;
    EXPECT_GE(g.numa_node, -1);
    EXPECT_GT(g.memory_bytes, 0);
    EXPECT_GT(g.chunk_granularity, 0);
    EXPECT_EQ(g.chunk_granularity % 4096, 0);
    // Any real host link moves more than 1 GB/s.
    EXPECT_GT(g.d2h_bytes_per_s, 1e9);
    EXPECT_GT(g.h2d_bytes_per_s, 1e9);
    EXPECT_EQ(backend->allocated_bytes(static_cast<int>(i)), 0);
  }
  for (const std::string& note : backend->notes()) ADD_FAILURE() << note;
}

TEST(CudaBackendTest, FallbackBandwidthWhenNotMeasured) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaBackend> backend =
      Make({.measure_bandwidth = false, .fallback_bytes_per_s = 12.5e9});
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->gpus()[0].d2h_bytes_per_s, 12.5e9);
  EXPECT_EQ(backend->gpus()[0].h2d_bytes_per_s, 12.5e9);
}

TEST(CudaBackendTest, ChunkSizeIsAMultipleOfTheGranularity) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaBackend> minimum = Make();
  ASSERT_NE(minimum, nullptr);
  const int64_t g = minimum->gpus()[0].chunk_granularity;
  std::unique_ptr<CudaBackend> rounded =
      Make({.chunk_bytes = g + 1, .measure_bandwidth = false});
  ASSERT_NE(rounded, nullptr);
  EXPECT_EQ(rounded->gpus()[0].chunk_granularity, 2 * g);
  std::unique_ptr<CudaBackend> exact =
      Make({.chunk_bytes = 4 * g, .measure_bandwidth = false});
  ASSERT_NE(exact, nullptr);
  EXPECT_EQ(exact->gpus()[0].chunk_granularity, 4 * g);

  absl::StatusOr<std::unique_ptr<CudaBackend>> huge =
      CudaBackend::Create({.chunk_bytes = minimum->gpus()[0].memory_bytes + 1,
                           .measure_bandwidth = false});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaBackendTest, CreatesAndReleasesChunks) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaBackend> backend = Make();
  ASSERT_NE(backend, nullptr);
  const int64_t g = backend->gpus()[0].chunk_granularity;

  absl::StatusOr<DeviceChunk> a = backend->CreateChunk(0, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_NE(a->id, 0u);
  EXPECT_EQ(a->gpu, 0);
  EXPECT_EQ(a->bytes, g);
  ASSERT_GE(a->fd, 0);
  EXPECT_TRUE(fcntl(a->fd, F_GETFD) & FD_CLOEXEC);
  EXPECT_EQ(backend->allocated_bytes(0), g);

  absl::StatusOr<DeviceChunk> b = backend->CreateChunk(0, 3 * g - 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(b->id, a->id);
  EXPECT_EQ(b->bytes, 3 * g);
  EXPECT_EQ(backend->allocated_bytes(0), 4 * g);

  const int fd = a->fd;
  EXPECT_TRUE(backend->ReleaseChunk(a->id).ok());
  EXPECT_FALSE(FdIsOpen(fd));
  EXPECT_EQ(backend->allocated_bytes(0), 3 * g);
  EXPECT_EQ(backend->ReleaseChunk(a->id).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(backend->ReleaseChunk(b->id).ok());
  EXPECT_EQ(backend->allocated_bytes(0), 0);
  // The destructor releases what is left.
  ASSERT_TRUE(backend->CreateChunk(0, g).ok());
}

TEST(CudaBackendTest, RefusesWhatDoesNotFit) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<CudaBackend> backend = Make();
  ASSERT_NE(backend, nullptr);
  const GpuInfo& g = backend->gpus()[0];
  absl::StatusOr<DeviceChunk> too_big =
      backend->CreateChunk(0, g.memory_bytes + 1);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted)
      << too_big.status();
  absl::StatusOr<DeviceChunk> way_too_big = backend->CreateChunk(0, INT64_MAX);
  ASSERT_FALSE(way_too_big.ok());
  EXPECT_EQ(way_too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(backend->allocated_bytes(0), 0);

  EXPECT_EQ(backend->CreateChunk(0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int n = static_cast<int>(backend->gpus().size());
  EXPECT_EQ(backend->CreateChunk(n, kMiB).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->CreateChunk(-1, kMiB).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->allocated_bytes(n), 0);
}

}  // namespace
}  // namespace deltad::daemon
