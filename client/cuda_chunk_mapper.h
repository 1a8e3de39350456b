#ifndef DELTAD_CLIENT_CUDA_CHUNK_MAPPER_H_
#define DELTAD_CLIENT_CUDA_CHUNK_MAPPER_H_

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/chunk_mapper.h"
#include "common/cuda_driver.h"

namespace deltad::client {

// Maps CUDA chunks (cuMemCreate allocations exported as POSIX fds, by the
// daemon's cuda backend or by CudaDevice::CreateLocalChunk) into this
// process's unified address space on one device: Reserve and Unreserve are
// cuMemAddressReserve and cuMemAddressFree, Import is
// cuMemImportFromShareableHandle, Map is cuMemMap plus cuMemSetAccess
// (read-write for this device), Unmap cuMemUnmap, Release cuMemRelease.
// Mapped addresses are ordinary device pointers for kernels and cudaMemcpy.
//
// Every call makes the device's primary context current for its duration
// and restores the caller's, so it may run on any thread.
//
// Not thread safe (as ChunkMapper). Holds a reference to the device's
// primary context; the reservations and handles are its user's to undo.
class CudaChunkMapper final : public ChunkMapper {
 public:
  // FAILED_PRECONDITION without a driver or GPU, or when the device lacks
  // virtual memory management; INVALID_ARGUMENT for an unknown ordinal.
  static absl::StatusOr<std::unique_ptr<CudaChunkMapper>> Create(int ordinal);

  CudaChunkMapper(const CudaChunkMapper&) = delete;
  CudaChunkMapper& operator=(const CudaChunkMapper&) = delete;
  ~CudaChunkMapper() override = default;

  // `alignment` need not be a power of two; when it is not, a larger range
  // is reserved and the aligned part handed out.
  absl::StatusOr<uintptr_t> Reserve(int64_t bytes, int64_t alignment) override;
  void Unreserve(uintptr_t base, int64_t bytes) override;
  absl::StatusOr<uint64_t> Import(int fd, int64_t bytes) override;
  absl::Status Map(uint64_t handle, uintptr_t at, int64_t bytes) override;
  absl::Status Unmap(uintptr_t at, int64_t bytes) override;
  void Release(uint64_t handle) override;

  int ordinal() const { return context_.ordinal(); }
  // The mapping granularity of this device for fd-exportable allocations:
  // chunk sizes and mapped addresses are multiples of it.
  int64_t granularity() const { return granularity_; }
  const common::PrimaryContext& context() const { return context_; }

 private:
  CudaChunkMapper(common::PrimaryContext context, int64_t granularity)
      : context_(std::move(context)), granularity_(granularity) {}

  const common::PrimaryContext context_;
  const int64_t granularity_;
  // Over-reserved ranges, by the aligned base handed out: where the real
  // reservation starts and how long it is.
  std::unordered_map<uintptr_t, std::pair<CUdeviceptr, size_t>> padded_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_CUDA_CHUNK_MAPPER_H_
