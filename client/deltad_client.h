/* The deltad client library's C API, for languages other than C++ (the
 * Python package uses it through ctypes). Every call returns 0 on success
 * or an absl/gRPC status code (3 INVALID_ARGUMENT, 5 NOT_FOUND,
 * 8 RESOURCE_EXHAUSTED, 14 UNAVAILABLE, ...); deltad_last_error() then
 * says what went wrong, for the calling thread. Thread safe. */
#ifndef DELTAD_CLIENT_DELTAD_CLIENT_H_
#define DELTAD_CLIENT_DELTAD_CLIENT_H_

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct deltad_client deltad_client;

typedef struct {
  const char* socket_path; /* default "/run/deltad/deltad.sock" */
  int32_t gpu; /* the daemon's GPU index; default -1: the GPU with the
                  device's UUID ("cuda"), else 0 */
  int64_t requested_budget_bytes; /* 0: a fair share */
  int64_t requested_host_bytes;   /* 0: the daemon's default */
  uint32_t priority;              /* default 1 */
  const char* label;              /* shown by deltactl; may be NULL */
  int32_t use_daemon;             /* default 1; 0: in-process policy only */
  int64_t fallback_budget_bytes;  /* budget without a daemon; default 1 GiB */
  int64_t fallback_host_bytes;    /* heap for offloads without a daemon */
  /* The device. "sim": device memory from the heap, up to
   * sim_memory_bytes, copies throttled to the bandwidths (0: memcpy speed).
   * "sim-chunks": the same in the daemon's sim-backend chunks (memfds)
   * mapped into one reserved range, as "cuda" maps its chunks: the path a
   * GPU's allocations take, without one (or in-process chunks without a
   * daemon). "cuda" (in a build with the CUDA toolkit): the GPU
   * `cuda_device`, with memory from the daemon's chunks (or the process's
   * own without one). */
  const char* device;              /* default "sim" */
  int64_t sim_memory_bytes;        /* default 80 GiB */
  double sim_d2h_bytes_per_second; /* default 25e9 */
  double sim_h2d_bytes_per_second; /* default 25e9 */
  int32_t cuda_device;             /* CUDA ordinal; default 0 */
  /* Device memory the job cannot run without (0: none): no later admission
   * cuts its budget below it, nor below its last iteration's peak (see
   * deltad_iteration_done); a daemon that cannot keep it refuses the
   * session. */
  int64_t min_budget_bytes;
  int32_t admission_wait_ms; /* ask a refusing daemon again this long */
  int32_t require_session;   /* 1: connect fails without a session */
} deltad_client_options;

typedef struct {
  uint64_t id;
  int64_t bytes;
  const uint64_t* parents;
  size_t num_parents;
  int64_t compute_cost_ns;
  int32_t evict_pinned;
  int32_t offload_pinned;
  int32_t uncomputable;
  uint64_t stable_key;
} deltad_tensor_info;

typedef struct {
  int64_t device_bytes;
  int64_t peak_device_bytes;
  int64_t budget_bytes;
  int64_t host_bytes;
  int64_t offloaded_bytes;
  int64_t reloaded_bytes;
  int64_t evictions;
  int64_t recomputes;
  int64_t recompute_ns;
  int64_t stall_ns;
  int32_t connected;
  int64_t prefetches; /* reloads done ahead of use */
} deltad_client_stats;

/* The client's sessions with the daemon (deltad_session_stats). Apart from
 * deltad_client_stats so that its layout, which bindings mirror, stays as it
 * is. */
typedef struct {
  int32_t connected;   /* 1 while a session is open */
  uint64_t session_id; /* the last session opened; 0: none yet */
  int64_t reconnects;  /* sessions opened after the first */
  /* Sessions that ended without this process closing them (the stream
   * broke, a call failed, the daemon stalled or died): each was ended on
   * both sides and a new one sought in the background. */
  int64_t sessions_lost;
  int64_t attach_failures; /* attempts that opened no session */
} deltad_client_session_stats;

/* Rebuilds tensor `id` into `out`; returns 0 on success. Runs on the thread
 * that needed the tensor. */
typedef int (*deltad_recompute_fn)(void* user_data, uint64_t id, void* out);

/* Fills `options` with the defaults. */
void deltad_client_options_init(deltad_client_options* options);
int deltad_client_connect(const deltad_client_options* options,
                          deltad_client** client);
/* A training iteration completed: its peak device bytes go to the daemon
 * (streamed), which keeps them as the session's floor. */
void deltad_iteration_done(deltad_client* client);
/* Ends the session and frees everything, `client` included. */
void deltad_client_close(deltad_client* client);

/* Device memory for a new tensor, returned pinned (see the C++ Client). A
 * NULL `recompute` makes it unrecomputable by eviction. */
int deltad_track(deltad_client* client, const deltad_tensor_info* info,
                 deltad_recompute_fn recompute, void* user_data, void** out);
int deltad_pin(deltad_client* client, uint64_t id, void** out);
void deltad_unpin(deltad_client* client, uint64_t id);
int deltad_free(deltad_client* client, uint64_t id);
int deltad_stats(deltad_client* client, deltad_client_stats* stats);
int deltad_session_stats(deltad_client* client,
                         deltad_client_session_stats* stats);

/* Reload these offloaded tensors ahead of their use, in this order, as far
 * as the budget allows (a hint: unknown or resident ids are skipped). */
void deltad_prefetch(deltad_client* client, const uint64_t* ids, size_t n);

/* 1 when the tensor's bytes are on the device now, 0 otherwise (offloaded,
 * evicted, on its way, unknown). */
int deltad_resident(deltad_client* client, uint64_t id);

/* "cuda" device only: the cudaStream_t the framework computes on, so that
 * offloads wait for the work queued there and reloads are waited for by it
 * (NULL: the legacy default stream). FAILED_PRECONDITION on another
 * device. */
int deltad_set_compute_stream(deltad_client* client, void* stream);

/* The message of the calling thread's last failed call; "" if none. */
const char* deltad_last_error(void);

/* --- The process's device allocator (docs/ALLOCATOR.md) ---------------
 *
 * deltad_torch_malloc and deltad_torch_free have the signatures of
 * PyTorch's CUDAPluggableAllocator:
 *   torch.cuda.memory.CUDAPluggableAllocator(
 *       "libdeltad_client.so", "deltad_torch_malloc", "deltad_torch_free")
 * They serve memory from the attached client within its budget, as raw
 * allocations: counted with its tracked tensors, which are released to
 * make room for them, but never released themselves. Thread safe; no
 * daemon round trip while the budget and the device have room. */

/* Makes `client` the one behind the entry points. FAILED_PRECONDITION
 * while a client is attached (the same one included): detach it first. */
int deltad_allocator_attach(deltad_client* client);
/* Attaches none: deltad_torch_malloc fails until the next attach. Blocks
 * allocated before stay their client's, and freeing one still returns its
 * memory to that client. FAILED_PRECONDITION when none was attached.
 * Closing an attached client detaches it; a block of a closed client is
 * gone with it, and freeing it later is ignored. */
int deltad_allocator_detach(void);

/* `size` bytes of device memory, 256-byte aligned, or NULL with
 * deltad_last_error() saying why: nothing attached, `device` not the
 * attached "cuda" client's CUDA ordinal (the simulated devices take any
 * index), no room within the budget (RESOURCE_EXHAUSTED's message names
 * the budget, what is held and the request). Size 0 returns NULL without an
 * error, as PyTorch's allocators do for empty tensors. `stream` is not
 * used: the memory is the caller's until freed, on any stream; a caller
 * that frees memory still in use by queued work must wait for that work
 * (PyTorch's caching allocator over a MemPool does, with events). */
void* deltad_torch_malloc(ssize_t size, int device, void* stream);
/* deltad_torch_malloc, but a failure throws a C++ exception derived from
 * std::exception, with deltad_last_error()'s message, instead of returning
 * NULL. For PyTorch 2.0-2.7's change_current_allocator, whose pluggable
 * allocator does not check for NULL: a tensor would get a null pointer
 * and the first kernel writing it fail with an illegal address. (PyTorch
 * turns the exception into a RuntimeError.) Not for C callers. */
void* deltad_torch_malloc_or_raise(ssize_t size, int device, void* stream);
/* Returns `ptr` to the client that allocated it, even after a detach. The
 * size recorded at allocation is the one freed, whatever `size` says; a
 * pointer deltad_torch_malloc did not return, or one already freed, is
 * ignored (deltad_last_error() says so). `device` and `stream` are not
 * used. */
void deltad_torch_free(void* ptr, ssize_t size, int device, void* stream);

/* Release on allocation failure. When the attached client's budget is too
 * short to hold an allocation now, deltad_torch_malloc calls fn(bytes, ctx)
 * on the allocating thread, with none of the allocator's locks held,
 * `bytes` being how much the budget lacks, and tries again if it returns
 * > 0 (the bytes it freed, by deltad_torch_free or by letting the framework
 * free tensors); at most 4 times per allocation. Only then does the client
 * release its tracked tensors or ask the daemon for room (its own saved
 * activations go before other processes' memory). fn's own allocations do
 * not call it again. NULL removes it, without waiting for calls already
 * running: their ctx must stay valid. The owner of saved activations sets
 * it (the Python package does under change_current_allocator, where freed
 * tensors come straight back; a MemPool keeps them in its cache, see
 * docs/ALLOCATOR.md). */
typedef int64_t (*deltad_reclaim_fn)(int64_t bytes, void* ctx);
int deltad_allocator_set_reclaim(deltad_reclaim_fn fn, void* ctx);

typedef struct {
  int32_t attached;             /* 1 when a client is attached */
  int64_t allocated_bytes;      /* the attached client's, through malloc */
  int64_t device_bytes;         /* its whole: the allocator's and tensors' */
  int64_t peak_device_bytes;    /* the most device_bytes held at once */
  int64_t budget_bytes;         /* its budget now */
  int64_t blocks;               /* live blocks of every client */
  int64_t reclaims;             /* calls of the reclaim callback */
  int64_t reclaimed_bytes;      /* what they said they freed */
  int64_t peak_allocated_bytes; /* the most bytes in live blocks at once
                                   since deltad_allocator_reset_peak */
} deltad_allocator_usage;

/* What the allocator holds: zeros (but blocks, reclaims and the peak)
 * when none is attached. */
int deltad_allocator_stats(deltad_allocator_usage* usage);
/* Restarts peak_allocated_bytes from the bytes in live blocks now (an
 * iteration's peak, where PyTorch keeps no statistics of its own). */
int deltad_allocator_reset_peak(void);

#ifdef __cplusplus
}
#endif

#endif /* DELTAD_CLIENT_DELTAD_CLIENT_H_ */
