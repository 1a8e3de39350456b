#include "client/sim_device.h"

#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"

namespace deltad::client {

namespace {
// What cudaMalloc guarantees, so code that relies on it behaves the same.
constexpr size_t kAlignment = 256;
}  // namespace

absl::StatusOr<void*> SimDevice::Allocate(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  const int64_t before = allocated_.fetch_add(bytes);
  if (before + bytes > capacity_) {
    allocated_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("simulated GPU out of memory: ", bytes, " bytes asked, ",
                     capacity_ - before, " of ", capacity_, " free"));
  }
  const size_t rounded =
      (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    allocated_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "host memory behind the simulated GPU is exhausted (", bytes, ")"));
  }
  return p;
}

void SimDevice::Free(void* device, int64_t bytes) {
  if (device == nullptr) return;
  std::free(device);
  allocated_.fetch_sub(bytes);
}

}  // namespace deltad::client
