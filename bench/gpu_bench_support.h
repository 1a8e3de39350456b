// What gpu_bench's parts share: units, progress lines, fatal checks, size
// names and page-aligned host buffers.
#ifndef DELTAD_BENCH_GPU_BENCH_SUPPORT_H_
#define DELTAD_BENCH_GPU_BENCH_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/report.h"
#include "common/cuda_driver.h"

namespace deltad::bench {

inline constexpr int64_t kKiB = int64_t{1} << 10;
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int kAllocBatch = 8;
// ctest and the scripts read this exit status as "skipped".
inline constexpr int kExitSkipped = 77;

using Clock = std::chrono::steady_clock;

inline double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

inline double Millis(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

inline const Clock::time_point kStart = Clock::now();

inline void Note(const std::string& what) {
  std::fprintf(stderr, "gpu_bench [%6.1f s]: %s\n",
               std::chrono::duration<double>(Clock::now() - kStart).count(),
               what.c_str());
}

[[noreturn]] inline void Die(const std::string& why) {
  std::fprintf(stderr, "gpu_bench: %s\n", why.c_str());
  std::exit(1);
}

inline void Check(const absl::Status& s) {
  if (!s.ok()) Die(s.ToString());
}

inline void CheckRt(cudaError_t e, const char* what) {
  Check(common::CudaRtCheck(e, what));
}

inline double Median(std::vector<double> v) {
  return Summarise(std::move(v)).p50;
}

inline std::string SizeName(int64_t bytes) {
  if (bytes >= kMiB && bytes % kMiB == 0)
    return absl::StrCat(bytes / kMiB, " MiB");
  if (bytes >= kKiB && bytes % kKiB == 0)
    return absl::StrCat(bytes / kKiB, " KiB");
  return absl::StrCat(bytes, " B");
}

inline std::vector<int64_t> ParseMiB(const std::string& flag,
                                     const char* name) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    int64_t mib = 0;
    if (!absl::SimpleAtoi(part, &mib) || mib <= 0) {
      Die(absl::StrCat("--", name, ": \"", part, "\" is not a positive size"));
    }
    out.push_back(mib * kMiB);
  }
  if (out.empty()) Die(absl::StrCat("--", name, " names no size"));
  return out;
}

// Page-aligned heap memory, touched, freed on destruction: the kind of host
// memory the client copies to (the daemon's slabs, the heap fallback).
struct HostBuffer {
  explicit HostBuffer(int64_t bytes) : size(bytes) {
    if (posix_memalign(&data, 4096, static_cast<size_t>(bytes)) != 0) {
      Die(absl::StrCat("cannot allocate ", bytes, " host bytes"));
    }
    std::memset(data, 0x5a, static_cast<size_t>(bytes));
  }
  ~HostBuffer() { std::free(data); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  void* data = nullptr;
  int64_t size = 0;
};

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_GPU_BENCH_SUPPORT_H_
