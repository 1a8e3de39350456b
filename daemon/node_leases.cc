// The Node's side of leases: a session whose process stopped answering
// keeps what it holds, and the others stop counting on it.
#include <cstdio>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/monotonic_clock.h"
#include "daemon/node.h"
#include "daemon/process_end.h"

namespace deltad::daemon {
namespace {

// "session 3 (pid 812, GPU 0, "rank0")": the label comes from the client,
// escaped so that it cannot forge lines of its own.
std::string Named(const SessionInfo& s) {
  return absl::StrCat("session ", s.id, " (pid ", s.peer.pid, ", GPU ", s.gpu,
                      ", \"", absl::CHexEscape(s.label), "\")");
}

}  // namespace

std::optional<SessionInfo> Node::Find(SessionId session) const {
  for (SessionInfo& info : registry_.List()) {
    if (info.id == session) return std::move(info);
  }
  return std::nullopt;
}

OrdersBySession Node::MarkUnresponsive(SessionId session, int64_t silent_ns) {
  OrdersBySession others;
  const std::optional<SessionInfo> info = Find(session);
  if (!info.has_value()) return others;
  Gpu& gpu = *gpus_[info->gpu];
  int64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    if (gpu.unresponsive.contains(session)) return others;
    held = chunks_.held_bytes(session);
    auto changes = gpu.arbiter.Freeze(session, held);
    if (!changes.ok()) return others;  // reclaimed meanwhile
    gpu.unresponsive[session] = {common::MonotonicNs(), silent_ns};
    // Orders to it would not be carried out: its tensors are not chosen,
    // and what it was ordered is undone.
    (void)gpu.policy->SetReachable(session, false);
    AddBudgetOrders(*changes, session, gpu, others);
    const std::string note = absl::StrCat(
        Named(*info), " has not answered deltad for ", silent_ns / 1000000,
        " ms and holds ", held, " bytes of GPU ", info->gpu,
        "; budgets do not count on them until it answers or exits");
    for (auto& [id, orders] : others) orders.set_budget_note(note);
    ReportGpu(info->gpu, gpu);
  }
  events_->LeaseChanged(info->gpu, session, LeaseEvent::kMarked);
  int64_t held_back = 0;
  if (lease_log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: %s has not answered for %lld ms: marked "
                 "unresponsive; it holds %lld bytes of chunks, which the "
                 "other sessions' budgets no longer count on until it "
                 "answers or exits (%zu budgets changed)%s\n",
                 Named(*info).c_str(),
                 static_cast<long long>(silent_ns / 1000000),
                 static_cast<long long>(held), others.size(),
                 held_back > 0
                     ? absl::StrCat("; ", held_back, " lines held back").c_str()
                     : "");
  }
  return others;
}

OrdersBySession Node::MarkAnswered(SessionId session, int64_t silent_ns) {
  OrdersBySession changed;
  const std::optional<SessionInfo> info = Find(session);
  if (!info.has_value()) return changed;
  Gpu& gpu = *gpus_[info->gpu];
  {
    std::lock_guard<std::mutex> lock(gpu.mu);
    if (gpu.unresponsive.erase(session) == 0) return changed;
    auto changes = gpu.arbiter.Thaw(session);
    if (!changes.ok()) return changed;
    (void)gpu.policy->SetReachable(session, true);
    // Its own budget too: it is told its share again, and gives back what
    // it holds past it.
    AddBudgetOrders(*changes, 0, gpu, changed);
    ReportGpu(info->gpu, gpu);
  }
  events_->LeaseChanged(info->gpu, session, LeaseEvent::kAnswered);
  int64_t held_back = 0;
  if (lease_log_.Allow(&held_back)) {
    std::fprintf(stderr,
                 "deltad: %s answers again after %lld ms without a word; "
                 "budgets shared as before\n",
                 Named(*info).c_str(),
                 static_cast<long long>(silent_ns / 1000000));
  }
  return changed;
}

bool Node::ProcessStoppedOf(SessionId session) const {
  const std::optional<SessionInfo> info = Find(session);
  return info.has_value() && ProcessStopped(info->peer.pid);
}

absl::Status Node::EndUnresponsive(SessionId session, int64_t silent_ns) {
  const std::optional<SessionInfo> info = Find(session);
  if (!info.has_value()) return absl::NotFoundError("the session ended");
  const absl::Status killed =
      KillProcess(info->peer.pid, info->peer.start_time);
  if (killed.ok()) {
    events_->LeaseChanged(info->gpu, session, LeaseEvent::kEnded);
  }
  int64_t held_back = 0;
  if (lease_log_.Allow(&held_back)) {
    std::fprintf(
        stderr, "deltad: %s unresponsive for %lld ms: %s\n",
        Named(*info).c_str(), static_cast<long long>(silent_ns / 1000000),
        killed.ok() ? "sent SIGKILL (lease.end_unresponsive_after_ms)"
                    : absl::StrCat("not ended: ", killed.message()).c_str());
  }
  return killed;
}

}  // namespace deltad::daemon
