#include "daemon/gpu_arbiter.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace deltad::daemon {

absl::StatusOr<GpuArbiter> GpuArbiter::Create(int gpu, int64_t budget_bytes,
                                              int64_t min_session_bytes,
                                              int64_t unit_bytes) {
  if (unit_bytes < 1 || unit_bytes > budget_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU ", gpu, ": the unit of budgets must be within 1..",
                     budget_bytes, " bytes, got ", unit_bytes));
  }
  if (budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu, ": budget must be positive, got ", budget_bytes));
  }
  if (min_session_bytes < 0 || min_session_bytes > budget_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", gpu, ": guaranteed minimum per session must be within 0..",
        budget_bytes, " bytes, got ", min_session_bytes));
  }
  return GpuArbiter(gpu, budget_bytes, min_session_bytes, unit_bytes);
}

int64_t GpuArbiter::Floor(const Entry& e) const {
  const int64_t guaranteed = e.requested > 0
                                 ? std::min(e.requested, min_session_bytes_)
                                 : min_session_bytes_;
  return std::max({guaranteed, e.declared_floor, e.iteration_peak});
}

int64_t GpuArbiter::granted_bytes() const {
  int64_t sum = 0;
  for (const auto& [id, e] : sessions_) sum += e.budget;
  return sum;
}

absl::StatusOr<std::vector<BudgetChange>> GpuArbiter::AddSession(
    SessionId session, uint32_t weight, int64_t requested,
    int64_t declared_floor) {
  if (sessions_.contains(session)) {
    return absl::AlreadyExistsError(
        absl::StrCat("session ", session, " is already on GPU ", gpu_));
  }
  if (requested < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("requested budget must not be negative, got ", requested));
  }
  if (declared_floor < 0 || declared_floor > budget_bytes_ ||
      (requested > 0 && declared_floor > requested)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_budget_bytes must be within 0..", budget_bytes_, " (GPU ", gpu_,
        "'s budget) and not above requested_budget_bytes (", requested,
        "), got ", declared_floor));
  }
  Entry entry;
  entry.weight = std::max<uint32_t>(1, weight);
  entry.requested = requested;
  entry.declared_floor = declared_floor;
  // In whole units, as Rebalance shares them.
  int64_t running = RoundUp(outside_bytes_);
  for (const auto& [id, e] : sessions_) {
    // An unresponsive session keeps what it holds, floor or not.
    running += RoundUp(std::max(Floor(e), e.frozen_at));
  }
  if (running + RoundUp(Floor(entry)) >
      budget_bytes_ / unit_bytes_ * unit_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU ", gpu_,
        " cannot admit this session without cutting a running "
        "job below its floor: of its budget of ",
        budget_bytes_, " bytes, ", running - outside_bytes_,
        " are the floors of ", sessions_.size(),
        " running sessions (each its declared minimum, its last iteration's "
        "peak or the guaranteed minimum of ",
        min_session_bytes_, " bytes, whichever is largest), ",
        outside_bytes_ > 0
            ? absl::StrCat(outside_bytes_,
                           " are chunks still mapped by processes whose "
                           "sessions ended, ")
            : "",
        budget_bytes_ - running, " are left and this session needs ",
        RoundUp(Floor(entry)),
        unit_bytes_ > 1
            ? absl::StrCat(" (in whole chunks of ", unit_bytes_, " bytes)")
            : "",
        "; try again when a job ends"));
  }
  sessions_.emplace(session, entry);
  std::vector<BudgetChange> changes = Rebalance();
  // The newcomer first: its grant is the answer to its request.
  auto it =
      std::find_if(changes.begin(), changes.end(),
                   [&](const BudgetChange& c) { return c.session == session; });
  if (it == changes.end()) {
    changes.insert(changes.begin(), {session, sessions_[session].budget});
  } else {
    std::rotate(changes.begin(), it, it + 1);
  }
  return changes;
}

absl::StatusOr<std::vector<BudgetChange>> GpuArbiter::RemoveSession(
    SessionId session) {
  if (sessions_.erase(session) == 0) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  return Rebalance();
}

absl::StatusOr<std::vector<BudgetChange>> GpuArbiter::Freeze(
    SessionId session, int64_t held_bytes) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  it->second.frozen_at = std::max<int64_t>(0, held_bytes);
  return Rebalance();
}

absl::StatusOr<std::vector<BudgetChange>> GpuArbiter::Thaw(SessionId session) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  if (it->second.frozen_at < 0) return std::vector<BudgetChange>{};
  it->second.frozen_at = -1;
  return Rebalance();
}

std::vector<BudgetChange> GpuArbiter::SetOutside(int64_t bytes) {
  outside_bytes_ = std::max<int64_t>(0, bytes);
  return Rebalance();
}

bool GpuArbiter::Frozen(SessionId session) const {
  auto it = sessions_.find(session);
  return it != sessions_.end() && it->second.frozen_at >= 0;
}

absl::Status GpuArbiter::SetIterationPeak(SessionId session,
                                          int64_t peak_bytes) {
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on GPU ", gpu_));
  }
  it->second.iteration_peak =
      std::clamp<int64_t>(peak_bytes, 0, it->second.budget);
  return absl::OkStatus();
}

int64_t GpuArbiter::FloorOf(SessionId session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? 0 : RoundUp(Floor(it->second));
}

int64_t GpuArbiter::BudgetOf(SessionId session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? 0 : it->second.budget;
}

std::vector<BudgetChange> GpuArbiter::Rebalance() {
  // In whole units (the GPU's chunks): a budget is held in chunks, and a
  // part of one could never be mapped.
  constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
  std::map<SessionId, int64_t> grant;
  std::map<SessionId, int64_t> want;  // beyond the floor
  const int64_t total = budget_bytes_ / unit_bytes_;
  int64_t left = total - Units(outside_bytes_);
  int64_t floors = 0;  // of the sessions that answer
  for (const auto& [id, e] : sessions_) {
    if (e.frozen_at >= 0) {
      grant[id] = Units(e.frozen_at);
      want[id] = 0;
      left -= grant[id];
    } else {
      floors += Units(Floor(e));
    }
  }
  // What unresponsive sessions hold is not there to give: the floors are
  // cut in proportion when the rest cannot hold them.
  const double cut = floors > std::max<int64_t>(0, left)
                         ? static_cast<double>(std::max<int64_t>(0, left)) /
                               static_cast<double>(floors)
                         : 1.0;
  for (const auto& [id, e] : sessions_) {
    if (e.frozen_at >= 0) continue;
    const int64_t floor = Units(Floor(e));
    grant[id] = cut < 1.0
                    ? static_cast<int64_t>(static_cast<double>(floor) * cut)
                    : floor;
    left -= grant[id];
    want[id] = e.requested > 0 ? Units(e.requested) - grant[id] : kUnbounded;
  }
  // Water-filling by weight over what is left.
  std::vector<SessionId> active;
  for (const auto& [id, w] : want) {
    if (w > 0) active.push_back(id);
  }
  while (left > 0 && !active.empty()) {
    double weights = 0;
    for (SessionId id : active) weights += sessions_[id].weight;
    bool capped = false;
    std::vector<SessionId> still;
    for (SessionId id : active) {
      const auto share = static_cast<int64_t>(static_cast<double>(left) *
                                              sessions_[id].weight / weights);
      if (want[id] <= share) {
        grant[id] += want[id];
        capped = true;
      } else {
        still.push_back(id);
      }
    }
    if (capped) {
      // Recompute what is left after the capped ones took their fill.
      left = total - Units(outside_bytes_);
      for (const auto& [id, g] : grant) left -= g;
      for (SessionId id : active) {
        if (std::find(still.begin(), still.end(), id) == still.end()) {
          want[id] = 0;
        }
      }
      active = std::move(still);
      continue;
    }
    // Nobody is capped: split what is left by weight; rounding leftovers go
    // to the first sessions so the whole budget is used.
    int64_t given = 0;
    for (SessionId id : active) {
      const auto share = static_cast<int64_t>(static_cast<double>(left) *
                                              sessions_[id].weight / weights);
      grant[id] += share;
      given += share;
    }
    for (size_t i = 0; given < left; ++i, ++given)
      ++grant[active[i % active.size()]];
    left = 0;
  }
  std::vector<BudgetChange> changes;
  for (auto& [id, e] : sessions_) {
    if (e.budget != grant[id] * unit_bytes_) {
      e.budget = grant[id] * unit_bytes_;
      changes.push_back({id, e.budget});
    }
  }
  return changes;
}

}  // namespace deltad::daemon
