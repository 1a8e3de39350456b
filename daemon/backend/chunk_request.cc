#include "daemon/backend/chunk_request.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {
namespace {

std::string ExhaustedMessage(int gpu, int64_t free_bytes, int64_t bytes,
                             int64_t rounded, int64_t granularity) {
  std::string message = absl::StrCat("GPU ", gpu, " has ", free_bytes,
                                     " bytes free, asked ", bytes, " bytes");
  if (rounded != bytes) {
    absl::StrAppend(&message, " (", rounded, " after rounding up to ",
                    granularity, "-byte chunks)");
  }
  return message;
}

}  // namespace

absl::StatusOr<ChunkRequest> ChunkRequest::Make(
    absl::string_view backend, const std::vector<GpuInfo>& gpus, int gpu,
    int64_t bytes) {
  if (gpu < 0 || gpu >= static_cast<int>(gpus.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu, " does not exist; the ", backend, " backend has ",
        gpus.size(), " GPUs (0-", gpus.size() - 1, ")"));
  }
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk size must be positive, got ", bytes, " bytes for GPU ", gpu));
  }
  const GpuInfo& info = gpus[gpu];
  ChunkRequest request{.gpu = gpu,
                       .bytes = bytes,
                       .memory_bytes = info.memory_bytes,
                       .granularity = info.chunk_granularity};
  // Rounded up without overflow: `units * granularity` is only formed when
  // it fits in the GPU's memory.
  const int64_t units =
      bytes / request.granularity + (bytes % request.granularity != 0);
  request.fits_at_all = units <= info.memory_bytes / request.granularity;
  request.rounded = request.fits_at_all ? units * request.granularity : bytes;
  return request;
}

absl::Status ChunkRequest::Reserve(int64_t& allocated) const {
  const int64_t free_bytes = memory_bytes - allocated;
  if (!fits_at_all || rounded > free_bytes) {
    return absl::ResourceExhaustedError(
        ExhaustedMessage(gpu, free_bytes, bytes, rounded, granularity));
  }
  allocated += rounded;
  return absl::OkStatus();
}

}  // namespace deltad::daemon
