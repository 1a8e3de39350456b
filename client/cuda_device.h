#ifndef DELTAD_CLIENT_CUDA_DEVICE_H_
#define DELTAD_CLIENT_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/arena_device.h"
#include "common/cuda_driver.h"
#include "common/unix_socket.h"

namespace deltad::client {

// One CUDA GPU as the client's executor uses it: memory from the daemon's
// chunks (or local ones) in a ChunkArena mapped by a CudaChunkMapper, and
// the two copy directions on streams of their own, so that offloads and
// reloads overlap the framework's compute stream:
//
//  - CopyToHost orders itself after the work queued on the compute stream
//    before the call (an event recorded there, waited for on the D2H
//    stream), so it copies what that work wrote; it returns when the bytes
//    are on the host.
//  - CopyToDevice copies on the H2D stream and makes the compute stream wait
//    for the copy (cudaStreamWaitEvent), so compute work queued afterwards
//    sees the bytes without a host wait; it still returns only when the copy
//    is done, so the host block can be reused. It does not wait for compute
//    work queued before it: the destination must not be in use by work
//    still queued (the framework's allocator keeps that promise by not
//    reusing memory that pending kernels read).
//
// Copies return void (Device's interface). A failed copy records its error,
// which last_error() returns (the first one; CUDA errors from kernels are
// usually sticky, so later ones add nothing): check it after the copies
// whose result matters.
//
// Each call makes the device's primary context current in the calling
// thread for its duration and then restores the caller's: the runtime works
// in the current context, so this is what cudaSetDevice(ordinal) would do,
// without leaving a framework thread switched to another device (or
// creating a context on device 0 when restoring "no device"). The executor
// thread therefore needs no setup of its own.
//
// Thread safe. Owns its streams and events, and the host registrations
// made through it (undone on destruction); the compute stream is the
// framework's.
class CudaDevice final : public ArenaDevice {
 public:
  // FAILED_PRECONDITION without a driver or GPU, or for a GPU without
  // virtual memory management; INVALID_ARGUMENT for an unknown ordinal.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal);

  ~CudaDevice() override;

  absl::string_view name() const override { return "cuda"; }
  absl::string_view chunk_backend() const override { return "cuda"; }
  void CopyToHost(void* host, const void* device, int64_t bytes) override;
  void CopyToDevice(void* device, const void* host, int64_t bytes) override;
  // cudaHostRegister, once per region: registering a region again is a
  // no-op. Pinned host memory makes the copies asynchronous DMA at full
  // link speed instead of staged through a driver buffer.
  absl::Status RegisterHost(void* host, int64_t bytes) override;
  void UnregisterHost(void* host) override;

  // The stream the framework computes on (a cudaStream_t of this device);
  // nullptr, the default, is the legacy default stream.
  void SetComputeStream(void* stream);
  void* compute_stream() const;

  // OK, or the first error a copy met.
  absl::Status last_error() const;

  int ordinal() const { return ordinal_; }
  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as the cuda backend's
  // GpuInfo::uuid for the same GPU.
  const std::string& uuid() const { return uuid_; }
  std::string gpu_uuid() const override { return uuid_; }
  int64_t memory_bytes() const { return memory_bytes_; }
  // The GPU's mapping granularity for fd-exportable allocations: every
  // chunk size, local ones (kLocalChunkBytes) included, is a multiple of it.
  int64_t chunk_granularity() const { return granularity_; }

 protected:
  // A cuMemCreate allocation of `bytes` (a multiple of chunk_granularity(),
  // else INVALID_ARGUMENT)
  // exported as a POSIX fd. The creating handle is released at once: the
  // exported fd is itself a reference that keeps the allocation alive (the
  // driver frees it only when "all outstanding references to the handle
  // (including its shareable counterparts)" are gone, cuMemRelease's
  // documentation), and the mapper's import takes its own. Memory of a
  // local chunk the arena drops thus returns to the GPU at once.
  absl::StatusOr<common::UniqueFd> CreateLocalChunk(int64_t bytes) override;

 private:
  struct Streams {
    cudaStream_t d2h = nullptr;
    cudaStream_t h2d = nullptr;
    cudaEvent_t compute_ready = nullptr;  // recorded on the compute stream
    cudaEvent_t d2h_done = nullptr;
    cudaEvent_t h2d_done = nullptr;
  };

  CudaDevice(std::unique_ptr<ChunkMapper> mapper,
             common::PrimaryContext context, int64_t memory_bytes,
             int64_t granularity, std::string uuid, Streams streams);

  void RecordError(absl::Status status);

  const common::PrimaryContext context_;
  const int ordinal_;
  const int64_t memory_bytes_;
  const int64_t granularity_;
  const std::string uuid_;
  const Streams streams_;
  std::atomic<cudaStream_t> compute_{nullptr};

  // One copy per direction at a time: each direction reuses its events.
  std::mutex d2h_mu_;
  std::mutex h2d_mu_;

  mutable std::mutex state_mu_;
  absl::Status error_ ABSL_GUARDED_BY(state_mu_);
  // Registered host regions and their sizes.
  std::unordered_map<void*, int64_t> registered_ ABSL_GUARDED_BY(state_mu_);
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_CUDA_DEVICE_H_
