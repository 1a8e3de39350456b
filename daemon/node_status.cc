// What the Node shows of itself: the node's status, each GPU's and each
// session's totals (NodeStatus, for anyone on the socket), and a session's
// largest tensors (ListTensors, for its own user).
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/monotonic_clock.h"
#include "daemon/node.h"

namespace deltad::daemon {

using common::MonotonicNs;

absl::StatusOr<v1::ListTensorsResponse> Node::ListTensors(
    const v1::ListTensorsRequest& request) const {
  if (request.limit() > kMaxListTensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "limit must be at most ", kMaxListTensors, ", got ", request.limit()));
  }
  const size_t limit =
      request.limit() == 0 ? kDefaultListTensors : request.limit();
  // Tensor ids, sizes and access times tell what a job is doing: only its
  // own user (or root, or the daemon's) may see them. Anyone on the socket
  // sees NodeStatus's per-session totals.
  auto caller = registry_.PeerOf(request.peer_token());
  if (!caller.ok()) return caller.status();
  for (const SessionInfo& info : registry_.List()) {
    if (info.id != request.session_id()) continue;
    if (caller->uid != info.peer.uid && caller->uid != 0 &&
        caller->uid != ::geteuid()) {
      return absl::PermissionDeniedError(
          absl::StrCat("session ", info.id, " belongs to uid ", info.peer.uid,
                       "; only that user, root or deltad's user may list its "
                       "tensors"));
    }
    Gpu& gpu = *gpus_[info.gpu];
    std::lock_guard<std::mutex> lock(gpu.mu);
    auto tensors = gpu.policy->LargestTensors(info.id, limit, MonotonicNs());
    // Between the registry admitting a session and its GPU adding it, or
    // after a concurrent close, the engine does not know it: same answer.
    if (!tensors.ok()) break;
    v1::ListTensorsResponse r;
    for (v1::TensorStatus& t : *tensors) *r.add_tensors() = std::move(t);
    return r;
  }
  return absl::NotFoundError(
      absl::StrCat("no session ", request.session_id(),
                   " on this node (deltactl sessions lists them)"));
}

v1::NodeStatusResponse Node::Status() const {
  v1::NodeStatusResponse r;
  r.set_version(options_.version);
  r.set_backend(std::string(backend_.name()));
  const std::vector<SessionInfo> sessions = registry_.List();
  // The reply must fit in a gRPC message whatever the sessions are: a
  // reply too large to send would fail deltactl for every user.
  int64_t session_bytes = 0;
  uint32_t omitted = 0;
  for (size_t g = 0; g < gpus_.size(); ++g) {
    const GpuInfo& info = backend_.gpus()[g];
    Gpu& gpu = *gpus_[g];
    std::lock_guard<std::mutex> lock(gpu.mu);
    v1::GpuStatus* s = r.add_gpus();
    s->set_gpu(info.index);
    s->set_name(info.name);
    s->set_uuid(info.uuid);
    s->set_memory_bytes(info.memory_bytes);
    s->set_budget_bytes(gpu.arbiter.budget_bytes());
    s->set_used_bytes(gpu.policy->device_bytes());
    s->set_d2h_bytes_per_second(info.d2h_bytes_per_s);
    s->set_h2d_bytes_per_second(info.h2d_bytes_per_s);
    s->set_sessions(static_cast<uint32_t>(gpu.arbiter.sessions()));
    s->set_chunk_bytes(backend_.allocated_bytes(static_cast<int>(g)));
    s->set_unlisted_bytes(gpu.UnlistedTotal());
    const int64_t now = MonotonicNs();
    for (const SessionInfo& session : sessions) {
      if (session.gpu != static_cast<int>(g)) continue;
      auto usage = gpu.policy->Usage(session.id);
      v1::SessionStatus out;
      out.set_session_id(session.id);
      out.set_gpu(session.gpu);
      out.set_pid(session.peer.pid);
      out.set_uid(session.peer.uid);
      out.set_label(session.label);
      out.set_chunk_bytes(chunks_.held_bytes(session.id));
      out.set_floor_bytes(gpu.arbiter.FloorOf(session.id));
      if (auto it = gpu.unlisted.find(session.id); it != gpu.unlisted.end()) {
        out.set_unlisted_bytes(it->second);
      }
      if (auto it = gpu.unresponsive.find(session.id);
          it != gpu.unresponsive.end()) {
        out.set_unresponsive_ms(
            (it->second.silent_ns + now - it->second.since_ns) / 1000000);
        s->set_unresponsive_bytes(s->unresponsive_bytes() + out.chunk_bytes());
      }
      if (usage.ok()) {
        out.set_budget_bytes(usage->budget_bytes);
        out.set_device_bytes(usage->device_bytes);
        out.set_host_bytes(usage->host_bytes);
        out.set_tensors(static_cast<uint64_t>(usage->tensors));
        out.set_releases(usage->releases_ordered);
      }
      // With its tag and length prefix, at most 6 bytes more.
      const auto bytes = static_cast<int64_t>(out.ByteSizeLong()) + 6;
      if (r.sessions_size() >= options_.max_status_sessions ||
          session_bytes + bytes > options_.max_status_bytes) {
        ++omitted;
        continue;
      }
      session_bytes += bytes;
      *r.add_sessions() = std::move(out);
    }
  }
  const HostPoolStats pool = pool_.Stats();
  r.set_host_pool_bytes(pool.total_bytes);
  r.set_host_pool_granted_bytes(pool.granted_bytes);
  r.set_sessions_omitted(omitted);
  return r;
}

}  // namespace deltad::daemon
