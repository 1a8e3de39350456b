#ifndef DELTAD_DAEMON_NODE_EVENTS_H_
#define DELTAD_DAEMON_NODE_EVENTS_H_

#include <chrono>
#include <cstdint>

#include "daemon/gpu_policy.h"
#include "daemon/host_pool.h"
#include "daemon/session_id.h"
#include "daemon/session_lifecycle.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::daemon {

// A limit the node refused to open a session at.
enum class OpenRefusal {
  kSessionsPerUid,  // NodeOptions::max_sessions_per_uid
  kSessionsPerGpu,  // NodeOptions::max_sessions_per_gpu
  kAdmission,       // its floor would not fit beside the others' (GpuArbiter)
};

// One GPU as it stands after a change.
struct GpuState {
  int64_t used_bytes = 0;  // what its sessions report holding
  int64_t sessions = 0;
  int64_t unresponsive_sessions = 0;  // silent past their lease
  int64_t unresponsive_bytes = 0;     // the chunk bytes those hold
  int64_t unlisted_bytes = 0;         // mapped by processes, held by no session
};

// What the Node reports as it works, in its own terms, to whoever watches
// it: MetricsObserver in the daemon, a fake in a test. Nothing the node
// decides depends on what an observer does. Every event does nothing by
// default, so that an observer overrides only those it watches and a node
// without one needs no checks.
//
// Events come from whichever thread calls the Node, most with the lock of
// their GPU held: an observer must be thread safe and quick, and must not
// call back into the Node.
class NodeEvents {
 public:
  virtual ~NodeEvents() = default;

  // At Create, for each GPU: what the node hands out on it.
  virtual void GpuBudget(int /*gpu*/, int64_t /*budget_bytes*/) {}
  // After anything that may have changed the GPU.
  virtual void GpuChanged(int /*gpu*/, const GpuState& /*state*/) {}
  // At Create, and after each GpuChanged: sessions hold and free the pool.
  virtual void HostPoolChanged(const HostPoolStats& /*pool*/) {}
  // OpenSession refused at a limit (not for a malformed request).
  virtual void OpenRefused(int /*gpu*/, OpenRefusal /*why*/) {}
  // A session's batch applied: what it reported having done.
  virtual void BatchApplied(int /*gpu*/, SessionId /*session*/,
                            const AppliedCounts& /*applied*/) {}
  // One decision for `session`: the plan after its batch (Apply), or room
  // made for its allocation (Release), whether or not room could be made.
  virtual void Decided(int /*gpu*/, SessionId /*session*/,
                       std::chrono::nanoseconds /*took*/) {}
  // What the decision reported just before ordered `session`, the one
  // that asked included; once per session the decision reached.
  virtual void Ordered(int /*gpu*/, SessionId /*session*/,
                       const v1::Orders& /*orders*/) {}
  virtual void LeaseChanged(int /*gpu*/, SessionId /*session*/,
                            LeaseEvent /*event*/) {}
  // After its GPU and pool let go of it, before its end is logged.
  virtual void SessionEnded(int /*gpu*/, SessionId /*session*/,
                            SessionEnd /*why*/) {}
};

}  // namespace deltad::daemon

#endif  // DELTAD_DAEMON_NODE_EVENTS_H_
