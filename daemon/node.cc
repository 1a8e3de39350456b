#include "daemon/node.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/monotonic_clock.h"

namespace deltad::daemon {

namespace {

using common::MonotonicNs;

}  // namespace

absl::StatusOr<std::unique_ptr<Node>> Node::Create(
    DeviceBackend& backend, HostPool& pool, std::unique_ptr<NodeEvents> events,
    NodeOptions options) {
  if (!(options.gpu_share > 0) || options.gpu_share > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_share must be in (0, 1], got ", options.gpu_share));
  }
  std::unique_ptr<Node> node(
      new Node(backend, pool, std::move(events), std::move(options)));
  for (const GpuInfo& info : backend.gpus()) {
    // In whole chunks: the budget is handed out as chunks, and a part of
    // one could never be mapped, so counting it would promise room that a
    // chunk-backed process cannot get.
    auto budget = static_cast<int64_t>(node->options_.gpu_share *
                                       static_cast<double>(info.memory_bytes));
    if (info.chunk_granularity > 0 && budget >= info.chunk_granularity) {
      budget -= budget % info.chunk_granularity;
    }
    auto arbiter = GpuArbiter::Create(
        info.index, budget, node->options_.min_session_bytes,
        std::clamp<int64_t>(info.chunk_granularity, 1, budget));
    if (!arbiter.ok()) return arbiter.status();
    auto gpu = std::make_unique<Gpu>(std::move(*arbiter));
    GpuPolicyOptions policy = node->options_.policy;
    policy.link = {info.d2h_bytes_per_s, info.h2d_bytes_per_s};
    auto engine = GpuPolicy::Create(info.index, budget, policy);
    if (!engine.ok()) return engine.status();
    gpu->policy = std::move(*engine);
    node->gpus_.push_back(std::move(gpu));
    node->events_->GpuBudget(info.index, budget);
  }
  // The pool from the start, not from the first session.
  node->events_->HostPoolChanged(pool.Stats());
  return node;
}

void Node::AddBudgetOrders(const std::vector<BudgetChange>& changes,
                           SessionId except, Gpu& gpu, OrdersBySession& out) {
  for (const BudgetChange& c : changes) {
    (void)gpu.policy->SetBudget(c.session, c.budget_bytes);
    if (c.session == except) continue;
    out[c.session].set_new_budget_bytes(c.budget_bytes);
  }
}

void Node::ReportGpu(int gpu_index, Gpu& gpu) {
  GpuState state;
  state.used_bytes = gpu.policy->device_bytes();
  state.sessions = static_cast<int64_t>(gpu.arbiter.sessions());
  state.unresponsive_sessions = static_cast<int64_t>(gpu.unresponsive.size());
  for (const auto& [id, silence] : gpu.unresponsive) {
    state.unresponsive_bytes += chunks_.held_bytes(id);
  }
  state.unlisted_bytes = gpu.UnlistedTotal();
  events_->GpuChanged(gpu_index, state);
  events_->HostPoolChanged(pool_.Stats());
}

absl::StatusOr<Node::Opened> Node::OpenSession(
    absl::string_view peer_token, const v1::OpenSessionRequest& request) {
  const int g = request.gpu();
  if (g < 0 || g >= static_cast<int>(gpus_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("no GPU ", g, ": this node has ", gpus_.size(), " (0..",
                     static_cast<int>(gpus_.size()) - 1, ")"));
  }
  if (request.requested_budget_bytes() < 0 ||
      request.requested_host_bytes() < 0 || request.min_budget_bytes() < 0) {
    return absl::InvalidArgumentError("requested sizes must not be negative");
  }
  if (request.requested_host_bytes() > options_.max_host_quota_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("requested_host_bytes ", request.requested_host_bytes(),
                     " is above the limit of ", options_.max_host_quota_bytes,
                     " per session (limits.max_host_quota_bytes)"));
  }
  if (request.priority() > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("priority must be at most 100, got ", request.priority()));
  }
  SessionLimit refused_at = SessionLimit::kNone;
  auto session = registry_.Open(peer_token, g, request.priority(),
                                request.label(), &refused_at);
  if (!session.ok()) {
    if (refused_at != SessionLimit::kNone) {
      events_->OpenRefused(g, refused_at == SessionLimit::kPerUid
                                  ? OpenRefusal::kSessionsPerUid
                                  : OpenRefusal::kSessionsPerGpu);
    }
    return session.status();
  }
  Gpu& gpu = *gpus_[g];
  Opened opened;
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    auto changes = gpu.arbiter.AddSession(session->id, session->priority,
                                          request.requested_budget_bytes(),
                                          request.min_budget_bytes());
    if (!changes.ok()) {
      (void)registry_.Close(session->token);
      if (absl::IsResourceExhausted(changes.status())) {
        events_->OpenRefused(g, OpenRefusal::kAdmission);
      }
      return changes.status();
    }
    const int64_t budget = gpu.arbiter.BudgetOf(session->id);
    const int64_t wanted = request.requested_host_bytes() > 0
                               ? request.requested_host_bytes()
                               : options_.default_host_quota_bytes;
    // What the pool has left, if less: a session without host memory still
    // works (the Director evicts), so a pool short of the quota grants
    // what it has rather than fail, and an exhausted one grants nothing.
    const int64_t quota = std::min(wanted, pool_.Stats().free_bytes);
    auto slabs = quota >= pool_.slab_bytes()
                     ? pool_.Grant(session->id, quota)
                     : absl::StatusOr<std::vector<Slab>>(std::vector<Slab>{});
    if (slabs.ok()) opened.slabs = std::move(*slabs);
    int64_t granted_host = 0;
    for (const Slab& s : opened.slabs) granted_host += s.bytes;
    if (absl::Status s =
            gpu.policy->AddSession(session->id, budget, granted_host);
        !s.ok()) {
      (void)gpu.arbiter.RemoveSession(session->id);
      (void)pool_.ReleaseSession(session->id);
      (void)registry_.Close(session->token);
      return s;
    }
    // The process may have gone (PeerGone) between the registry admitting
    // the session and this lock: its reclaim found nothing here to undo, so
    // undo it now, or its share and slabs would be lost for good.
    if (!registry_.Authorize(session->token).ok()) {
      (void)gpu.policy->RemoveSession(session->id);
      (void)gpu.arbiter.RemoveSession(session->id);
      (void)pool_.ReleaseSession(session->id);
      return absl::UnavailableError(
          "the process went away while its session was being opened");
    }
    AddBudgetOrders(*changes, session->id, gpu, opened.others);
    v1::OpenSessionResponse& r = opened.response;
    r.set_session_token(session->token);
    r.set_session_id(session->id);
    r.set_granted_budget_bytes(budget);
    r.set_host_quota_bytes(granted_host);
    for (const Slab& s : opened.slabs) {
      v1::HostSlab* slab = r.add_host_slabs();
      slab->set_slab_id(s.id);
      slab->set_bytes(s.bytes);
    }
    r.set_side_socket_path(options_.side_socket_path);
    const GpuInfo& info = backend_.gpus()[g];
    r.set_backend(std::string(backend_.name()));
    r.set_chunk_bytes(info.chunk_granularity);
    r.set_gpu_uuid(info.uuid);
    r.set_gpu_memory_bytes(info.memory_bytes);
    chunks_.AddSession(session->id, g);
    r.set_d2h_bytes_per_second(info.d2h_bytes_per_s);
    r.set_h2d_bytes_per_second(info.h2d_bytes_per_s);
    ReportGpu(g, gpu);
  }
  return opened;
}

int64_t Node::Gpu::UnlistedTotal() const {
  int64_t sum = 0;
  for (const auto& [peer, left] : left_mapped) sum += left.bytes;
  for (const auto& [id, bytes] : unlisted) sum += bytes;
  return sum;
}

int64_t Node::Gpu::SettledLeftMapped() const {
  int64_t sum = 0;
  for (const auto& [peer, left] : left_mapped) {
    if (left.settled) sum += left.bytes;
  }
  return sum;
}

OrdersBySession Node::Reclaim(const SessionInfo& session, SessionEnd why,
                              absl::string_view detail) {
  OrdersBySession others;
  Gpu& gpu = *gpus_[session.gpu];
  absl::StatusOr<SessionUsage> held;
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    held = gpu.policy->Usage(session.id);
    (void)gpu.policy->RemoveSession(session.id);
    gpu.unresponsive.erase(session.id);
    auto changes = gpu.arbiter.RemoveSession(session.id);
    if (changes.ok()) AddBudgetOrders(*changes, session.id, gpu, others);
    // A process that lives on keeps what it maps in use, whatever is
    // released below: counted until it is gone (PeerGone, which runs
    // after the registry forgot the peer, under this lock, so the count
    // cannot outlive it).
    auto unlisted = gpu.unlisted.find(session.id);
    const int64_t mapped =
        chunks_.held_bytes(session.id) +
        (unlisted == gpu.unlisted.end() ? 0 : unlisted->second);
    if (unlisted != gpu.unlisted.end()) gpu.unlisted.erase(unlisted);
    if (why != SessionEnd::kProcessGone && mapped > 0 &&
        registry_.PeerOf(session.peer_token).ok()) {
      Gpu::LeftMapped& left = gpu.left_mapped[session.peer_token];
      left.bytes += mapped;
      left.since_ns = MonotonicNs();
    }
  }
  // The process has unmapped them, or is gone and its mappings with it; a
  // live process that kept them mapped keeps their memory alive whatever
  // the accounting says (see DeviceChunk::fd).
  (void)chunks_.ReleaseSession(session.id);
  // Wiping the slabs takes system calls: not under the GPU's lock, which
  // every session on the GPU waits for.
  if (!keep_slab_contents_.load()) (void)pool_.ReleaseSession(session.id);
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    ReportGpu(session.gpu, gpu);
  }
  events_->SessionEnded(session.gpu, session.id, why);
  end_log_.Ended(session, why, detail, held);
  return others;
}

absl::StatusOr<OrdersBySession> Node::CloseSession(absl::string_view token,
                                                   SessionEnd why,
                                                   absl::string_view detail) {
  auto session = registry_.Close(token);
  if (!session.ok()) return session.status();
  return Reclaim(*session, why, detail);
}

absl::StatusOr<std::vector<common::side::Grant>> Node::HostSlabs(
    absl::string_view session_token, absl::string_view peer_token) const {
  auto session = registry_.AuthorizeForPeer(session_token, peer_token);
  if (!session.ok()) return session.status();
  return pool_.DuplicateSlabsOf(session->id);
}

absl::StatusOr<Node::Granted> Node::GrantChunks(absl::string_view session_token,
                                                absl::string_view peer_token,
                                                int64_t target_bytes) {
  auto session = registry_.AuthorizeForPeer(session_token, peer_token);
  if (!session.ok()) return session.status();
  Gpu& gpu = *gpus_[session->gpu];
  int64_t most;
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    // Like the policy, which lets a session past its share while the GPU's
    // budget has room (the others then release first when they need it),
    // chunks come beyond the share as long as no one else holds them.
    // Chunks processes map without the daemon holding them are in use
    // too (a restart, a stall, a stream cut).
    const int64_t unheld = gpu.arbiter.budget_bytes() -
                           backend_.allocated_bytes(session->gpu) -
                           gpu.UnlistedTotal();
    most = std::max(
        gpu.arbiter.BudgetOf(session->id),
        chunks_.held_bytes(session->id) + std::max<int64_t>(0, unheld));
  }
  Granted granted;
  auto chunks = chunks_.Grant(session->id, target_bytes, most);
  if (!chunks.ok()) return chunks.status();
  granted.chunks = std::move(*chunks);
  const int64_t held = chunks_.held_bytes(session->id);
  if (held >= std::min(target_bytes, most)) return granted;
  // Short: whoever holds more than its budget is reminded of it.
  const auto holders = chunks_.HeldOnGpu(session->gpu);
  std::lock_guard<std::mutex> lock(gpu.mu);
  for (const auto& [other, other_held] : holders) {
    if (other == session->id) continue;
    const int64_t budget = gpu.arbiter.BudgetOf(other);
    if (budget > 0 && other_held > budget) {
      granted.others[other].set_new_budget_bytes(budget);
    }
  }
  return granted;
}

absl::Status Node::ReturnChunks(absl::string_view session_token,
                                absl::string_view peer_token,
                                absl::Span<const uint64_t> chunk_ids) {
  auto session = registry_.AuthorizeForPeer(session_token, peer_token);
  if (!session.ok()) return session.status();
  return chunks_.Return(session->id, chunk_ids);
}

OrdersBySession Node::PeerGone(absl::string_view peer_token) {
  OrdersBySession others;
  for (const SessionInfo& s : registry_.ForgetPeer(peer_token)) {
    for (auto& [id, orders] : Reclaim(s, SessionEnd::kProcessGone, {})) {
      others[id].MergeFrom(orders);
    }
  }
  // What its ended sessions left mapped is free now.
  for (size_t g = 0; g < gpus_.size(); ++g) {
    Gpu& gpu = *gpus_[g];
    std::lock_guard<std::mutex> lock(gpu.mu);
    auto left = gpu.left_mapped.find(std::string(peer_token));
    if (left == gpu.left_mapped.end()) continue;
    const bool settled = left->second.settled;
    gpu.left_mapped.erase(left);
    if (settled) ShareWithoutLeftMapped(gpu, others);
    ReportGpu(static_cast<int>(g), gpu);
  }
  return others;
}

void Node::ShareWithoutLeftMapped(Gpu& gpu, OrdersBySession& out) {
  AddBudgetOrders(gpu.arbiter.SetOutside(gpu.SettledLeftMapped()), 0, gpu, out);
}

OrdersBySession Node::SettleLeftMapped(int64_t settle_ns) {
  OrdersBySession changed;
  const int64_t now = MonotonicNs();
  for (size_t g = 0; g < gpus_.size(); ++g) {
    Gpu& gpu = *gpus_[g];
    std::lock_guard<std::mutex> lock(gpu.mu);
    bool settled = false;
    for (auto& [peer, left] : gpu.left_mapped) {
      if (!left.settled && now - left.since_ns >= settle_ns) {
        left.settled = settled = true;
      }
    }
    if (!settled) continue;
    ShareWithoutLeftMapped(gpu, changed);
    ReportGpu(static_cast<int>(g), gpu);
  }
  return changed;
}

absl::Status Node::SetUnlisted(absl::string_view token, int64_t bytes) {
  auto session = registry_.Authorize(token);
  if (!session.ok()) return session.status();
  const int64_t memory = backend_.gpus()[session->gpu].memory_bytes;
  if (bytes < 0 || bytes > memory) {
    return absl::InvalidArgumentError(
        absl::StrCat("unlisted_chunk_bytes must be within 0..", memory,
                     " (the GPU's memory), got ", bytes));
  }
  Gpu& gpu = *gpus_[session->gpu];
  std::lock_guard<std::mutex> lock(gpu.mu);
  // Between the registry and the GPU adding it, or after a close, the GPU
  // does not know it: nothing to count.
  if (!gpu.policy->Usage(session->id).ok()) return absl::OkStatus();
  if (bytes == 0) {
    gpu.unlisted.erase(session->id);
  } else {
    gpu.unlisted[session->id] = bytes;
  }
  ReportGpu(session->gpu, gpu);
  return absl::OkStatus();
}

absl::StatusOr<OrdersBySession> Node::Apply(absl::string_view token,
                                            const v1::EventBatch& batch) {
  auto session = registry_.Authorize(token);
  if (!session.ok()) return session.status();
  Gpu& gpu = *gpus_[session->gpu];
  std::lock_guard<std::mutex> lock(gpu.mu);
  const int64_t now = MonotonicNs();
  if (absl::Status s = ApplyBatch(*session, gpu, batch, now); !s.ok()) {
    return s;
  }
  const auto start = std::chrono::steady_clock::now();
  std::map<SessionId, v1::Orders> orders = gpu.policy->Plan(session->id, now);
  events_->Decided(session->gpu, session->id,
                   std::chrono::steady_clock::now() - start);
  for (const auto& [id, o] : orders) events_->Ordered(session->gpu, id, o);
  ReportGpu(session->gpu, gpu);
  return OrdersBySession(orders.begin(), orders.end());
}

namespace {

// Once per session, at the end of its third iteration, where the replay
// is on.
void LogPrefetchOrder(const SessionInfo& session, const PrefetchOrder& o) {
  if (!o.enabled()) return;
  const std::string why =
      o.replay_ns() < 0
          ? "no iteration of it was recorded to replay (tensors without "
            "stable keys, or past limits.max_recorded_accesses)"
          : absl::StrFormat(
                "iteration 2 in the last iteration's order took "
                "%.1f ms, iteration 3 in the queue's %.1f ms",
                static_cast<double>(o.replay_ns()) / 1e6,
                static_cast<double>(o.queue_ns()) / 1e6);
  std::fprintf(stderr,
               "deltad: session %llu (GPU %d): prefetches follow %s (%s)\n",
               static_cast<unsigned long long>(session.id), session.gpu,
               o.choice() == PrefetchOrder::Choice::kReplay
                   ? "its last iteration's order"
                   : "DELTA's queue",
               why.c_str());
}

}  // namespace

absl::Status Node::ApplyBatch(const SessionInfo& session, Gpu& gpu,
                              const v1::EventBatch& batch, int64_t now) {
  if (batch.iteration_peak_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("EventBatch.iteration_peak_bytes must not be negative, "
                     "got ",
                     batch.iteration_peak_bytes()));
  }
  AppliedCounts applied;
  if (absl::Status s = gpu.policy->Apply(session.id, batch, now, &applied);
      !s.ok()) {
    return s;
  }
  events_->BatchApplied(session.gpu, session.id, applied);
  if (batch.iteration_peak_bytes() > 0) {
    absl::StatusOr<const PrefetchOrder*> order =
        gpu.policy->EndIteration(session.id, now);
    if (!order.ok()) return order.status();
    if (*order != nullptr) LogPrefetchOrder(session, **order);
    return gpu.arbiter.SetIterationPeak(session.id,
                                        batch.iteration_peak_bytes());
  }
  return absl::OkStatus();
}

absl::StatusOr<Node::Released> Node::Release(
    const v1::ReleaseRequest& request) {
  auto session = registry_.Authorize(request.session_token());
  if (!session.ok()) return session.status();
  if (request.bytes() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes to release must be positive, got ", request.bytes()));
  }
  Gpu& gpu = *gpus_[session->gpu];
  std::lock_guard<std::mutex> lock(gpu.mu);
  // Checked before the batch is applied, so a request refused for its size
  // leaves the batch unapplied too.
  if (request.bytes() > gpu.policy->gpu_budget_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "an allocation of ", request.bytes(), " bytes is larger than GPU ",
        session->gpu, "'s whole budget of ", gpu.policy->gpu_budget_bytes(),
        " bytes"));
  }
  const int64_t now = MonotonicNs();
  if (request.has_batch()) {
    if (absl::Status s = ApplyBatch(*session, gpu, request.batch(), now);
        !s.ok()) {
      return s;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto orders = gpu.policy->MakeRoom(session->id, request.bytes(), now);
  events_->Decided(session->gpu, session->id,
                   std::chrono::steady_clock::now() - start);
  if (!orders.ok()) return orders.status();
  Released released;
  // MakeRoom succeeded: once its orders are carried out, the GPU has room.
  released.response.set_room_available(true);
  // The asker's own orders are gathered as Orders, to be reported like
  // anyone else's, and then moved into the reply.
  v1::Orders own;
  // Orders already sent on the stream count as done in MakeRoom's sums but
  // may still be on their way: repeated here, so that the process carries
  // them out before it allocates.
  for (v1::ReleaseOrder& o : gpu.policy->TakeStreamReleases(session->id)) {
    released.response.set_bytes(released.response.bytes() + o.bytes());
    *own.add_release() = std::move(o);
  }
  for (auto& [id, list] : *orders) {
    if (id == session->id) {
      for (v1::ReleaseOrder& o : list) {
        released.response.set_bytes(released.response.bytes() + o.bytes());
        *own.add_release() = std::move(o);
      }
    } else {
      for (v1::ReleaseOrder& o : list) {
        *released.others[id].add_release() = std::move(o);
      }
    }
  }
  events_->Ordered(session->gpu, session->id, own);
  for (const auto& [id, o] : released.others) {
    events_->Ordered(session->gpu, id, o);
  }
  released.response.mutable_release()->Swap(own.mutable_release());
  ReportGpu(session->gpu, gpu);
  return released;
}

void Node::SetReachable(SessionId session, bool reachable) {
  const std::optional<SessionInfo> info = Find(session);
  if (!info.has_value()) return;
  Gpu& gpu = *gpus_[info->gpu];
  std::lock_guard<std::mutex> lock(gpu.mu);
  (void)gpu.policy->SetReachable(session, reachable);
}

void Node::Undeliverable(SessionId session, const v1::Orders& orders) {
  const std::optional<SessionInfo> info = Find(session);
  if (!info.has_value()) return;
  Gpu& gpu = *gpus_[info->gpu];
  std::lock_guard<std::mutex> lock(gpu.mu);
  gpu.policy->Undeliverable(session, orders);
}

}  // namespace deltad::daemon
