#ifndef DELTAD_CLIENT_LOCAL_POLICY_H_
#define DELTAD_CLIENT_LOCAL_POLICY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "policies/cost_model.h"
#include "policies/director.h"
#include "policies/filter.h"
#include "policies/release_planner.h"
#include "policies/tensor_table.h"

namespace deltad::client {

// The daemon's policy, run inside the process: the same Filter, Director
// and planner over a table of this process's tensors. The client keeps it in
// step with every event at all times, so that when the daemon is out of
// reach it can decide on its own at once, with the full history.
// Not thread safe: the client serialises calls.
class LocalPolicy {
 public:
  LocalPolicy(policy::LinkBandwidth link, policy::FilterOptions filter);

  policy::TensorTable& table() { return table_; }
  const policy::TensorTable& table() const { return table_; }

  // Tensors to release, in order, so that `bytes` more fit. All or nothing
  // (see ReleasePlanner::Release); chosen tensors change state at once.
  absl::StatusOr<std::vector<policy::ReleaseOrder>> Plan(
      int64_t bytes, int64_t now_ns, int64_t host_bytes_available);
  // As much of `bytes` as can be released (ReleasePlanner::ReleaseUpTo).
  absl::StatusOr<std::vector<policy::ReleaseOrder>> PlanUpTo(
      int64_t bytes, int64_t now_ns, int64_t host_bytes_available);

  static constexpr policy::SessionId kSession = 1;
  static constexpr policy::GpuId kGpu = 0;

 private:
  policy::TensorTable table_;
  policy::CostModel costs_;
  policy::Filter filter_;
  policy::Director director_;
  policy::ReleasePlanner planner_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_LOCAL_POLICY_H_
