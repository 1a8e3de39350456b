#include "common/cuda_driver.h"

#include <fcntl.h>

#include <cerrno>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace deltad::common {
namespace {

std::string VersionString(int version) {
  return absl::StrCat(version / 1000, ".", version % 1000 / 10);
}

std::string RtErrorText(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error),
                      ")");
}

// Resolves one driver function at the ABI version `version` (the suffix of
// the typedef the caller casts to). A null pointer with cudaSuccess means
// the driver has no such function at that version.
template <typename Fn>
absl::Status Resolve(const char* symbol, unsigned int version, int driver,
                     Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error = cudaGetDriverEntryPointByVersion(
      symbol, &fn, version, cudaEnableDefault, &found);
  if (error != cudaSuccess || fn == nullptr ||
      found != cudaDriverEntryPointSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA driver ", VersionString(driver), " has no ", symbol,
        " (ABI of CUDA ", VersionString(static_cast<int>(version)), ")",
        error != cudaSuccess ? absl::StrCat(": ", RtErrorText(error)) : ""));
  }
  *out = reinterpret_cast<Fn>(fn);
  return absl::OkStatus();
}

absl::StatusOr<const CudaDriver*> Load() {
  auto d = std::make_unique<CudaDriver>();
  // cudaDriverGetVersion succeeds without a driver and reports 0: the one
  // way to tell "no driver" apart from "a driver too old for this runtime",
  // which the other calls both report as cudaErrorInsufficientDriver.
  if (cudaError_t e = cudaDriverGetVersion(&d->driver_version);
      e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA driver: cudaDriverGetVersion: ", RtErrorText(e)));
  }
  if (d->driver_version == 0) {
    return absl::FailedPreconditionError(
        "no CUDA driver: libcuda.so.1 cannot be loaded (no NVIDIA driver "
        "installed, or not made visible to this container)");
  }
  (void)cudaRuntimeGetVersion(&d->runtime_version);
  // Initialises the runtime without creating a context, and says whether
  // any device is visible (CUDA_VISIBLE_DEVICES applies).
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    if (e == cudaErrorNoDevice) {
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA GPU: ", cudaGetErrorString(e)));
    }
    if (e == cudaErrorInsufficientDriver) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no usable CUDA driver: driver ", VersionString(d->driver_version),
          " is older than the CUDA ", VersionString(d->runtime_version),
          " runtime deltad is built with (", cudaGetErrorString(e), ")"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA is unusable: cudaGetDeviceCount: ", RtErrorText(e)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "no CUDA GPU: the driver reports no device");
  }

  const int v = d->driver_version;
  // `#name` is the base name the query wants; the member and the typedef
  // come from the same token, so cuda.h's `#define cuMemGetInfo
  // cuMemGetInfo_v2` style aliases rename both alike.
#define DELTAD_RESOLVE(name, version)                                   \
  if (absl::Status s = Resolve(#name, version, v, &d->name); !s.ok()) { \
    return s;                                                           \
  }
  DELTAD_RESOLVE(cuInit, 2000)
  DELTAD_RESOLVE(cuGetErrorName, 6000)
  DELTAD_RESOLVE(cuGetErrorString, 6000)
  DELTAD_RESOLVE(cuDeviceGet, 2000)
  DELTAD_RESOLVE(cuDeviceGetCount, 2000)
  DELTAD_RESOLVE(cuDeviceGetName, 2000)
  DELTAD_RESOLVE(cuDeviceGetUuid, 11040)
  DELTAD_RESOLVE(cuDeviceTotalMem, 3020)
  DELTAD_RESOLVE(cuDeviceGetAttribute, 2000)
  DELTAD_RESOLVE(cuDeviceGetPCIBusId, 4010)
  DELTAD_RESOLVE(cuDevicePrimaryCtxRetain, 7000)
  DELTAD_RESOLVE(cuDevicePrimaryCtxRelease, 11000)
  DELTAD_RESOLVE(cuCtxSetCurrent, 4000)
  DELTAD_RESOLVE(cuCtxGetCurrent, 4000)
  DELTAD_RESOLVE(cuCtxSynchronize, 2000)
  DELTAD_RESOLVE(cuMemGetInfo, 3020)
  DELTAD_RESOLVE(cuMemGetAllocationGranularity, 10020)
  DELTAD_RESOLVE(cuMemCreate, 10020)
  DELTAD_RESOLVE(cuMemRelease, 10020)
  DELTAD_RESOLVE(cuMemExportToShareableHandle, 10020)
  DELTAD_RESOLVE(cuMemImportFromShareableHandle, 10020)
  DELTAD_RESOLVE(cuMemAddressReserve, 10020)
  DELTAD_RESOLVE(cuMemAddressFree, 10020)
  DELTAD_RESOLVE(cuMemMap, 10020)
  DELTAD_RESOLVE(cuMemUnmap, 10020)
  DELTAD_RESOLVE(cuMemSetAccess, 10020)
  DELTAD_RESOLVE(cuMemAllocHost, 3020)
  DELTAD_RESOLVE(cuMemFreeHost, 2000)
  DELTAD_RESOLVE(cuMemAlloc, 3020)
  DELTAD_RESOLVE(cuMemFree, 3020)
  DELTAD_RESOLVE(cuMemsetD8, 3020)
  DELTAD_RESOLVE(cuMemcpyHtoDAsync, 3020)
  DELTAD_RESOLVE(cuMemcpyDtoHAsync, 3020)
  DELTAD_RESOLVE(cuStreamCreate, 2000)
  DELTAD_RESOLVE(cuStreamSynchronize, 2000)
  DELTAD_RESOLVE(cuStreamDestroy, 4000)
  DELTAD_RESOLVE(cuEventCreate, 2000)
  DELTAD_RESOLVE(cuEventRecord, 2000)
  DELTAD_RESOLVE(cuEventSynchronize, 2000)
  DELTAD_RESOLVE(cuEventElapsedTime, 12080)
  DELTAD_RESOLVE(cuEventDestroy, 4000)
  DELTAD_RESOLVE(cuModuleLoadData, 2000)
  DELTAD_RESOLVE(cuModuleGetFunction, 2000)
  DELTAD_RESOLVE(cuModuleUnload, 2000)
  DELTAD_RESOLVE(cuLaunchKernel, 4000)
#undef DELTAD_RESOLVE
  // Optional: only the cuda backend's bandwidth probe uses them, and it
  // falls back to an assumed bandwidth without them.
  if (!Resolve("cuCtxCreate", 3020, v, &d->cuCtxCreate).ok() ||
      !Resolve("cuCtxDestroy", 4000, v, &d->cuCtxDestroy).ok()) {
    d->cuCtxCreate = nullptr;
    d->cuCtxDestroy = nullptr;
  }

  if (CUresult r = d->cuInit(0); r != CUDA_SUCCESS) {
    absl::Status s = CudaCheck(*d, r, "cuInit");
    if (r == CUDA_ERROR_NO_DEVICE) {
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA GPU: ", s.message()));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA is unusable: ", s.message()));
  }
  return d.release();
}

absl::StatusCode CodeFor(CUresult result) {
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return absl::StatusCode::kFailedPrecondition;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_INVALID_HANDLE:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CodeFor(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorCudartUnloading:
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::StatusOr<const CudaDriver*> CudaDriver::Get() {
  // A function-local static: initialised once, under the compiler's guard,
  // however many threads ask first. Never freed, so it is still valid for
  // code that runs during exit.
  static const auto* const kDriver =
      new absl::StatusOr<const CudaDriver*>(Load());
  return *kDriver;
}

absl::StatusOr<int> CudaDriver::DeviceCount() const {
  int count = 0;
  if (absl::Status s =
          CudaCheck(*this, cuDeviceGetCount(&count), "cuDeviceGetCount");
      !s.ok()) {
    return s;
  }
  return count;
}

absl::Status CudaCheck(const CudaDriver& driver, CUresult result,
                       absl::string_view what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* description = nullptr;
  if (driver.cuGetErrorName == nullptr ||
      driver.cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "CUDA_ERROR_UNKNOWN";
  }
  if (driver.cuGetErrorString == nullptr ||
      driver.cuGetErrorString(result, &description) != CUDA_SUCCESS ||
      description == nullptr) {
    description = "unrecognised error code";
  }
  return absl::Status(CodeFor(result),
                      absl::StrCat(what, ": ", name, " (", description,
                                   ", code ", static_cast<int>(result), ")"));
}

absl::Status CudaRtCheck(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(CodeFor(error),
                      absl::StrCat(what, ": ", RtErrorText(error)));
}

CUmemAllocationProp ChunkProperties(CUdevice device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

absl::StatusOr<int64_t> ChunkGranularity(const CudaDriver& d, CUdevice device,
                                         absl::string_view label) {
  const CUmemAllocationProp prop = ChunkProperties(device);
  size_t granularity = 0;
  if (absl::Status s =
          CudaCheck(d,
                    d.cuMemGetAllocationGranularity(
                        &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                    absl::StrCat("allocation granularity of ", label));
      !s.ok()) {
    return s;
  }
  if (granularity == 0) {
    return absl::InternalError(
        absl::StrCat(label, " reports an allocation granularity of 0"));
  }
  return static_cast<int64_t>(granularity);
}

absl::StatusOr<UniqueFd> ExportChunk(const CudaDriver& d,
                                     CUmemGenericAllocationHandle handle,
                                     absl::string_view what) {
  int fd = -1;
  if (absl::Status s = CudaCheck(
          d,
          d.cuMemExportToShareableHandle(
              &fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          absl::StrCat("exporting ", what, " as a file descriptor"));
      !s.ok()) {
    return s;
  }
  UniqueFd owned(fd);
  // Not inherited by anything the process execs; the chunk's holders get
  // their copies over the side socket.
  const int flags = fcntl(fd, F_GETFD);
  if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("setting FD_CLOEXEC on the fd of ", what));
  }
  return owned;
}

std::string FormatGpuUuid(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
      "%02x%02x%02x%02x%02x%02x",
      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
      b[12], b[13], b[14], b[15]);
}

absl::StatusOr<PrimaryContext> PrimaryContext::Retain(int ordinal) {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  const CudaDriver& d = **driver;
  absl::StatusOr<int> count = d.DeviceCount();
  if (!count.ok()) return count.status();
  if (ordinal < 0 || ordinal >= *count) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device with ordinal ", ordinal, "; ", *count,
                     " visible (0-", *count - 1, ")"));
  }
  CUdevice device = 0;
  if (absl::Status s = CudaCheck(d, d.cuDeviceGet(&device, ordinal),
                                 absl::StrCat("cuDeviceGet(", ordinal, ")"));
      !s.ok()) {
    return s;
  }
  CUcontext context = nullptr;
  if (absl::Status s = CudaCheck(
          d, d.cuDevicePrimaryCtxRetain(&context, device),
          absl::StrCat("retaining the primary context of CUDA device ",
                       ordinal));
      !s.ok()) {
    return s;
  }
  return PrimaryContext(&d, ordinal, device, context);
}

PrimaryContext::PrimaryContext(PrimaryContext&& other) noexcept
    : driver_(other.driver_),
      ordinal_(other.ordinal_),
      device_(other.device_),
      context_(std::exchange(other.context_, nullptr)) {}

PrimaryContext& PrimaryContext::operator=(PrimaryContext&& other) noexcept {
  if (this != &other) {
    if (context_ != nullptr) (void)driver_->cuDevicePrimaryCtxRelease(device_);
    driver_ = other.driver_;
    ordinal_ = other.ordinal_;
    device_ = other.device_;
    context_ = std::exchange(other.context_, nullptr);
  }
  return *this;
}

PrimaryContext::~PrimaryContext() {
  // Fails only once the driver is torn down at exit, when there is nothing
  // left to release.
  if (context_ != nullptr) (void)driver_->cuDevicePrimaryCtxRelease(device_);
}

absl::Status PrimaryContext::MakeCurrent() const {
  if (context_ == nullptr) {
    return absl::FailedPreconditionError("primary context moved from");
  }
  return CudaCheck(*driver_, driver_->cuCtxSetCurrent(context_),
                   "making the primary context current");
}

ScopedContext::ScopedContext(const PrimaryContext& context)
    : driver_(context.driver()) {
  if (context.context() == nullptr) {
    status_ = absl::FailedPreconditionError("primary context moved from");
    return;
  }
  status_ = CudaCheck(driver_, driver_.cuCtxGetCurrent(&previous_),
                      "cuCtxGetCurrent");
  if (!status_.ok() || previous_ == context.context()) return;
  status_ = CudaCheck(driver_, driver_.cuCtxSetCurrent(context.context()),
                      absl::StrCat("making CUDA device ", context.ordinal(),
                                   "'s primary context current"));
  restore_ = status_.ok();
}

ScopedContext::~ScopedContext() {
  if (restore_) (void)driver_.cuCtxSetCurrent(previous_);
}

}  // namespace deltad::common
