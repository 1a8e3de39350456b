#include "client/cuda_chunk_mapper.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace deltad::client {
namespace {

using common::CudaCheck;
using common::CudaDriver;
using common::ScopedContext;

bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

absl::StatusOr<std::unique_ptr<CudaChunkMapper>> CudaChunkMapper::Create(
    int ordinal) {
  absl::StatusOr<common::PrimaryContext> context =
      common::PrimaryContext::Retain(ordinal);
  if (!context.ok()) return context.status();
  const CudaDriver& d = context->driver();
  int vmm = 0;
  if (absl::Status s = CudaCheck(
          d,
          d.cuDeviceGetAttribute(
              &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
              context->device()),
          absl::StrCat("virtual memory support of CUDA device ", ordinal));
      !s.ok()) {
    return s;
  }
  if (vmm == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", ordinal,
                     " does not support virtual memory management (cuMemMap), "
                     "which chunk mapping needs"));
  }
  absl::StatusOr<int64_t> granularity = common::ChunkGranularity(
      d, context->device(), absl::StrCat("CUDA device ", ordinal));
  if (!granularity.ok()) return granularity.status();
  return std::unique_ptr<CudaChunkMapper>(
      new CudaChunkMapper(std::move(*context), *granularity));
}

absl::StatusOr<uintptr_t> CudaChunkMapper::Reserve(int64_t bytes,
                                                   int64_t alignment) {
  if (bytes <= 0 || alignment <= 0 || bytes % granularity_ != 0 ||
      alignment % granularity_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reserving ", bytes, " bytes aligned to ", alignment,
                     ": both must be positive multiples of the ", granularity_,
                     "-byte granularity of CUDA device ", ordinal()));
  }
  const CudaDriver& d = context_.driver();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  // The driver takes only power-of-two alignments; for others, reserve
  // enough to cut an aligned range out of.
  const bool padded = !IsPowerOfTwo(alignment);
  const auto size = static_cast<size_t>(padded ? bytes + alignment : bytes);
  CUdeviceptr ptr = 0;
  if (absl::Status s = CudaCheck(
          d,
          d.cuMemAddressReserve(
              &ptr, size, padded ? 0 : static_cast<size_t>(alignment), 0, 0),
          absl::StrCat("cuMemAddressReserve of ", size,
                       " bytes of address space on CUDA device ", ordinal()));
      !s.ok()) {
    return s;
  }
  if (!padded) return static_cast<uintptr_t>(ptr);
  const auto a = static_cast<uintptr_t>(alignment);
  const uintptr_t base = (static_cast<uintptr_t>(ptr) + a - 1) / a * a;
  padded_[base] = {ptr, size};
  return base;
}

void CudaChunkMapper::Unreserve(uintptr_t base, int64_t bytes) {
  CUdeviceptr ptr = base;
  auto size = static_cast<size_t>(bytes);
  if (auto it = padded_.find(base); it != padded_.end()) {
    std::tie(ptr, size) = it->second;
    padded_.erase(it);
  }
  ScopedContext scope(context_);
  // Fails only for a range that was never reserved, or at exit once the
  // driver is gone; either way there is nothing left to free.
  if (scope.status().ok()) (void)context_.driver().cuMemAddressFree(ptr, size);
}

absl::StatusOr<uint64_t> CudaChunkMapper::Import(int fd, int64_t bytes) {
  if (fd < 0 || bytes <= 0 || bytes % granularity_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "importing a chunk of ", bytes, " bytes from fd ", fd,
        ": need a valid fd and a positive multiple of the ", granularity_,
        "-byte granularity of CUDA device ", ordinal()));
  }
  const CudaDriver& d = context_.driver();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  // The driver reads the fd and does not keep it: it stays the caller's.
  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status s = CudaCheck(
          d,
          d.cuMemImportFromShareableHandle(
              &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          absl::StrCat("cuMemImportFromShareableHandle of a ", bytes,
                       "-byte chunk (fd ", fd, ") on CUDA device ", ordinal()));
      !s.ok()) {
    return s;
  }
  return static_cast<uint64_t>(handle);
}

absl::Status CudaChunkMapper::Map(uint64_t handle, uintptr_t at,
                                  int64_t bytes) {
  const CudaDriver& d = context_.driver();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  const auto size = static_cast<size_t>(bytes);
  if (absl::Status s =
          CudaCheck(d, d.cuMemMap(at, size, 0, handle, 0),
                    absl::StrCat("cuMemMap of ", bytes, " bytes at 0x",
                                 absl::Hex(at), " on CUDA device ", ordinal()));
      !s.ok()) {
    return s;
  }
  // A mapping is inaccessible until access is granted, per device.
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = context_.device();
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (absl::Status s = CudaCheck(
          d, d.cuMemSetAccess(at, size, &access, 1),
          absl::StrCat("cuMemSetAccess (read-write) on ", bytes, " bytes at 0x",
                       absl::Hex(at), " on CUDA device ", ordinal()));
      !s.ok()) {
    (void)d.cuMemUnmap(at, size);
    return s;
  }
  return absl::OkStatus();
}

absl::Status CudaChunkMapper::Unmap(uintptr_t at, int64_t bytes) {
  const CudaDriver& d = context_.driver();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  // Unlike cudaFree, cuMemUnmap does not wait for the work queued on the
  // device, and PyTorch frees a block (to its cache, or to this allocator
  // under the global swap) while kernels that use it may still run: an
  // unmap under them is an illegal access, which ends the context. The
  // context (PyTorch's: the device's primary one) is synchronized first,
  // as PyTorch's own expandable segments do before unmapping. Unmaps are
  // rare: an emptied page or run is kept for the next allocation.
  if (absl::Status s =
          CudaCheck(d, d.cuCtxSynchronize(),
                    absl::StrCat("cuCtxSynchronize before unmapping ", bytes,
                                 " bytes at 0x", absl::Hex(at),
                                 " on CUDA device ", ordinal()));
      !s.ok()) {
    return s;
  }
  return CudaCheck(d, d.cuMemUnmap(at, static_cast<size_t>(bytes)),
                   absl::StrCat("cuMemUnmap of ", bytes, " bytes at 0x",
                                absl::Hex(at), " on CUDA device ", ordinal()));
}

void CudaChunkMapper::Release(uint64_t handle) {
  ScopedContext scope(context_);
  // Once the last mapping and handle are gone the memory returns to the
  // GPU, unless the daemon's copy of the fd still holds it.
  if (scope.status().ok()) (void)context_.driver().cuMemRelease(handle);
}

}  // namespace deltad::client
