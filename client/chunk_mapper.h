#ifndef DELTAD_CLIENT_CHUNK_MAPPER_H_
#define DELTAD_CLIENT_CHUNK_MAPPER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace deltad::client {

// Maps physical chunks, received from the daemon as file descriptors, into
// one reserved range of this process's device address space. Two
// implementations: memfd chunks mmap'ed into a PROT_NONE reservation
// (client/sim_chunk_mapper.h) and CUDA virtual memory (cuMemImport, cuMemMap;
// client/cuda_chunk_mapper.h). The ChunkArena decides what goes where; the
// mapper only carries it out.
//
// Not thread safe: its one user, the ChunkArena, holds its own lock around
// every call.
class ChunkMapper {
 public:
  virtual ~ChunkMapper() = default;

  // Reserves `bytes` of address space aligned to `alignment` (both
  // multiples of the chunk size). Nothing is mapped in it yet.
  virtual absl::StatusOr<uintptr_t> Reserve(int64_t bytes,
                                            int64_t alignment) = 0;
  virtual void Unreserve(uintptr_t base, int64_t bytes) = 0;
  // Takes hold of the chunk behind `fd` (which stays the caller's) and
  // returns a handle for Map and Release.
  virtual absl::StatusOr<uint64_t> Import(int fd, int64_t bytes) = 0;
  // Maps the whole chunk at `at`, inside the reservation, readable and
  // writable by this process's device work.
  virtual absl::Status Map(uint64_t handle, uintptr_t at, int64_t bytes) = 0;
  // Undoes Map; the range is reserved again, mapped to nothing.
  virtual absl::Status Unmap(uintptr_t at, int64_t bytes) = 0;
  // Drops the chunk (after its Unmap); the daemon may then release it.
  virtual void Release(uint64_t handle) = 0;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_CHUNK_MAPPER_H_
