// Client::AllocateRaw and FreeRaw: device memory counted in the budget with
// no tensor behind it, for a framework's own allocator (see
// client/torch_allocator.cc). Apart from client.cc, which holds the tensors'
// life cycle, because nothing here has one.
#include <mutex>

#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace deltad::client {

absl::StatusOr<void*> Client::AllocateRaw(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " device bytes"));
  }
  if (void* p = TryAllocateWithinBudget(bytes, /*raw=*/true)) return p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return absl::FailedPreconditionError(
          absl::StrCat("the deltad client is closed: no device memory for ",
                       bytes, " bytes"));
    }
  }
  absl::StatusOr<void*> p = AllocateDeviceSlow(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (p.ok()) {
    raw_bytes_ += bytes;
    return p;
  }
  if (!absl::IsResourceExhausted(p.status())) return p.status();
  // The framework reports this as its out-of-memory error, so it says what
  // the budget holds, whatever the step that gave up.
  return absl::ResourceExhaustedError(absl::StrCat(
      "deltad: no room for ", bytes, " bytes within the budget of ",
      budget_bytes_, " bytes: ", device_bytes_, " held (", raw_bytes_,
      " by the allocator, ", device_bytes_ - raw_bytes_,
      " by tracked tensors) after releasing what could be: ",
      p.status().message()));
}

void Client::FreeRaw(void* p, int64_t bytes) {
  if (p == nullptr || bytes <= 0) return;
  // The memory first, so that an allocation that sees the room finds it.
  device_->Free(p, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  device_bytes_ -= bytes;
  raw_bytes_ -= bytes;
}

}  // namespace deltad::client
