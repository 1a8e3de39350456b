#include "daemon/backend/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/backend/chunk_request.h"

namespace deltad::daemon {
namespace {

using common::CudaCheck;
using common::CudaDriver;

absl::Status ValidateOptions(const CudaBackendOptions& o) {
  if (o.chunk_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: chunk_bytes must be >= 0 (0 for the GPU's allocation "
        "granularity), got ",
        o.chunk_bytes));
  }
  if (o.measure_bandwidth && o.bandwidth_probe_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: bandwidth_probe_bytes must be positive, "
                     "got ",
                     o.bandwidth_probe_bytes));
  }
  // `!(value > 0)` also rejects NaN.
  if (!(o.fallback_bytes_per_s > 0) || !std::isfinite(o.fallback_bytes_per_s)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: fallback_bytes_per_s must be positive "
                     "and finite, got ",
                     o.fallback_bytes_per_s));
  }
  return absl::OkStatus();
}

// cuDeviceGetPCIBusId gives "dddd:bb:dd.f" (or a longer domain); nvidia-smi
// and NVML print "dddddddd:bb:dd.f" in upper case, sysfs "dddd:bb:dd.f" in
// lower case. Both forms of one address.
struct PciAddress {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
};

absl::StatusOr<PciAddress> ParsePciBusId(const std::string& id) {
  PciAddress a;
  char end = 0;
  if (std::sscanf(id.c_str(), "%x:%x:%x.%x%c", &a.domain, &a.bus, &a.device,
                  &a.function, &end) != 4) {
    return absl::InternalError(
        absl::StrCat("unexpected PCI bus id \"", id, "\" from the driver"));
  }
  return a;
}

std::string NvidiaSmiBusId(const PciAddress& a) {
  return absl::StrFormat("%08X:%02X:%02X.%X", a.domain, a.bus, a.device,
                         a.function);
}

// -1, as sysfs itself says, when the platform has no NUMA or the file is
// missing (a container without /sys).
int NumaNode(const PciAddress& a) {
  const std::string path =
      absl::StrFormat("/sys/bus/pci/devices/%04x:%02x:%02x.%x/numa_node",
                      a.domain, a.bus, a.device, a.function);
  std::ifstream in(path);
  int node = -1;
  if (!(in >> node) || node < -1) return -1;
  return node;
}

struct Bandwidth {
  double d2h = 0;
  double h2d = 0;
};

// The bandwidth probe's resources in its own context, freed (and the
// context destroyed, which pops it off this thread's stack) whichever way
// the probe ends.
class Probe {
 public:
  explicit Probe(const CudaDriver& d) : d_(d) {}
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;
  ~Probe() {
    if (context_ == nullptr) return;
    if (stream_ != nullptr) (void)d_.cuStreamSynchronize(stream_);
    if (start_ != nullptr) (void)d_.cuEventDestroy(start_);
    if (stop_ != nullptr) (void)d_.cuEventDestroy(stop_);
    if (stream_ != nullptr) (void)d_.cuStreamDestroy(stream_);
    if (device_ != 0) (void)d_.cuMemFree(device_);
    if (host_ != nullptr) (void)d_.cuMemFreeHost(host_);
    (void)d_.cuCtxDestroy(context_);
  }

  // Pinned copies of `bytes` each way: the best of 3 after a warm-up, each
  // timed by events on the GPU so that host scheduling does not count.
  absl::StatusOr<Bandwidth> Measure(CUdevice device, int64_t bytes) {
    if (d_.cuCtxCreate == nullptr || d_.cuCtxDestroy == nullptr) {
      return absl::FailedPreconditionError(
          "the driver offers no cuCtxCreate_v2/cuCtxDestroy_v2");
    }
    const auto size = static_cast<size_t>(bytes);
    for (auto [result, what] : {
             std::pair<std::function<CUresult()>, std::string>{
                 [&] { return d_.cuCtxCreate(&context_, 0, device); },
                 "creating a context for the probe"},
             {[&] { return d_.cuMemAllocHost(&host_, size); },
              absl::StrCat("cuMemAllocHost of ", bytes, " probe bytes")},
             {[&] { return d_.cuMemAlloc(&device_, size); },
              absl::StrCat("cuMemAlloc of ", bytes, " probe bytes")},
             // The contents do not matter; defined ones keep tools quiet.
             {[&] { return d_.cuMemsetD8(device_, 0, size); }, "cuMemsetD8"},
             {[&] {
                return d_.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
              },
              "cuStreamCreate"},
             {[&] { return d_.cuEventCreate(&start_, CU_EVENT_DEFAULT); },
              "cuEventCreate"},
             {[&] { return d_.cuEventCreate(&stop_, CU_EVENT_DEFAULT); },
              "cuEventCreate"},
         }) {
      if (absl::Status s = CudaCheck(d_, result(), what); !s.ok()) return s;
    }
    std::fill_n(static_cast<char*>(host_), size, 0);

    Bandwidth bandwidth;
    for (bool d2h : {true, false}) {
      double best = 0;
      for (int i = -1; i < 3; ++i) {  // -1: the warm-up
        absl::StatusOr<double> t = Seconds(d2h, size);
        if (!t.ok()) return t.status();
        if (i >= 0 && *t > 0 && (best == 0 || *t < best)) best = *t;
      }
      if (best <= 0) {
        return absl::InternalError("the probe copies took no measurable time");
      }
      (d2h ? bandwidth.d2h : bandwidth.h2d) = static_cast<double>(bytes) / best;
    }
    return bandwidth;
  }

 private:
  absl::StatusOr<double> Seconds(bool d2h, size_t size) {
    const char* copy = d2h ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
    for (auto [result, what] : {
             std::pair<std::function<CUresult()>, const char*>{
                 [&] { return d_.cuEventRecord(start_, stream_); },
                 "cuEventRecord"},
             {[&] {
                return d2h ? d_.cuMemcpyDtoHAsync(host_, device_, size, stream_)
                           : d_.cuMemcpyHtoDAsync(device_, host_, size,
                                                  stream_);
              },
              copy},
             {[&] { return d_.cuEventRecord(stop_, stream_); },
              "cuEventRecord"},
             {[&] { return d_.cuEventSynchronize(stop_); },
              "cuEventSynchronize"},
         }) {
      if (absl::Status s = CudaCheck(d_, result(), what); !s.ok()) return s;
    }
    float ms = 0;
    if (absl::Status s =
            CudaCheck(d_, d_.cuEventElapsedTime(&ms, start_, stop_),
                      "cuEventElapsedTime");
        !s.ok()) {
      return s;
    }
    return ms / 1e3;
  }

  const CudaDriver& d_;
  CUcontext context_ = nullptr;
  void* host_ = nullptr;
  CUdeviceptr device_ = 0;
  CUstream stream_ = nullptr;
  CUevent start_ = nullptr;
  CUevent stop_ = nullptr;
};

// In a context of its own, created here and destroyed after, through the
// driver API alone: the primary context (which the runtime would retain
// for the life of the process, with the hundreds of MiB of device memory
// a context costs, and which another runtime user in this process may
// share) is left alone, and the daemon keeps no context once Create
// returns.
absl::StatusOr<Bandwidth> ProbeGpu(const CudaDriver& d, CUdevice device,
                                   int64_t bytes) {
  Probe probe(d);
  return probe.Measure(device, bytes);
}

}  // namespace

std::string CudaBackend::ProbeCuda() {
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  return driver.ok() ? std::string() : std::string(driver.status().message());
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    CudaBackendOptions options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  const CudaDriver& d = **driver;
  absl::StatusOr<int> count = d.DeviceCount();
  if (!count.ok()) return count.status();
  if (*count <= 0) {
    return absl::FailedPreconditionError(
        "no CUDA GPU: the driver reports no device");
  }

  std::vector<GpuInfo> gpus;
  std::vector<CUdevice> devices;
  std::vector<std::string> notes;
  for (int i = 0; i < *count; ++i) {
    const std::string gpu = absl::StrCat("CUDA device ", i);
    CUdevice device = 0;
    if (absl::Status s = CudaCheck(d, d.cuDeviceGet(&device, i),
                                   absl::StrCat("cuDeviceGet for ", gpu));
        !s.ok()) {
      return s;
    }
    GpuInfo info;
    info.index = i;

    char name[256] = {};
    if (absl::Status s =
            CudaCheck(d, d.cuDeviceGetName(name, sizeof name - 1, device),
                      absl::StrCat("name of ", gpu));
        !s.ok()) {
      return s;
    }
    info.name = name;
    const std::string label = absl::StrCat(gpu, " (", info.name, ")");

    CUuuid uuid{};
    if (absl::Status s = CudaCheck(d, d.cuDeviceGetUuid(&uuid, device),
                                   absl::StrCat("UUID of ", label));
        !s.ok()) {
      return s;
    }
    info.uuid = common::FormatGpuUuid(uuid);

    size_t total = 0;
    if (absl::Status s = CudaCheck(d, d.cuDeviceTotalMem(&total, device),
                                   absl::StrCat("memory size of ", label));
        !s.ok()) {
      return s;
    }
    info.memory_bytes = static_cast<int64_t>(total);

    char bus_id[64] = {};
    if (absl::Status s = CudaCheck(
            d, d.cuDeviceGetPCIBusId(bus_id, sizeof bus_id - 1, device),
            absl::StrCat("PCI bus id of ", label));
        !s.ok()) {
      return s;
    }
    absl::StatusOr<PciAddress> address = ParsePciBusId(bus_id);
    if (!address.ok()) return address.status();
    info.pci_bus_id = NvidiaSmiBusId(*address);
    info.numa_node = NumaNode(*address);

    // Without these the chunks cannot exist: the daemon hands out memory
    // only as exported cuMemCreate allocations.
    for (
        auto [attribute, what] : {
            std::pair{CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                      "virtual memory management (cuMemCreate, cuMemMap)"},
            std::pair{
                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                "POSIX file-descriptor handles for its allocations"},
        }) {
      int supported = 0;
      if (absl::Status s = CudaCheck(
              d, d.cuDeviceGetAttribute(&supported, attribute, device),
              absl::StrCat("attribute ", static_cast<int>(attribute), " of ",
                           label));
          !s.ok()) {
        return s;
      }
      if (supported == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            label, " does not support ", what,
            ", which the cuda backend needs; run with the sim backend"));
      }
    }

    absl::StatusOr<int64_t> granularity =
        common::ChunkGranularity(d, device, label);
    if (!granularity.ok()) return granularity.status();
    const int64_t g = *granularity;
    if (options.chunk_bytes > info.memory_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: chunk_bytes ", options.chunk_bytes,
          " is larger than the ", info.memory_bytes, " bytes of ", label));
    }
    info.chunk_granularity =
        options.chunk_bytes == 0
            ? g
            : (options.chunk_bytes / g + (options.chunk_bytes % g != 0)) * g;

    info.d2h_bytes_per_s = options.fallback_bytes_per_s;
    info.h2d_bytes_per_s = options.fallback_bytes_per_s;
    if (options.measure_bandwidth) {
      absl::StatusOr<Bandwidth> measured =
          ProbeGpu(d, device, options.bandwidth_probe_bytes);
      if (measured.ok()) {
        info.d2h_bytes_per_s = measured->d2h;
        info.h2d_bytes_per_s = measured->h2d;
      } else {
        // A GPU that other processes filled, say, still serves chunks; the
        // cost model only times transfers less exactly.
        notes.push_back(absl::StrFormat(
            "GPU %d: host-link bandwidth probe failed (%s); assuming %.1f "
            "GB/s each way",
            i, measured.status().message(),
            options.fallback_bytes_per_s / 1e9));
      }
    }
    gpus.push_back(std::move(info));
    devices.push_back(device);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(
      d, std::move(gpus), std::move(devices), std::move(notes)));
}

CudaBackend::CudaBackend(const common::CudaDriver& driver,
                         std::vector<GpuInfo> gpus,
                         std::vector<CUdevice> devices,
                         std::vector<std::string> notes)
    : driver_(driver),
      gpus_(std::move(gpus)),
      devices_(std::move(devices)),
      notes_(std::move(notes)),
      allocated_(gpus_.size(), 0),
      contexts_(gpus_.size()) {}

CudaBackend::~CudaBackend() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, chunk] : chunks_) {
    close(chunk.info.fd);
    // In the GPU's primary context when the driver wanted one for
    // cuMemCreate (see Allocate), which it may want for the release too.
    std::optional<common::ScopedContext> scope;
    if (contexts_[chunk.info.gpu] != nullptr) {
      scope.emplace(*contexts_[chunk.info.gpu]);
    }
    // Processes that imported the chunk keep it alive until they let go.
    (void)driver_.cuMemRelease(chunk.handle);
  }
  // contexts_ go after the handles, released by their destructors.
}

const common::PrimaryContext* CudaBackend::ContextIfRetained(int gpu) const {
  std::lock_guard<std::mutex> lock(mu_);
  // Never reset once set, so the pointer outlives the lock.
  return contexts_[gpu].get();
}

absl::StatusOr<const common::PrimaryContext*> CudaBackend::RetainContext(
    int gpu) {
  std::lock_guard<std::mutex> lock(mu_);
  if (contexts_[gpu] == nullptr) {
    absl::StatusOr<common::PrimaryContext> retained =
        common::PrimaryContext::Retain(gpu);
    if (!retained.ok()) return retained.status();
    contexts_[gpu] =
        std::make_unique<common::PrimaryContext>(std::move(*retained));
  }
  return contexts_[gpu].get();
}

absl::Status CudaBackend::Allocate(int gpu, int64_t bytes, Chunk& chunk) {
  // Current only for these calls: the calling thread's context (a test's
  // CudaDevice, say) is put back after.
  std::optional<common::ScopedContext> scope;
  const common::PrimaryContext* context = ContextIfRetained(gpu);
  if (context != nullptr) {
    scope.emplace(*context);
    if (!scope->status().ok()) return scope->status();
  }
  const CUmemAllocationProp prop = common::ChunkProperties(devices_[gpu]);
  CUmemGenericAllocationHandle handle = 0;
  CUresult r =
      driver_.cuMemCreate(&handle, static_cast<size_t>(bytes), &prop, 0);
  if (r == CUDA_ERROR_INVALID_CONTEXT && context == nullptr) {
    absl::StatusOr<const common::PrimaryContext*> retained = RetainContext(gpu);
    if (!retained.ok()) return retained.status();
    scope.emplace(**retained);
    if (!scope->status().ok()) return scope->status();
    r = driver_.cuMemCreate(&handle, static_cast<size_t>(bytes), &prop, 0);
  }
  if (absl::Status s = CudaCheck(
          driver_, r,
          absl::StrCat("cuMemCreate of a ", bytes, "-byte chunk on GPU ", gpu));
      !s.ok()) {
    return s;
  }
  absl::StatusOr<common::UniqueFd> fd = common::ExportChunk(
      driver_, handle, absl::StrCat("a ", bytes, "-byte chunk on GPU ", gpu));
  if (!fd.ok()) {
    (void)driver_.cuMemRelease(handle);
    return fd.status();
  }
  chunk.handle = handle;
  chunk.info.fd = fd->release();
  return absl::OkStatus();
}

absl::StatusOr<DeviceChunk> CudaBackend::CreateChunk(int gpu, int64_t bytes) {
  absl::StatusOr<ChunkRequest> request =
      ChunkRequest::Make(name(), gpus_, gpu, bytes);
  if (!request.ok()) return request.status();
  const int64_t rounded = request->rounded;

  Chunk chunk;
  chunk.info.gpu = gpu;
  chunk.info.bytes = rounded;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Reserved now, allocated outside the lock: other GPUs' arbiters
    // should not wait on this one's driver calls.
    if (absl::Status s = request->Reserve(allocated_[gpu]); !s.ok()) return s;
    chunk.info.id = next_id_++;
  }
  // The accounting can pass where the GPU cannot (memory held by contexts
  // and by processes outside deltad): cuMemCreate then says
  // CUDA_ERROR_OUT_OF_MEMORY, which CudaCheck makes RESOURCE_EXHAUSTED.
  if (absl::Status s = Allocate(gpu, rounded, chunk); !s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    allocated_[gpu] -= rounded;
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  chunks_.emplace(chunk.info.id, chunk);
  return chunk.info;
}

absl::Status CudaBackend::ReleaseChunk(uint64_t chunk_id) {
  Chunk chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(chunk_id);
    if (it == chunks_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "no chunk with id ", chunk_id,
          " in the cuda backend (never created or already released)"));
    }
    chunk = it->second;
    allocated_[chunk.info.gpu] -= chunk.info.bytes;
    chunks_.erase(it);
  }
  // A client that imported the chunk keeps the memory alive after this;
  // see DeviceChunk::fd.
  close(chunk.info.fd);
  // As in Allocate: the primary context, only if the driver wanted one
  // (the release is tried either way: the chunk is forgotten already).
  std::optional<common::ScopedContext> scope;
  if (const common::PrimaryContext* context = ContextIfRetained(chunk.info.gpu);
      context != nullptr) {
    scope.emplace(*context);
  }
  return CudaCheck(driver_, driver_.cuMemRelease(chunk.handle),
                   absl::StrCat("cuMemRelease of chunk ", chunk_id, " on GPU ",
                                chunk.info.gpu));
}

int64_t CudaBackend::allocated_bytes(int gpu) const {
  if (gpu < 0 || gpu >= static_cast<int>(gpus_.size())) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_[gpu];
}

}  // namespace deltad::daemon
