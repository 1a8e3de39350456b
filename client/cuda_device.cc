#include "client/cuda_device.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cuda_chunk_mapper.h"

namespace deltad::client {
namespace {

using common::CudaCheck;
using common::CudaDriver;
using common::CudaRtCheck;
using common::ScopedContext;

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int ordinal) {
  absl::StatusOr<std::unique_ptr<CudaChunkMapper>> mapper =
      CudaChunkMapper::Create(ordinal);
  if (!mapper.ok()) return mapper.status();
  const int64_t granularity = (*mapper)->granularity();
  absl::StatusOr<common::PrimaryContext> context =
      common::PrimaryContext::Retain(ordinal);
  if (!context.ok()) return context.status();
  const CudaDriver& d = context->driver();
  ScopedContext scope(*context);
  if (!scope.status().ok()) return scope.status();

  size_t total = 0;
  if (absl::Status s =
          CudaCheck(d, d.cuDeviceTotalMem(&total, context->device()),
                    absl::StrCat("memory size of CUDA device ", ordinal));
      !s.ok()) {
    return s;
  }
  CUuuid uuid{};
  if (absl::Status s = CudaCheck(d, d.cuDeviceGetUuid(&uuid, context->device()),
                                 absl::StrCat("UUID of CUDA device ", ordinal));
      !s.ok()) {
    return s;
  }

  Streams streams;
  auto destroy = [&] {
    for (cudaEvent_t e :
         {streams.compute_ready, streams.d2h_done, streams.h2d_done}) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    for (cudaStream_t s : {streams.d2h, streams.h2d}) {
      if (s != nullptr) (void)cudaStreamDestroy(s);
    }
  };
  // Non-blocking: no implicit synchronisation with the legacy default
  // stream, which may be the compute stream; the events order them instead.
  for (cudaStream_t* s : {&streams.d2h, &streams.h2d}) {
    if (absl::Status st = CudaRtCheck(
            cudaStreamCreateWithFlags(s, cudaStreamNonBlocking),
            absl::StrCat("creating a copy stream on CUDA device ", ordinal));
        !st.ok()) {
      destroy();
      return st;
    }
  }
  for (cudaEvent_t* e :
       {&streams.compute_ready, &streams.d2h_done, &streams.h2d_done}) {
    if (absl::Status st = CudaRtCheck(
            cudaEventCreateWithFlags(e, cudaEventDisableTiming),
            absl::StrCat("creating a copy event on CUDA device ", ordinal));
        !st.ok()) {
      destroy();
      return st;
    }
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(
      std::move(*mapper), std::move(*context), static_cast<int64_t>(total),
      granularity, common::FormatGpuUuid(uuid), streams));
}

CudaDevice::CudaDevice(std::unique_ptr<ChunkMapper> mapper,
                       common::PrimaryContext context, int64_t memory_bytes,
                       int64_t granularity, std::string uuid, Streams streams)
    : ArenaDevice(std::move(mapper), memory_bytes),
      context_(std::move(context)),
      ordinal_(context_.ordinal()),
      memory_bytes_(memory_bytes),
      granularity_(granularity),
      uuid_(std::move(uuid)),
      streams_(streams) {}

CudaDevice::~CudaDevice() {
  // The arena (ArenaDevice's) is torn down after this, by its mapper, which
  // holds its own reference to the context. Errors here mean the driver is
  // already gone (exit), taking everything with it.
  ScopedContext scope(context_);
  if (!scope.status().ok()) return;
  for (cudaStream_t s : {streams_.d2h, streams_.h2d}) {
    (void)cudaStreamSynchronize(s);
  }
  for (cudaEvent_t e :
       {streams_.compute_ready, streams_.d2h_done, streams_.h2d_done}) {
    (void)cudaEventDestroy(e);
  }
  for (cudaStream_t s : {streams_.d2h, streams_.h2d}) {
    (void)cudaStreamDestroy(s);
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  for (const auto& [host, bytes] : registered_) {
    (void)cudaHostUnregister(host);
  }
}

void CudaDevice::RecordError(absl::Status status) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (error_.ok()) error_ = std::move(status);
}

absl::Status CudaDevice::last_error() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return error_;
}

void CudaDevice::SetComputeStream(void* stream) {
  compute_.store(static_cast<cudaStream_t>(stream));
}

void* CudaDevice::compute_stream() const { return compute_.load(); }

void CudaDevice::CopyToHost(void* host, const void* device, int64_t bytes) {
  if (bytes == 0) return;
  if (bytes < 0) {
    RecordError(absl::InvalidArgumentError(
        absl::StrCat("CopyToHost of a negative size: ", bytes, " bytes")));
    return;
  }
  std::lock_guard<std::mutex> lock(d2h_mu_);
  ScopedContext scope(context_);
  if (!scope.status().ok()) {
    RecordError(scope.status());
    return;
  }
  const cudaStream_t compute = compute_.load();
  const std::string what = absl::StrCat("CopyToHost of ", bytes, " bytes");
  // Each step runs only if the ones before succeeded.
  absl::Status s = CudaRtCheck(cudaEventRecord(streams_.compute_ready, compute),
                               what + ": recording on the compute stream");
  if (s.ok()) {
    s = CudaRtCheck(
        cudaStreamWaitEvent(streams_.d2h, streams_.compute_ready, 0),
        what + ": waiting for the compute stream");
  }
  if (s.ok()) {
    s = CudaRtCheck(cudaMemcpyAsync(host, device, static_cast<size_t>(bytes),
                                    cudaMemcpyDeviceToHost, streams_.d2h),
                    what + ": cudaMemcpyAsync");
  }
  if (s.ok()) {
    s = CudaRtCheck(cudaEventRecord(streams_.d2h_done, streams_.d2h),
                    what + ": recording the copy's end");
  }
  if (s.ok()) {
    s = CudaRtCheck(cudaEventSynchronize(streams_.d2h_done),
                    what + ": waiting for the copy");
  }
  if (!s.ok()) RecordError(std::move(s));
}

void CudaDevice::CopyToDevice(void* device, const void* host, int64_t bytes) {
  if (bytes == 0) return;
  if (bytes < 0) {
    RecordError(absl::InvalidArgumentError(
        absl::StrCat("CopyToDevice of a negative size: ", bytes, " bytes")));
    return;
  }
  std::lock_guard<std::mutex> lock(h2d_mu_);
  ScopedContext scope(context_);
  if (!scope.status().ok()) {
    RecordError(scope.status());
    return;
  }
  const std::string what = absl::StrCat("CopyToDevice of ", bytes, " bytes");
  absl::Status s =
      CudaRtCheck(cudaMemcpyAsync(device, host, static_cast<size_t>(bytes),
                                  cudaMemcpyHostToDevice, streams_.h2d),
                  what + ": cudaMemcpyAsync");
  if (s.ok()) {
    s = CudaRtCheck(cudaEventRecord(streams_.h2d_done, streams_.h2d),
                    what + ": recording the copy's end");
  }
  if (s.ok()) {
    // Compute work queued from now on starts after the copy, with no host
    // round trip in between.
    s = CudaRtCheck(cudaStreamWaitEvent(compute_.load(), streams_.h2d_done, 0),
                    what + ": ordering the compute stream after the copy");
  }
  if (s.ok()) {
    s = CudaRtCheck(cudaEventSynchronize(streams_.h2d_done),
                    what + ": waiting for the copy");
  }
  if (!s.ok()) RecordError(std::move(s));
}

absl::Status CudaDevice::RegisterHost(void* host, int64_t bytes) {
  if (host == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterHost needs a non-null region of positive size, got ", bytes,
        " bytes at 0x", absl::Hex(reinterpret_cast<uintptr_t>(host))));
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  if (registered_.contains(host)) return absl::OkStatus();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  if (absl::Status s = CudaRtCheck(
          cudaHostRegister(host, static_cast<size_t>(bytes),
                           cudaHostRegisterDefault),
          absl::StrCat("cudaHostRegister of ", bytes, " bytes at 0x",
                       absl::Hex(reinterpret_cast<uintptr_t>(host))));
      !s.ok()) {
    return s;
  }
  registered_.emplace(host, bytes);
  return absl::OkStatus();
}

void CudaDevice::UnregisterHost(void* host) {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (registered_.erase(host) == 0) return;
  ScopedContext scope(context_);
  if (scope.status().ok()) (void)cudaHostUnregister(host);
}

absl::StatusOr<common::UniqueFd> CudaDevice::CreateLocalChunk(int64_t bytes) {
  if (bytes <= 0 || bytes % granularity_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a local chunk must be a positive multiple of the ",
                     granularity_, "-byte granularity of CUDA device ",
                     ordinal_, ", got ", bytes, " bytes"));
  }
  const CudaDriver& d = context_.driver();
  ScopedContext scope(context_);
  if (!scope.status().ok()) return scope.status();
  const CUmemAllocationProp prop = common::ChunkProperties(context_.device());
  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status s = CudaCheck(
          d, d.cuMemCreate(&handle, static_cast<size_t>(bytes), &prop, 0),
          absl::StrCat("cuMemCreate of a ", bytes,
                       "-byte local chunk on CUDA device ", ordinal_));
      !s.ok()) {
    return s;
  }
  absl::StatusOr<common::UniqueFd> fd = common::ExportChunk(
      d, handle,
      absl::StrCat("a ", bytes, "-byte local chunk on CUDA device ", ordinal_));
  // The fd (when there is one) holds the allocation now; see the header.
  (void)d.cuMemRelease(handle);
  return fd;
}

}  // namespace deltad::client
