#include "client/sim_chunk_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/sim_chunk_mapper.h"

namespace deltad::client {

absl::StatusOr<std::unique_ptr<SimChunkDevice>> SimChunkDevice::Create(
    int64_t max_bytes, double d2h_bytes_per_s, double h2d_bytes_per_s,
    int64_t local_chunk_bytes) {
  if (max_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("simulated GPU memory must be positive, got ", max_bytes));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (local_chunk_bytes <= 0 || local_chunk_bytes % page != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local chunks must be a positive multiple of the ", page,
                     "-byte page, got ", local_chunk_bytes));
  }
  return std::unique_ptr<SimChunkDevice>(
      new SimChunkDevice(std::make_unique<SimChunkMapper>(), max_bytes,
                         d2h_bytes_per_s, h2d_bytes_per_s, local_chunk_bytes));
}

absl::StatusOr<common::UniqueFd> SimChunkDevice::CreateLocalChunk(
    int64_t bytes) {
  common::UniqueFd fd(memfd_create("deltad-local-chunk", MFD_CLOEXEC));
  if (!fd.valid()) {
    return absl::ErrnoToStatus(errno, "memfd_create for a local chunk");
  }
  if (ftruncate(fd.get(), bytes) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("sizing a local chunk to ", bytes, " bytes"));
  }
  return fd;
}

}  // namespace deltad::client
