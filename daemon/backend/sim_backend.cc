#include "daemon/backend/sim_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "daemon/backend/chunk_request.h"

namespace deltad::daemon {
namespace {

absl::Status ValidateOptions(const SimBackendOptions& o) {
  if (o.gpus < 1 || o.gpus > SimBackend::kMaxGpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("sim backend: gpus must be in [1, ", SimBackend::kMaxGpus,
                     "], got ", o.gpus));
  }
  if (o.memory_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sim backend: memory_bytes must be positive, got ", o.memory_bytes));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (o.chunk_bytes <= 0 || o.chunk_bytes % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sim backend: chunk_bytes must be a positive multiple of the ", page,
        "-byte page size (chunks are mmap'ed), got ", o.chunk_bytes));
  }
  if (o.chunk_bytes > o.memory_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("sim backend: chunk_bytes ", o.chunk_bytes,
                     " is larger than memory_bytes ", o.memory_bytes,
                     ", so not even one chunk would fit"));
  }
  for (auto [field, value] :
       {std::pair{"d2h_bytes_per_s", o.d2h_bytes_per_s},
        std::pair{"h2d_bytes_per_s", o.h2d_bytes_per_s}}) {
    // `!(value > 0)` also rejects NaN.
    if (!(value > 0) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sim backend: ", field, " must be positive and finite, got ", value));
    }
  }
  if (o.name.empty()) {
    return absl::InvalidArgumentError("sim backend: name must not be empty");
  }
  return absl::OkStatus();
}

// Stable across runs and hosts, so configs and logs that name a GPU by UUID
// keep working. NVIDIA's 8-4-4-4-12 layout, so parsers of real UUIDs accept
// them, with "sim" in the first group so no one mistakes them for real ones.
std::string FakeUuid(int index) {
  return absl::StrCat("GPU-sim00000-0000-0000-0000-",
                      absl::Hex(index, absl::kZeroPad12));
}

// nvidia-smi's "domain:bus:device.function" form. Domain 0xffff is one no
// real host uses for GPUs, so a fake id never matches a device in sysfs.
std::string FakePciBusId(int index) {
  return absl::StrCat("0000FFFF:",
                      absl::AsciiStrToUpper(
                          absl::StrCat(absl::Hex(index + 1, absl::kZeroPad2))),
                      ":00.0");
}

}  // namespace

absl::StatusOr<std::unique_ptr<SimBackend>> SimBackend::Create(
    SimBackendOptions options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  std::vector<GpuInfo> gpus;
  gpus.reserve(options.gpus);
  for (int i = 0; i < options.gpus; ++i) {
    gpus.push_back(GpuInfo{
        .index = i,
        .name = options.name,
        .uuid = FakeUuid(i),
        .pci_bus_id = FakePciBusId(i),
        // The chunks are ordinary host memory, placed wherever the kernel
        // puts the touching thread's pages: no node is nearer than another.
        .numa_node = -1,
        .memory_bytes = options.memory_bytes,
        .d2h_bytes_per_s = options.d2h_bytes_per_s,
        .h2d_bytes_per_s = options.h2d_bytes_per_s,
        .chunk_granularity = options.chunk_bytes,
    });
  }
  return std::unique_ptr<SimBackend>(new SimBackend(std::move(gpus)));
}

SimBackend::SimBackend(std::vector<GpuInfo> gpus)
    : gpus_(std::move(gpus)), allocated_(gpus_.size(), 0) {}

SimBackend::~SimBackend() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, chunk] : chunks_) close(chunk.fd);
}

absl::StatusOr<DeviceChunk> SimBackend::CreateChunk(int gpu, int64_t bytes) {
  absl::StatusOr<ChunkRequest> request =
      ChunkRequest::Make(name(), gpus_, gpu, bytes);
  if (!request.ok()) return request.status();
  const int64_t rounded = request->rounded;

  DeviceChunk chunk{.gpu = gpu, .bytes = rounded};
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Reserve now and make the memfd outside the lock: the syscalls need no
    // shared state, and other GPUs' arbiters should not wait on them.
    if (absl::Status s = request->Reserve(allocated_[gpu]); !s.ok()) return s;
    chunk.id = next_id_++;
  }
  auto unreserve = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    allocated_[gpu] -= rounded;
  };

  // The name shows in /proc/<pid>/maps and fd listings of the client.
  const std::string memfd_name =
      absl::StrCat("deltad-sim-gpu", gpu, "-chunk", chunk.id);
  // Sealable so that the size can be fixed below.
  const int fd =
      memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    const int error = errno;
    unreserve();
    return absl::ErrnoToStatus(error,
                               absl::StrCat("memfd_create for a ", rounded,
                                            "-byte chunk on GPU ", gpu));
  }
  // ftruncate allocates nothing: shmem pages come on first touch, so an
  // untouched chunk costs no host memory however large.
  if (ftruncate(fd, rounded) != 0) {
    const int error = errno;
    close(fd);
    unreserve();
    return absl::ErrnoToStatus(error,
                               absl::StrCat("ftruncate of a memfd to ", rounded,
                                            " bytes for GPU ", gpu));
  }
  // The client gets this fd; sealing its size stops a client from growing
  // the memfd past the budget it was granted (or shrinking it under the
  // daemon's accounting). F_SEAL_SEAL keeps the seals as they are.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int error = errno;
    close(fd);
    unreserve();
    return absl::ErrnoToStatus(
        error, absl::StrCat("sealing the size of a memfd chunk on GPU ", gpu));
  }
  chunk.fd = fd;
  std::lock_guard<std::mutex> lock(mu_);
  chunks_.emplace(chunk.id, chunk);
  return chunk;
}

absl::Status SimBackend::ReleaseChunk(uint64_t chunk_id) {
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(chunk_id);
    if (it == chunks_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "no chunk with id ", chunk_id,
          " in the sim backend (never created or already released)"));
    }
    allocated_[it->second.gpu] -= it->second.bytes;
    fd = it->second.fd;
    chunks_.erase(it);
  }
  // A client mapping keeps the pages alive after this; see DeviceChunk::fd.
  close(fd);
  return absl::OkStatus();
}

int64_t SimBackend::allocated_bytes(int gpu) const {
  if (gpu < 0 || gpu >= static_cast<int>(gpus_.size())) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_[gpu];
}

}  // namespace deltad::daemon
