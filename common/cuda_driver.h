#ifndef DELTAD_COMMON_CUDA_DRIVER_H_
#define DELTAD_COMMON_CUDA_DRIVER_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unix_socket.h"

namespace deltad::common {

// The CUDA driver API functions this project calls, resolved at run time
// through the statically linked runtime's entry-point query
// (cudaGetDriverEntryPointByVersion) instead of by linking libcuda: the same
// binaries then start on machines without a driver, where Get() reports why
// CUDA is unusable instead of the dynamic loader refusing to run them.
//
// Each pointer is the ABI version named by its typedef's suffix (the one the
// query is asked for), so a newer driver cannot hand back a function with a
// different signature.
//
// Immutable after Get() built it: thread safe, shared by everyone in the
// process, never freed.
struct CudaDriver {
  // Driver and runtime versions, 1000 * major + 10 * minor (13000 is 13.0).
  int driver_version = 0;
  int runtime_version = 0;

  PFN_cuInit_v2000 cuInit = nullptr;
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;

  // Devices.
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetCount_v2000 cuDeviceGetCount = nullptr;
  PFN_cuDeviceGetName_v2000 cuDeviceGetName = nullptr;
  PFN_cuDeviceGetUuid_v11040 cuDeviceGetUuid = nullptr;  // cuDeviceGetUuid_v2
  PFN_cuDeviceTotalMem_v3020 cuDeviceTotalMem = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuDeviceGetPCIBusId_v4010 cuDeviceGetPCIBusId = nullptr;

  // Contexts. cuda.h renames cuCtxCreate and cuCtxDestroy to their newest
  // versions; these members are the CUDA 3.2/4.0 ABIs, which drivers keep
  // for old binaries. Both null if the driver lacks either: check first.
  PFN_cuCtxCreate_v3020 cuCtxCreate = nullptr;
  PFN_cuCtxDestroy_v4000 cuCtxDestroy = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 cuDevicePrimaryCtxRelease = nullptr;
  PFN_cuCtxSetCurrent_v4000 cuCtxSetCurrent = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuCtxSynchronize_v2000 cuCtxSynchronize = nullptr;
  PFN_cuMemGetInfo_v3020 cuMemGetInfo = nullptr;

  // Virtual memory management.
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity =
      nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle =
      nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle =
      nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;

  // Plain memory, streams and events: the cuda backend's bandwidth probe,
  // which runs in a context of its own that the runtime never sees.
  PFN_cuMemAllocHost_v3020 cuMemAllocHost = nullptr;
  PFN_cuMemFreeHost_v2000 cuMemFreeHost = nullptr;
  PFN_cuMemAlloc_v3020 cuMemAlloc = nullptr;
  PFN_cuMemFree_v3020 cuMemFree = nullptr;
  PFN_cuMemsetD8_v3020 cuMemsetD8 = nullptr;
  PFN_cuMemcpyHtoDAsync_v3020 cuMemcpyHtoDAsync = nullptr;
  PFN_cuMemcpyDtoHAsync_v3020 cuMemcpyDtoHAsync = nullptr;
  PFN_cuStreamCreate_v2000 cuStreamCreate = nullptr;
  PFN_cuStreamSynchronize_v2000 cuStreamSynchronize = nullptr;
  PFN_cuStreamDestroy_v4000 cuStreamDestroy = nullptr;
  PFN_cuEventCreate_v2000 cuEventCreate = nullptr;
  PFN_cuEventRecord_v2000 cuEventRecord = nullptr;
  PFN_cuEventSynchronize_v2000 cuEventSynchronize = nullptr;
  PFN_cuEventElapsedTime_v12080 cuEventElapsedTime = nullptr;
  PFN_cuEventDestroy_v4000 cuEventDestroy = nullptr;

  // Modules and launches (the spin kernel of the benchmarks).
  PFN_cuModuleLoadData_v2000 cuModuleLoadData = nullptr;
  PFN_cuModuleGetFunction_v2000 cuModuleGetFunction = nullptr;
  PFN_cuModuleUnload_v2000 cuModuleUnload = nullptr;
  PFN_cuLaunchKernel_v4000 cuLaunchKernel = nullptr;

  // The driver, loaded and initialised (cuInit(0)) on the first call; later
  // calls return the same result, failure included, at no cost. Thread safe.
  // FAILED_PRECONDITION, with a one-line reason, when CUDA is unusable: no
  // driver ("no CUDA driver: ..."), no GPU ("no CUDA GPU: ..."), a driver
  // older than the runtime, or one lacking a function above.
  static absl::StatusOr<const CudaDriver*> Get();

  // The number of devices the driver sees (CUDA_VISIBLE_DEVICES applies):
  // cuDeviceGetCount, its failure as CudaCheck says it.
  absl::StatusOr<int> DeviceCount() const;
};

// OK for CUDA_SUCCESS; otherwise "what: CUDA_ERROR_NAME (description)",
// with a code that says what kind of failure it is: RESOURCE_EXHAUSTED for
// out of memory, FAILED_PRECONDITION for a missing or unsupported driver or
// device, INVALID_ARGUMENT for invalid values, INTERNAL for the rest.
absl::Status CudaCheck(const CudaDriver& driver, CUresult result,
                       absl::string_view what);
// The same for the runtime API's errors: "what: cudaErrorName
// (description)".
absl::Status CudaRtCheck(cudaError_t error, absl::string_view what);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi and NVML print
// a GPU's UUID.
std::string FormatGpuUuid(const CUuuid& uuid);

// What every chunk is, wherever it is made (the daemon's backend, a client's
// local chunks): device memory of `device`, exportable as a POSIX fd. The
// granularity query must describe the same allocation as cuMemCreate.
CUmemAllocationProp ChunkProperties(CUdevice device);
// The minimum granularity of such allocations on `device`; `label` names
// the device in errors.
absl::StatusOr<int64_t> ChunkGranularity(const CudaDriver& driver,
                                         CUdevice device,
                                         absl::string_view label);
// `handle` exported as a close-on-exec POSIX fd, owned by the caller; the
// handle stays the caller's. `what` names the chunk in errors.
absl::StatusOr<UniqueFd> ExportChunk(const CudaDriver& driver,
                                     CUmemGenericAllocationHandle handle,
                                     absl::string_view what);

// A reference to a device's primary context (the one the runtime uses too),
// which keeps the context alive while the object lives. The driver keeps
// the current context per thread, so code that may run on any thread makes
// it current (ScopedContext, or MakeCurrent in threads of its own) before
// the calls that need one.
//
// Thread safe. Move-only.
class PrimaryContext {
 public:
  // Retains the context; the calling thread's current context is left as
  // it was. FAILED_PRECONDITION as CudaDriver::Get(); INVALID_ARGUMENT for
  // an ordinal no device has.
  static absl::StatusOr<PrimaryContext> Retain(int ordinal);

  PrimaryContext(PrimaryContext&& other) noexcept;
  PrimaryContext& operator=(PrimaryContext&& other) noexcept;
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  ~PrimaryContext();

  // Makes the context current in the calling thread, for good.
  absl::Status MakeCurrent() const;

  const CudaDriver& driver() const { return *driver_; }
  int ordinal() const { return ordinal_; }
  CUdevice device() const { return device_; }
  CUcontext context() const { return context_; }

 private:
  PrimaryContext(const CudaDriver* driver, int ordinal, CUdevice device,
                 CUcontext context)
      : driver_(driver),
        ordinal_(ordinal),
        device_(device),
        context_(context) {}

  const CudaDriver* driver_ = nullptr;
  int ordinal_ = 0;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;  // null once moved from
};

// Makes a primary context current in the calling thread for its scope and
// puts back the one that was current before, so that library code called
// from a framework's threads leaves their CUDA state as it found it. Costs
// one thread-local read when the context is current already.
//
// Not thread safe: one scope, one thread.
class ScopedContext {
 public:
  explicit ScopedContext(const PrimaryContext& context);
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ~ScopedContext();

  // Whether the context could be made current; check before the calls.
  const absl::Status& status() const { return status_; }

 private:
  const CudaDriver& driver_;
  CUcontext previous_ = nullptr;
  bool restore_ = false;
  absl::Status status_;
};

}  // namespace deltad::common

#endif  // DELTAD_COMMON_CUDA_DRIVER_H_
