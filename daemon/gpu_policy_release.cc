// GpuPolicy's releases: who may lose tensors (MakeRoom, the early offloads
// and prefetches of Plan), and the orders as their sessions read them.

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/gpu_policy.h"
#include "policies/status_macros.h"

namespace deltad::daemon {

using policy::Tensor;
using policy::TensorId;
using policy::TensorState;

namespace {

int64_t Fraction(double fraction, int64_t bytes) {
  return static_cast<int64_t>(
      std::floor(fraction * static_cast<double>(bytes)));
}

// Whether an error from the planner only says that no tensor qualified.
bool NothingToRelease(const absl::Status& s) {
  return absl::IsNotFound(s) || absl::IsResourceExhausted(s);
}

}  // namespace

// --- Releases ----------------------------------------------------------------

int64_t GpuPolicy::HostLeft(SessionId session, const Session& s) const {
  return std::max<int64_t>(
      0, s.host_quota_bytes - table_.SessionStats(session).host_bytes);
}

int64_t GpuPolicy::AccountableBytes(SessionId session) const {
  int64_t sum = 0;
  for (const auto& [id, s] : sessions_) {
    const int64_t held = table_.SessionStats(id).committed_bytes();
    sum += id == session ? held : std::min(held, s.budget_bytes);
  }
  return sum;
}

void GpuPolicy::Count(const policy::ReleaseOrder& order, SessionId requester,
                      Shortage& shortage) const {
  shortage.freed += order.bytes;
  if (table_.Find(order.id)->session == requester) {
    shortage.own_freed += order.bytes;
  }
}

absl::flat_hash_map<SessionId, GpuPolicy::Victim> GpuPolicy::Victims(
    SessionId requester, int64_t incoming, Tier tier) const {
  absl::flat_hash_map<SessionId, Victim> out;
  for (const auto& [id, s] : sessions_) {
    if (tier == Tier::kRequester) {
      if (id == requester) {
        out.emplace(
            id, Victim{HostLeft(id, s), std::numeric_limits<int64_t>::max()});
      }
      continue;
    }
    // An order to a session without a stream would free nothing.
    if (id != requester && !s.reachable) continue;
    const int64_t held = table_.SessionStats(id).committed_bytes() +
                         (id == requester ? incoming : 0);
    if (held > s.budget_bytes) {
      out.emplace(id, Victim{HostLeft(id, s), held - s.budget_bytes});
    }
  }
  return out;
}

absl::StatusOr<policy::ReleaseOrder> GpuPolicy::ReleaseOne(SessionId requester,
                                                           int64_t incoming,
                                                           Tier tier,
                                                           int64_t now_ns) {
  // Victims and host are read afresh for each tensor: the last release may
  // have brought its session down to its share or used its host quota.
  const absl::flat_hash_map<SessionId, Victim> victims =
      Victims(requester, incoming, tier);
  if (victims.empty()) {
    return absl::NotFoundError("no session may lose tensors");
  }
  int64_t most_host = 0;
  for (const auto& [id, v] : victims) {
    most_host = std::max(most_host, v.host_left);
  }
  // An offload is priced behind the copies already queued on the link.
  costs_.SetOffloadBacklog(gpu_, table_.GpuStats(gpu_).releasing_bytes);
  policy::ReleasePlanner planner(table_, filter_, director_);
  // One tensor per call. The planner takes one host figure, but each session
  // offloads into its own quota: the eligibility checks the owner's quota,
  // and the figure passed is the largest, so it never refuses what the
  // owner's quota allows.
  // One session may lose tensors (often the requester alone): search its
  // own candidates, not the whole GPU's, where a sample would mostly draw
  // tensors of sessions that may not lose any.
  const policy::Scope scope = victims.size() == 1
                                  ? policy::Scope{gpu_, victims.begin()->first}
                                  : policy::Scope{gpu_, std::nullopt};
  absl::StatusOr<std::vector<policy::ReleaseOrder>> orders =
      planner.Release(scope, 1, now_ns, most_host, [&](const Tensor& t) {
        auto v = victims.find(t.session);
        return v != victims.end() && t.bytes <= v->second.max_bytes &&
               director_.CanRelease(t, v->second.host_left);
      });
  if (!orders.ok()) return orders.status();
  policy::ReleaseOrder order = orders->front();
  if (order.action == policy::ReleaseAction::kOffload) {
    const SessionId owner = table_.Find(order.id)->session;
    if (table_.SessionStats(owner).host_bytes >
        sessions_.at(owner).host_quota_bytes) {
      // The Director saw the larger figure; with the owner's own it would
      // have evicted (the eligibility made sure the tensor may be evicted).
      DELTAD_RETURN_IF_ERROR(table_.CancelRelease(order.id));
      DELTAD_RETURN_IF_ERROR(table_.SetState(order.id, TensorState::kEvicted));
      order.action = policy::ReleaseAction::kEvict;
    }
  }
  return order;
}

std::optional<policy::ReleaseOrder> GpuPolicy::OffloadOneAhead(
    SessionId requester, Tier tier, int64_t now_ns) {
  const absl::flat_hash_map<SessionId, Victim> victims =
      Victims(requester, 0, tier);
  if (victims.empty()) return std::nullopt;
  int64_t most_host = 0;
  for (const auto& [id, v] : victims) {
    most_host = std::max(most_host, v.host_left);
  }
  costs_.SetOffloadBacklog(gpu_, table_.GpuStats(gpu_).releasing_bytes);
  policy::ReleasePlanner planner(table_, filter_, director_);
  // Only offloads: a tensor that fits its owner's quota gets the same
  // decision from the Director under the larger figure.
  std::vector<policy::ReleaseOrder> orders = planner.OffloadAhead(
      policy::Scope{gpu_, std::nullopt}, 1, now_ns, most_host,
      [&](const Tensor& t) {
        auto v = victims.find(t.session);
        if (auto r = refused_at_.find(t.id);
            r != refused_at_.end() && now_ns - r->second < kRefusalBackoffNs) {
          return false;
        }
        return v != victims.end() && t.bytes <= v->second.host_left &&
               t.bytes <= v->second.max_bytes;
      });
  if (orders.empty()) return std::nullopt;
  return orders.front();
}

std::pair<SessionId, v1::ReleaseOrder> GpuPolicy::ToWire(
    const policy::ReleaseOrder& order) const {
  const SessionId owner = table_.Find(order.id)->session;
  v1::ReleaseOrder out;
  out.set_tensor_id(sessions_.at(owner).locals.at(order.id));
  out.set_action(order.action == policy::ReleaseAction::kOffload
                     ? v1::ReleaseOrder::OFFLOAD
                     : v1::ReleaseOrder::EVICT);
  out.set_bytes(order.bytes);
  return {owner, std::move(out)};
}

absl::StatusOr<std::map<SessionId, std::vector<v1::ReleaseOrder>>>
GpuPolicy::MakeRoom(SessionId session, int64_t bytes, int64_t now_ns) {
  if (!sessions_.contains(session)) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("room asked must not be negative, got ", bytes, " bytes"));
  }
  if (bytes > gpu_budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " asks room for ", bytes, " bytes, more than GPU ",
        gpu_, "'s whole budget of ", gpu_budget_bytes_,
        " bytes; no release can make that much room"));
  }
  // The rule: release what the GPU lacks, max(0, committed bytes of the GPU
  // + bytes - GPU budget). Below the budget nothing is released even when
  // the session passes its share; a session's share only decides who loses
  // tensors (see Victims). The requester's own excess is not added: when it
  // is over its share it is among the first victims anyway, and adding its
  // excess would release memory nobody asked for.
  Shortage shortage;
  shortage.gpu =
      table_.GpuStats(gpu_).committed_bytes() + bytes - gpu_budget_bytes_;
  std::map<SessionId, std::vector<v1::ReleaseOrder>> out;
  if (shortage.gpu <= 0) return out;
  // Others' claims beyond their shares are theirs to release: what of them
  // stays (pinned, or never real) must cost the requester nothing.
  shortage.own = AccountableBytes(session) + bytes - gpu_budget_bytes_;

  std::vector<policy::ReleaseOrder> chosen;
  absl::Status failure;
  // The tensors of one request come from one sample (policy::Filter::Batch):
  // a sample's misses were most of each tensor's decision.
  policy::Filter::Batch batch(filter_);
  for (Tier tier : {Tier::kOverShare, Tier::kRequester}) {
    while (shortage.Wants(tier) && failure.ok()) {
      absl::StatusOr<policy::ReleaseOrder> order =
          ReleaseOne(session, bytes, tier, now_ns);
      if (!order.ok()) {
        if (!NothingToRelease(order.status())) failure = order.status();
        break;
      }
      Count(*order, session, shortage);
      chosen.push_back(*order);
    }
  }
  // Others release only down to their shares, so the requester's part is
  // met whenever the whole lack is.
  if (shortage.own_freed < shortage.own || !failure.ok()) {
    // All or nothing: undo in reverse so the table ends as it began.
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
      DELTAD_RETURN_IF_ERROR(table_.CancelRelease(it->id));
    }
    if (!failure.ok()) return failure;
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " asks room for ", bytes, " bytes: GPU ", gpu_,
        " must release ", shortage.gpu, " bytes, ", shortage.own,
        " of them from the asking session (its own bytes, and other "
        "sessions' up to their shares); can free at most ",
        shortage.freed, " bytes, ", shortage.own_freed,
        " of them the asking session's (victims may come only from sessions "
        "above their share and from the asking session; the rest is within "
        "other sessions' shares, pinned, or needs host memory their quotas "
        "lack)"));
  }
  for (const policy::ReleaseOrder& o : chosen) {
    // The asking session gets its own orders in the answer; the others'
    // go on their streams.
    auto [owner, wire] = Order(o, /*on_stream_unless=*/session);
    out[owner].push_back(std::move(wire));
  }
  return out;
}

std::pair<SessionId, v1::ReleaseOrder> GpuPolicy::Order(
    const policy::ReleaseOrder& order, SessionId on_stream_unless) {
  auto ordered = ToWire(order);
  Session& owner = sessions_.at(ordered.first);
  ++owner.releases_ordered;
  if (ordered.first != on_stream_unless) {
    NoteStreamRelease(owner, ordered.first, order.id);
  }
  return ordered;
}

std::optional<policy::ReleaseAction> GpuPolicy::Outstanding(const Tensor* t,
                                                            SessionId session) {
  if (t == nullptr || t->session != session) return std::nullopt;
  if (t->state == TensorState::kOffloading) {
    return policy::ReleaseAction::kOffload;
  }
  if (t->state == TensorState::kEvicted && t->evicted_from_device) {
    return policy::ReleaseAction::kEvict;
  }
  return std::nullopt;
}

void GpuPolicy::NoteStreamRelease(Session& owner, SessionId owner_id,
                                  TensorId id) {
  owner.stream_releases.push_back(id);
  if (owner.stream_releases.size() < owner.stream_releases_cap) return;
  std::erase_if(owner.stream_releases, [&](TensorId t) {
    return !Outstanding(table_.Find(t), owner_id).has_value();
  });
  // Doubling keeps the pruning amortised O(1) per order.
  owner.stream_releases_cap =
      std::max<size_t>(4096, 2 * owner.stream_releases.size());
}

std::vector<v1::ReleaseOrder> GpuPolicy::TakeStreamReleases(SessionId session) {
  std::vector<v1::ReleaseOrder> out;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return out;
  std::vector<TensorId> ids;
  ids.swap(it->second.stream_releases);
  it->second.stream_releases_cap = 4096;
  for (TensorId id : ids) {
    const Tensor* t = table_.Find(id);
    const std::optional<policy::ReleaseAction> action = Outstanding(t, session);
    if (!action) continue;
    out.push_back(ToWire({id, *action, t->bytes}).second);
  }
  return out;
}

// --- Plan --------------------------------------------------------------------

std::map<SessionId, v1::Orders> GpuPolicy::Plan(SessionId session,
                                                int64_t now_ns) {
  std::map<SessionId, v1::Orders> out;
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return out;
  // Refusals long past, and those of tensors gone with their session.
  if (refused_at_.size() > 4096) {
    absl::erase_if(refused_at_, [&](const auto& r) {
      return now_ns - r.second >= kRefusalBackoffNs ||
             table_.Find(r.first) == nullptr;
    });
  }

  // DELTA's early start, over the GPU: above the high watermark, offload
  // down to the low one, from the same victims as MakeRoom, so that copies
  // overlap compute instead of an allocation waiting for them later.
  // The session's own tensors go only toward its own part, as in MakeRoom.
  absl::StatusOr<int64_t> to_free = watermarks_.BytesToFree(
      table_.GpuStats(gpu_).committed_bytes(), 0, gpu_budget_bytes_);
  absl::StatusOr<int64_t> own_to_free =
      watermarks_.BytesToFree(AccountableBytes(session), 0, gpu_budget_bytes_);
  if (to_free.ok() && *to_free > 0 && own_to_free.ok()) {
    Shortage shortage;
    shortage.gpu = *to_free;
    shortage.own = *own_to_free;
    policy::Filter::Batch batch(filter_);
    for (Tier tier : {Tier::kOverShare, Tier::kRequester}) {
      while (shortage.Wants(tier)) {
        std::optional<policy::ReleaseOrder> order =
            OffloadOneAhead(session, tier, now_ns);
        if (!order) break;
        Count(*order, session, shortage);
        // Every one on a stream, the session's own included.
        auto [owner, wire] = Order(*order, /*on_stream_unless=*/0);
        *out[owner].add_release() = std::move(wire);
      }
    }
  }

  // Prefetch for the session, up to the high watermark of its budget, and
  // never past that of the GPU counting offloads still in flight: a reload
  // allocates now, and past the mark it would only be offloaded again. The
  // others count on the GPU up to their budgets, as in MakeRoom: one that
  // claims more than it was given cannot stop everyone's prefetches (its
  // excess is the first released when the reloads need the room).
  Session& s = it->second;
  std::erase_if(s.reloading, [&](TensorId id) {
    const Tensor* t = table_.Find(id);
    return t == nullptr || t->state != TensorState::kReloading;
  });
  const int64_t room = std::min(
      Fraction(watermarks_.high(), s.budget_bytes) -
          table_.SessionStats(session).committed_bytes(),
      Fraction(watermarks_.high(), gpu_budget_bytes_) -
          AccountableBytes(session) - table_.GpuStats(gpu_).releasing_bytes);
  if (room > 0 && now_ns >= s.prefetch_held_until_ns) {
    const int in_flight = static_cast<int>(s.reloading.size());
    std::vector<TensorId> ids;
    if (const policy::AccessPlan* plan = s.order->plan(); plan != nullptr) {
      // The last iteration's order, looking ahead as far as the budget's
      // window; the queue waits, kept short.
      policy::PrefetchOptions replay;
      replay.max_in_flight = options_.max_prefetch_in_flight;
      replay.window_bytes =
          std::max<int64_t>(1, s.order->WindowBytes(s.budget_bytes));
      absl::StatusOr<policy::Prefetcher> replayer =
          policy::Prefetcher::Create(replay);
      if (replayer.ok()) {
        ids = replayer->Plan(table_, room, in_flight, plan, session);
      }
      if (s.prefetcher->queued() > 2 * s.locals.size() + 64) {
        s.prefetcher->DropStale(table_);
      }
    } else {
      ids = s.prefetcher->Plan(table_, room, in_flight, nullptr, session);
    }
    for (TensorId id : ids) {
      if (!table_.SetState(id, TensorState::kReloading).ok()) continue;
      s.reloading.push_back(id);
      out[session].add_prefetch_tensor_ids(s.locals.at(id));
    }
  } else if (s.prefetcher->queued() > 2 * s.locals.size() + 64) {
    // Without room (or while held) the session does not plan, and the queue
    // would keep every offload meanwhile.
    s.prefetcher->DropStale(table_);
  }
  return out;
}

absl::Status GpuPolicy::SetReachable(SessionId session, bool reachable) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  it->second.reachable = reachable;
  return absl::OkStatus();
}

void GpuPolicy::Undeliverable(SessionId session, const v1::Orders& orders) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  Session& s = it->second;
  for (const v1::ReleaseOrder& o : orders.release()) {
    auto id = s.ids.find(o.tensor_id());
    if (id == s.ids.end()) continue;
    // A release the table still shows in flight goes back to resident.
    (void)table_.CancelRelease(id->second);
  }
  for (uint64_t own : orders.prefetch_tensor_ids()) {
    auto id = s.ids.find(own);
    if (id == s.ids.end()) continue;
    const Tensor* t = table_.Find(id->second);
    if (t != nullptr && t->state == TensorState::kReloading) {
      (void)table_.SetState(id->second, TensorState::kOffloaded);
      std::erase(s.reloading, id->second);
    }
  }
}

}  // namespace deltad::daemon
