// The process's device allocator: deltad_torch_malloc / deltad_torch_free,
// the entry points PyTorch's CUDAPluggableAllocator calls, over the raw
// allocations of the attached client (Client::AllocateRaw). See
// deltad_client.h for the contract and docs/ALLOCATOR.md for how PyTorch
// uses it.
//
// Every live block is recorded with its client and size, because a free
// must reach the client that allocated the block: the attached one may have
// changed since (detach, attach), and the "sim" device's blocks are plain
// heap memory, which another client's device would free as its own. The
// record also makes a stray or repeated free harmless, and lets a client be
// closed while PyTorch still holds blocks (at exit, Python may close it
// before PyTorch frees its pools): its blocks are forgotten with it, and
// their frees ignored.
//
// An allocation the budget cannot hold asks the reclaim callback, if one is
// set, to free memory (the owner of saved activations releases some), and is
// tried again: the release on allocation failure of DELTA. The callback runs
// with none of this file's locks held, so it may free blocks itself.
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/capi_client.h"
#include "client/deltad_client.h"

namespace deltad::client::capi {
namespace {

struct Block {
  deltad_client* owner;
  int64_t bytes;
};

struct AllocatorState {
  // Held shared by malloc and free while they use a client, exclusively to
  // change which one is attached and before a client is closed: a client
  // never dies under a call using it. Allocations that must wait (for
  // releases, for the daemon) hold it shared meanwhile, so a close waits
  // for them; readers are not blocked by a waiting writer (glibc's
  // default), so no call waits behind a close that waits for it.
  std::shared_mutex lifetime_mu;
  deltad_client* attached = nullptr;  // lifetime_mu

  // The live blocks. A lock of its own, held only for the map, so that
  // frees do not wait for an allocation that is making room.
  std::mutex blocks_mu;
  absl::flat_hash_map<void*, Block> blocks;  // blocks_mu
  // Their bytes, and the most at once since deltad_allocator_reset_peak:
  // under the global swap, what PyTorch allocated (it keeps no statistics
  // with a pluggable allocator), per iteration.
  int64_t live_bytes = 0;  // blocks_mu
  int64_t peak_bytes = 0;  // blocks_mu

  // deltad_allocator_set_reclaim's callback, and what it did.
  std::mutex reclaim_mu;
  deltad_reclaim_fn reclaim = nullptr;  // reclaim_mu
  void* reclaim_ctx = nullptr;          // reclaim_mu
  int64_t reclaims = 0;                 // reclaim_mu
  int64_t reclaimed_bytes = 0;          // reclaim_mu
};

AllocatorState& State() {
  // Never destroyed: PyTorch may free blocks while the process exits,
  // after this library's static destructors would have run.
  static AllocatorState* const state = new AllocatorState;
  return *state;
}

}  // namespace

void ForgetAllocatorClient(deltad_client* client) {
  AllocatorState& s = State();
  std::unique_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  if (s.attached == client) s.attached = nullptr;
  std::lock_guard<std::mutex> lock(s.blocks_mu);
  for (auto it = s.blocks.begin(); it != s.blocks.end();) {
    if (it->second.owner == client) {
      s.live_bytes -= it->second.bytes;
      s.blocks.erase(it++);
    } else {
      ++it;
    }
  }
}

}  // namespace deltad::client::capi

namespace {

using deltad::client::capi::AllocatorState;
using deltad::client::capi::Block;
using deltad::client::capi::Report;
using deltad::client::capi::State;

// How many times one allocation asks the callback for room: each round
// must free something, and what it frees may go to other threads first.
constexpr int kReclaimRounds = 4;

// Set while this thread runs the callback: an allocation the callback makes
// (a copy's buffer) is not served by reclaiming again.
thread_local bool in_reclaim = false;

// Thrown by deltad_torch_malloc_or_raise. PyTorch reports a std::exception
// raised by an allocator as a RuntimeError with its message.
class OutOfDeviceMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One try with the attached client; the block recorded when it succeeds.
// `fast`: only if the budget and the device have room now (nothing
// released, no daemon asked); then, when the budget's count is what is
// short, `*short_by` says by how much (else 0).
absl::StatusOr<void*> AllocateOnce(AllocatorState& s, ssize_t size, int device,
                                   bool fast, int64_t* short_by) {
  if (size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", size, " device bytes"));
  }
  std::shared_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  deltad_client* client = s.attached;
  if (client == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no deltad client is attached to the allocator (call "
        "deltad_allocator_attach, or deltad.allocator.install() from "
        "Python): no device memory for ",
        size, " bytes"));
  }
  if (client->cuda_ordinal >= 0 && device != client->cuda_ordinal) {
    // One client serves one GPU; memory of another would be unusable.
    return absl::InvalidArgumentError(absl::StrCat(
        "the deltad allocator serves CUDA device ", client->cuda_ordinal,
        ", not device ", device, " (one client per GPU)"));
  }
  void* p;
  if (fast) {
    p = client->impl->TryAllocateRaw(size);
    if (p == nullptr) {
      const deltad::client::ClientStats stats = client->impl->Stats();
      *short_by =
          std::max<int64_t>(0, stats.device_bytes + size - stats.budget_bytes);
      return absl::ResourceExhaustedError("no room within the budget now");
    }
  } else {
    absl::StatusOr<void*> slow = client->impl->AllocateRaw(size);
    if (!slow.ok()) return slow.status();
    p = *slow;
  }
  std::lock_guard<std::mutex> lock(s.blocks_mu);
  s.blocks.insert_or_assign(p, Block{client, static_cast<int64_t>(size)});
  s.live_bytes += size;
  s.peak_bytes = std::max(s.peak_bytes, s.live_bytes);
  return p;
}

// The fast try first (no lock of this file's but the lifetime's). While
// the budget's count is short, the reclaim callback frees first (this
// process's own saved activations, released at once), and only then does
// the client's slow path ask the daemon and release tracked tensors:
// DELTA releases its own when an allocation fails.
absl::StatusOr<void*> Allocate(ssize_t size, int device) {
  AllocatorState& s = State();
  for (int round = 0;; ++round) {
    int64_t short_by = 0;
    absl::StatusOr<void*> p =
        AllocateOnce(s, size, device, /*fast=*/true, &short_by);
    if (p.ok() || !absl::IsResourceExhausted(p.status())) return p;
    // Short of chunks within the budget is the slow path's to fetch.
    if (short_by <= 0 || in_reclaim || round == kReclaimRounds) break;
    deltad_reclaim_fn fn;
    void* ctx;
    {
      std::lock_guard<std::mutex> lock(s.reclaim_mu);
      fn = s.reclaim;
      ctx = s.reclaim_ctx;
    }
    if (fn == nullptr) break;
    in_reclaim = true;
    const int64_t freed = fn(short_by, ctx);
    in_reclaim = false;
    {
      std::lock_guard<std::mutex> lock(s.reclaim_mu);
      ++s.reclaims;
      if (freed > 0) s.reclaimed_bytes += freed;
    }
    if (freed <= 0) break;
  }
  int64_t unused = 0;
  return AllocateOnce(s, size, device, /*fast=*/false, &unused);
}

}  // namespace

extern "C" {

int deltad_allocator_attach(deltad_client* client) {
  if (client == nullptr) {
    return Report(absl::InvalidArgumentError("client must not be NULL"));
  }
  AllocatorState& s = State();
  std::unique_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  if (s.attached != nullptr) {
    return Report(absl::FailedPreconditionError(
        s.attached == client
            ? "this deltad client is already the allocator's"
            : "another deltad client is the allocator's: detach it first "
              "(deltad_allocator_detach); one budget per process"));
  }
  s.attached = client;
  return 0;
}

int deltad_allocator_detach(void) {
  AllocatorState& s = State();
  std::unique_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  if (s.attached == nullptr) {
    return Report(absl::FailedPreconditionError(
        "no deltad client is attached to the allocator"));
  }
  s.attached = nullptr;
  return 0;
}

void* deltad_torch_malloc(ssize_t size, int device, void* /*stream*/) {
  if (size == 0) return nullptr;
  absl::StatusOr<void*> p = Allocate(size, device);
  if (!p.ok()) {
    Report(p.status());
    return nullptr;
  }
  return *p;
}

void* deltad_torch_malloc_or_raise(ssize_t size, int device, void* /*stream*/) {
  if (size == 0) return nullptr;
  absl::StatusOr<void*> p = Allocate(size, device);
  if (!p.ok()) {
    Report(p.status());
    throw OutOfDeviceMemory(std::string(p.status().message()));
  }
  return *p;
}

int deltad_allocator_reset_peak(void) {
  AllocatorState& s = State();
  std::lock_guard<std::mutex> lock(s.blocks_mu);
  s.peak_bytes = s.live_bytes;
  return 0;
}

int deltad_allocator_set_reclaim(deltad_reclaim_fn fn, void* ctx) {
  AllocatorState& s = State();
  std::lock_guard<std::mutex> lock(s.reclaim_mu);
  s.reclaim = fn;
  s.reclaim_ctx = fn == nullptr ? nullptr : ctx;
  return 0;
}

void deltad_torch_free(void* ptr, ssize_t /*size*/, int /*device*/,
                       void* /*stream*/) {
  if (ptr == nullptr) return;
  AllocatorState& s = State();
  std::shared_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  Block block;
  {
    std::lock_guard<std::mutex> lock(s.blocks_mu);
    auto it = s.blocks.find(ptr);
    if (it == s.blocks.end()) {
      Report(absl::NotFoundError(absl::StrCat(
          "freeing 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
          ": not a live block of the deltad allocator (freed already, or "
          "its client was closed); ignored")));
      return;
    }
    block = it->second;
    s.live_bytes -= block.bytes;
    s.blocks.erase(it);
  }
  block.owner->impl->FreeRaw(ptr, block.bytes);
}

int deltad_allocator_stats(deltad_allocator_usage* usage) {
  if (usage == nullptr) {
    return Report(absl::InvalidArgumentError("usage must not be NULL"));
  }
  *usage = deltad_allocator_usage{};
  AllocatorState& s = State();
  std::shared_lock<std::shared_mutex> lifetime(s.lifetime_mu);
  {
    std::lock_guard<std::mutex> lock(s.blocks_mu);
    usage->blocks = static_cast<int64_t>(s.blocks.size());
    usage->peak_allocated_bytes = s.peak_bytes;
  }
  {
    std::lock_guard<std::mutex> lock(s.reclaim_mu);
    usage->reclaims = s.reclaims;
    usage->reclaimed_bytes = s.reclaimed_bytes;
  }
  if (s.attached == nullptr) return 0;
  const deltad::client::ClientStats stats = s.attached->impl->Stats();
  usage->attached = 1;
  usage->allocated_bytes = stats.raw_bytes;
  usage->device_bytes = stats.device_bytes;
  usage->peak_device_bytes = stats.peak_device_bytes;
  usage->budget_bytes = stats.budget_bytes;
  return 0;
}

}  // extern "C"
