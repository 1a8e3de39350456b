#include "daemon/session_leases.h"

#include <algorithm>

namespace deltad::daemon {

void SessionLeases::Add(SessionId session, int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  if (last_tick_ns_ < 0) last_tick_ns_ = now_ns;
  Lease& lease = leases_[session];
  lease = Lease{};
  lease.heard_at = running_ns_;
}

void SessionLeases::Remove(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  leases_.erase(session);
}

void SessionLeases::Heard(SessionId session) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(session);
  if (it != leases_.end()) it->second.heard = true;
}

void SessionLeases::Busy(SessionId session, bool busy) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(session);
  if (it == leases_.end()) return;
  it->second.busy = busy;
  it->second.heard = true;
}

std::vector<SessionLeases::Change> SessionLeases::Tick(
    int64_t now_ns, const std::function<bool(SessionId)>& stopped) {
  std::lock_guard<std::mutex> lock(mu_);
  if (last_tick_ns_ >= 0 && now_ns > last_tick_ns_) {
    running_ns_ +=
        std::min(now_ns - last_tick_ns_, options_.max_tick_credit_ns);
  }
  last_tick_ns_ = std::max(last_tick_ns_, now_ns);
  std::vector<Change> changes;
  for (auto& [id, lease] : leases_) {
    const int64_t silent = running_ns_ - lease.heard_at;
    if (lease.heard || lease.busy) {
      if (lease.unresponsive) {
        changes.push_back({id, Change::kAnswered, silent});
      }
      const bool busy = lease.busy;
      lease = Lease{};
      lease.heard_at = running_ns_;
      lease.busy = busy;
      continue;
    }
    if (!lease.unresponsive && silent > options_.lease_ns &&
        (silent > 3 * options_.lease_ns ||
         (stopped != nullptr && stopped(id)))) {
      lease.unresponsive = true;
      changes.push_back({id, Change::kUnresponsive, silent});
    }
    if (lease.unresponsive && !lease.end_reported &&
        options_.end_after_ns > 0 &&
        silent > options_.lease_ns + options_.end_after_ns) {
      lease.end_reported = true;
      changes.push_back({id, Change::kEnd, silent});
    }
  }
  return changes;
}

int64_t SessionLeases::UnresponsiveFor(SessionId session) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(session);
  if (it == leases_.end() || !it->second.unresponsive) return 0;
  return running_ns_ - it->second.heard_at;
}

}  // namespace deltad::daemon
