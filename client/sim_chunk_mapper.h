#ifndef DELTAD_CLIENT_SIM_CHUNK_MAPPER_H_
#define DELTAD_CLIENT_SIM_CHUNK_MAPPER_H_

#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/chunk_mapper.h"

namespace deltad::client {

// Chunks that are memfds, standing in for GPU memory so that the arena's
// code runs, unchanged, where there is no GPU (CI, the simulator). The
// reservation is a PROT_NONE, MAP_NORESERVE anonymous mapping, which costs
// no memory; a chunk is mapped over part of it with MAP_FIXED, and
// unmapping puts the PROT_NONE mapping back, so that no other mmap of the
// process can land in the range meanwhile.
//
// Map and Unmap refuse ranges outside the reservations made here: a
// MAP_FIXED mapping anywhere else would silently replace whatever the
// process had there.
//
// Not thread safe (see ChunkMapper). Owns the descriptors it returns as
// handles (duplicates; the caller keeps its own) until Release, and the
// reservations until Unreserve; the destructor frees neither, since the
// arena does.
class SimChunkMapper final : public ChunkMapper {
 public:
  SimChunkMapper() = default;
  SimChunkMapper(const SimChunkMapper&) = delete;
  SimChunkMapper& operator=(const SimChunkMapper&) = delete;

  // INVALID_ARGUMENT unless both are positive multiples of the page size.
  absl::StatusOr<uintptr_t> Reserve(int64_t bytes, int64_t alignment) override;
  void Unreserve(uintptr_t base, int64_t bytes) override;
  // The handle is a close-on-exec duplicate of `fd`. INVALID_ARGUMENT when
  // the file is smaller than `bytes`.
  absl::StatusOr<uint64_t> Import(int fd, int64_t bytes) override;
  absl::Status Map(uint64_t handle, uintptr_t at, int64_t bytes) override;
  absl::Status Unmap(uintptr_t at, int64_t bytes) override;
  void Release(uint64_t handle) override;

 private:
  // OK when [at, at + bytes) lies in one reservation and is page aligned.
  absl::Status CheckInside(uintptr_t at, int64_t bytes) const;

  std::map<uintptr_t, int64_t> reservations_;  // base -> bytes
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_SIM_CHUNK_MAPPER_H_
