#include "client/local_policy.h"

namespace deltad::client {

LocalPolicy::LocalPolicy(policy::LinkBandwidth link,
                         policy::FilterOptions filter)
    : filter_(filter, &costs_),
      director_(costs_),
      planner_(table_, filter_, director_) {
  (void)costs_.SetBandwidth(kGpu, link);
}

absl::StatusOr<std::vector<policy::ReleaseOrder>> LocalPolicy::Plan(
    int64_t bytes, int64_t now_ns, int64_t host_bytes_available) {
  return planner_.Release(policy::Scope{kGpu, kSession}, bytes, now_ns,
                          host_bytes_available);
}

absl::StatusOr<std::vector<policy::ReleaseOrder>> LocalPolicy::PlanUpTo(
    int64_t bytes, int64_t now_ns, int64_t host_bytes_available) {
  return planner_.ReleaseUpTo(policy::Scope{kGpu, kSession}, bytes, now_ns,
                              host_bytes_available);
}

}  // namespace deltad::client
