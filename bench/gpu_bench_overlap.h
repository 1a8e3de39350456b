// gpu_bench (d): copy/compute overlap through the client's CudaDevice.
#ifndef DELTAD_BENCH_GPU_BENCH_OVERLAP_H_
#define DELTAD_BENCH_GPU_BENCH_OVERLAP_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "client/cuda_device.h"

namespace deltad::bench {

struct OverlapRow {
  std::string copy;
  double kernel_ms = 0;
  double copy_ms = 0;
  double both_ms = 0;
  double overlap() const {
    return (kernel_ms + copy_ms - both_ms) / std::min(kernel_ms, copy_ms);
  }
};

// A spin kernel on the compute stream and a copy of `bytes` on the device's
// own stream, alone and together, `reps` times each way (D2H, then H2D).
std::vector<OverlapRow> MeasureOverlap(client::CudaDevice& device,
                                       int64_t bytes, int reps);

}  // namespace deltad::bench

#endif  // DELTAD_BENCH_GPU_BENCH_OVERLAP_H_
