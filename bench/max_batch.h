#ifndef DELTAD_BENCH_MAX_BATCH_H_
#define DELTAD_BENCH_MAX_BATCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "policies/sim/allocator_model.h"
#include "policies/sim/device_profile.h"
#include "policies/sim/model_traces.h"

namespace deltad::sim {

// policy_bench --max_batch: the largest batch each policy trains within the
// memory a PyTorch process gets on the device (DeviceProfile::usable_bytes),
// and the unmanaged largest batch of ResNet-50 and ResNet-101 beside the
// DELTA paper's (its Tables III and IV: 891 and 594 on an A100 with Adam).
struct MaxBatchOptions {
  std::vector<std::string> models;
  std::vector<std::string> policies;
  DeviceProfile device;
  Optimizer optimizer = Optimizer::kAdam;
  AllocatorKind allocator = AllocatorKind::kPyTorchCaching;
  int64_t host_bytes = 0;
  std::string command;     // as run, for the report
  std::string update_doc;  // rewrite its policy_bench_max_batch section
};

// Prints the report; 0 when every run ran (a batch that does not fit is a
// result), 1 when a simulation failed (e.g. a policy reported an
// inconsistent state) or the document could not be written.
int RunMaxBatch(const MaxBatchOptions& options);

}  // namespace deltad::sim

#endif  // DELTAD_BENCH_MAX_BATCH_H_
