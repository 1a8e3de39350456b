// Making room on the device: carrying out release orders, asking the
// daemon (or the in-process policy) what to release, and the allocation
// path that waits, releases and retries until the bytes fit.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace deltad::client {

bool Client::CarryOut(const std::vector<v1::ReleaseOrder>& orders,
                      Origin origin) {
  const bool daemons = origin == Origin::kDaemonOrder;
  if (daemons) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const v1::ReleaseOrder& o : orders) ordered_.insert(o.tensor_id());
  }
  bool all = true;
  for (const v1::ReleaseOrder& o : orders) {
    const absl::Status s = o.action() == v1::ReleaseOrder::EVICT
                               ? Evict(o.tensor_id(), origin)
                               : Offload(o.tensor_id(), origin);
    all = all && s.ok();
  }
  if (daemons) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const v1::ReleaseOrder& o : orders) UnorderLocked(o.tensor_id());
  }
  return all;
}

absl::StatusOr<bool> Client::MakeRoom(int64_t bytes, int64_t extra) {
  const int64_t start = NowNs();
  std::shared_ptr<DaemonLink> link;
  {
    // A prefetch in flight holds bytes that neither plan could release
    // and that the daemon does not know are taken (its RELOADED is not
    // sent yet): the choice waits for it, a copy's time.
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] { return prefetching_ == 0; });
    ++making_room_;  // and no new one starts until the room is made
    if (stats_.connected && !draining_seen_) link = link_;
  }
  absl::Cleanup done_making_room = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    --making_room_;
  };
  if (link != nullptr) {
    absl::StatusOr<v1::ReleaseResponse> response;
    {
      // Every batch sent so far is named, so the daemon applies them first.
      std::lock_guard<std::mutex> send_lock(send_mu_);
      v1::EventBatch batch;
      // Memory held for rebuilds the daemon has not been told of yet, and
      // AllocateRaw's, which it never hears of, are asked for too, or its
      // view of the GPU would be short by that much.
      int64_t unreported;
      {
        std::lock_guard<std::mutex> lock(mu_);
        batch = TakeBatchLocked();
        unreported = unreported_bytes_ + raw_bytes_;
      }
      const int64_t sent_again = link->release_calls_sent_again();
      response =
          link->Release(bytes + extra + unreported, batch, batches_sent_);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.release_calls_sent_again +=
          link->release_calls_sent_again() - sent_again;
    }
    if (response.ok()) {
      std::vector<v1::ReleaseOrder> orders(response->release().begin(),
                                           response->release().end());
      const bool done = CarryOut(orders, Origin::kDaemonOrder);
      std::unique_lock<std::mutex> lock(mu_);
      ++stats_.sync_releases;
      stats_.sync_release_ns += NowNs() - start;
      if (!response->room_available()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "GPU ", link->gpu(), " has no room for ", bytes,
            " bytes: every session's releasable tensors are not enough"));
      }
      // A refused order (its tensor got pinned) leaves the room short: the
      // caller asks again, and the refusal steers the next choice.
      if (!done) return false;
      // The daemon found room on the GPU, perhaps beyond this session's
      // share (others released for it), counting this session's orders
      // not yet carried out as done: allocate once they are.
      changed_.wait(lock, [&] {
        return offloading_bytes_ == 0 && queued_releases_ == 0;
      });
      return true;
    }
    // Anything else leaves it unknown whether the daemon applied the
    // batch: its view of the tensors can no longer be trusted.
    if (response.status().code() != absl::StatusCode::kResourceExhausted) {
      OnLost(link.get(), absl::StrCat("a Release call failed (",
                                      response.status().ToString(), ")"));
    }
  }
  // In-process: the same policy over this process's tensors, once the
  // releases already under way (the daemon's orders) have freed their
  // bytes, which no plan can choose again.
  int64_t need;
  {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(
        lock, [&] { return offloading_bytes_ == 0 && queued_releases_ == 0; });
    need = device_bytes_ + bytes + extra - budget_bytes_;
  }
  if (need <= 0) return false;
  if (absl::Status s = ReleaseInProcess(need, start); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no room for ", bytes, " bytes within the budget: ", s.message()));
  }
  return false;  // within the budget now, unless an order was refused
}

absl::Status Client::ReleaseInProcess(int64_t need, int64_t start_ns,
                                      bool up_to) {
  std::vector<v1::ReleaseOrder> orders;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The daemon's orders not carried out yet are not the plan's to choose
    // (see ordered_): locked while it plans, as an op's tensors are.
    std::vector<uint64_t> shielded;
    for (uint64_t id : ordered_) {
      if (local_.table().Lock(id).ok()) shielded.push_back(id);
    }
    const int64_t host = HostAvailableLocked();
    auto plan = up_to ? local_.PlanUpTo(need, NowNs(), host)
                      : local_.Plan(need, NowNs(), host);
    for (uint64_t id : shielded) (void)local_.table().Unlock(id);
    if (!plan.ok()) return plan.status();
    for (const policy::ReleaseOrder& o : *plan) {
      v1::ReleaseOrder order;
      order.set_tensor_id(o.id);
      order.set_bytes(o.bytes);
      order.set_action(o.action == policy::ReleaseAction::kEvict
                           ? v1::ReleaseOrder::EVICT
                           : v1::ReleaseOrder::OFFLOAD);
      orders.push_back(order);
    }
    stats_.local_decisions += static_cast<int64_t>(orders.size());
  }
  CarryOut(orders, Origin::kLocalPlan);
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.sync_releases;
  stats_.sync_release_ns += NowNs() - start_ns;
  return absl::OkStatus();
}

absl::StatusOr<void*> Client::AllocateDevice(int64_t bytes) {
  if (void* p = TryAllocateWithinBudget(bytes, /*raw=*/false)) return p;
  return AllocateDeviceSlow(bytes);
}

void* Client::TryAllocateWithinBudget(int64_t bytes, bool raw) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (device_bytes_ + bytes > budget_bytes_ || (raw && stopping_)) {
      return nullptr;
    }
    device_bytes_ += bytes;
    if (raw) raw_bytes_ += bytes;
    NotePeakLocked();
  }
  // Outside mu_: the device has a lock of its own, and a chunk-backed one
  // may map memory.
  absl::StatusOr<void*> device = device_->Allocate(bytes);
  if (device.ok()) return *device;
  std::lock_guard<std::mutex> lock(mu_);
  device_bytes_ -= bytes;
  if (raw) raw_bytes_ -= bytes;
  return nullptr;
}

absl::StatusOr<void*> Client::AllocateDeviceSlow(int64_t bytes) {
  absl::StatusOr<void*> p = AllocateDeviceInRounds(bytes);
  if (p.ok() || !absl::IsResourceExhausted(p.status())) return p;
  std::lock_guard<std::mutex> lock(mu_);
  if (budget_note_.empty()) return p;
  // The reason the room is not there is another process: say which.
  return absl::ResourceExhaustedError(
      absl::StrCat(p.status().message(), "; ", budget_note_));
}

absl::StatusOr<void*> Client::AllocateDeviceInRounds(int64_t bytes) {
  // A few rounds: a release can be undone by a concurrent allocation, an
  // order can be refused (its tensor just got pinned), and a chunk-backed
  // device can be short of what the byte count says (chunks not fetched
  // yet, or memory lost to rounding).
  bool granted = false;  // the daemon made room beyond the budget
  constexpr int kRounds = 16;
  const int64_t start_ns = NowNs();
  const int64_t wait_deadline_ns =
      start_ns + int64_t{options_.owed_chunks_wait_ms} * 1000000;
  // For the message when it gives up: what was refused meanwhile.
  int64_t refused_at_start = 0;
  struct {
    int64_t local = 0, in_use = 0, no_host = 0;
  } refused;                      // in-process refusals at the start
  int64_t released_at_start = 0;  // offloads and evictions
  // The tries so far, for an error; mu_ held.
  auto tries = [&](int round) {
    return absl::StrCat(
        round, " tries in ", (NowNs() - start_ns) / 1000000, " ms, ",
        stats_.offloads + stats_.evictions - released_at_start,
        " tensors released, ", stats_.orders_refused - refused_at_start,
        " of deltad's orders and ", stats_.local_refused - refused.local,
        " in-process releases refused (",
        stats_.local_refused_in_use - refused.in_use,
        " in use by an op or being restored, ",
        stats_.local_refused_no_host - refused.no_host, " without host room), ",
        stats_.connected ? "connected" : "not connected");
  };
  for (int round = 0;; ++round) {
    bool reserved = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (round == 0) {
        refused_at_start = stats_.orders_refused;
        refused = {stats_.local_refused, stats_.local_refused_in_use,
                   stats_.local_refused_no_host};
        released_at_start = stats_.offloads + stats_.evictions;
      }
      if (granted || device_bytes_ + bytes <= budget_bytes_) {
        device_bytes_ += bytes;
        NotePeakLocked();
        reserved = true;
      }
    }
    if (!reserved && round >= kRounds) {
      if (auto p = AllocateInHeldChunks(bytes); p.ok()) return p;
      std::lock_guard<std::mutex> lock(mu_);
      return absl::ResourceExhaustedError(absl::StrCat(
          "no room for ", bytes, " bytes: ", device_bytes_, " of ",
          budget_bytes_, " budget bytes held after releasing what could be",
          device_->chunk_backend().empty() ? "" : ", the chunks held full",
          " (", tries(round), ")"));
    }
    if (!reserved) {
      auto made = MakeRoom(bytes);
      if (!made.ok()) {
        if (!absl::IsResourceExhausted(made.status())) return made.status();
        if (auto p = AllocateInHeldChunks(bytes); p.ok()) return p;
        return made.status();
      }
      granted = *made;
      if (!granted) {
        // An order was refused: its tensor is pinned by an op still
        // running. Asking again at once would find it pinned again, and
        // the rounds would be gone within a millisecond on a busy machine.
        std::this_thread::sleep_for(std::chrono::milliseconds(round + 1));
      }
      continue;
    }
    auto device = device_->Allocate(bytes);
    if (device.ok()) return device;
    int64_t budget;
    int64_t held_bytes;  // by the tensors, as the daemon counts them
    std::shared_ptr<DaemonLink> link;
    {
      std::lock_guard<std::mutex> lock(mu_);
      device_bytes_ -= bytes;
      held_bytes = device_bytes_;
      budget = budget_bytes_;
      if (stats_.connected) link = link_;
    }
    if (!absl::IsResourceExhausted(device.status()) ||
        device_->chunk_backend().empty()) {
      return device.status();
    }
    // The budget covers chunks this process does not hold yet: other
    // sessions are still giving them back (their budgets came down for
    // this one, and they release at their own pace, or once their pinned
    // tensors are let go). Wait for those rather than fail a step the
    // budget allows; the wait uses up no round.
    if (link != nullptr &&
        WaitForOwedChunks(link, budget, bytes, wait_deadline_ns)) {
      --round;
      continue;
    }
    if (round >= kRounds) {
      if (link == nullptr && MapPastBudgetInProcess(bytes)) continue;
      std::lock_guard<std::mutex> lock(mu_);
      return absl::ResourceExhaustedError(
          absl::StrCat(device.status().message(), " (", tries(round), ")"));
    }
    // Short of chunks: the budget's may not all have come yet, or the
    // daemon made room beyond the budget, which takes more chunks; others
    // may still be giving theirs back (see ExecutorLoop).
    const int64_t held = device_->chunk_bytes_held();
    const int64_t want = granted ? std::max(budget, held + bytes) : budget;
    // Chunks that come, but not all at once (other sessions still release
    // them), are waited for as owed ones are: a gain uses no round until
    // the wait's deadline, or a large allocation the daemon made room for
    // would run out of rounds a chunk short.
    auto gained = [&] {
      if (device_->chunk_bytes_held() <= held) return false;
      if (NowNs() < wait_deadline_ns) --round;
      return true;
    };
    (void)SyncChunks(link, want);
    if (gained()) continue;
    if (granted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * (round + 1)));
      (void)SyncChunks(link, want);
      if (gained()) continue;
    }
    // The chunks are full though the byte counts say there is room: part
    // of them is rounding (a 1 MiB tensor takes a 2 MiB chunk), which the
    // daemon's arithmetic does not see. Ask it for that much more, so
    // that it releases or lends for real; if that is not enough, this
    // process's own tensors make the room, chosen in-process (their
    // releases reach the daemon as events).
    granted = false;
    if (round % 2 == 0) {
      const int64_t waste =
          std::max<int64_t>(0, device_->chunk_bytes_held() -
                                   device_->chunk_bytes_free() - held_bytes);
      auto made = MakeRoom(bytes, waste);
      if (made.ok() && *made) {
        granted = true;
        continue;
      }
      // Refused or short: the daemon's choice was pinned here (it does not
      // see pins), and asking again picks the same. This process knows
      // what it pins: it chooses below.
    }
    // At least down to the budget: past it, the room was lent in bytes
    // the GPU's chunks could not back, and what the budget leaves is the
    // room this process has for sure. Releasing only `bytes` would mostly
    // free pieces of chunks, never the whole one the allocation lacks.
    int64_t over;
    {
      std::lock_guard<std::mutex> lock(mu_);
      over = device_bytes_ + bytes - budget_bytes_;
    }
    // (Which all of it may not be releasable: pinned tensors, or a host
    // quota short of them; then `bytes`, or as much of them as can be: the
    // need is whole chunks, which part of the bytes may free.)
    if (over > bytes && ReleaseInProcess(over, NowNs()).ok()) continue;
    // Bytes freed in a page that other blocks keep mapped free no chunk: a
    // small allocation that needs a page of its own may take far more than
    // its bytes. Each round asks for twice the chunks the last one did.
    const int64_t chunks_worth = std::max<int64_t>(1, device_->chunk_bytes())
                                 << std::min(round, 30);
    absl::Status s = ReleaseInProcess(std::max(bytes, chunks_worth), NowNs(),
                                      /*up_to=*/true);
    if (s.ok()) continue;
    if (link == nullptr) {
      if (MapPastBudgetInProcess(bytes)) continue;
    } else if (round + 1 < kRounds) {
      // Nothing here to release; others may still be releasing for this
      // session or give chunks back. The next even round asks the daemon
      // again rather than fail a step while rounds remain.
      std::this_thread::sleep_for(std::chrono::milliseconds(round + 1));
      continue;
    }
    return absl::ResourceExhaustedError(
        absl::StrCat(device.status().message(), "; ", s.message()));
  }
}

absl::StatusOr<void*> Client::AllocateInHeldChunks(int64_t bytes) {
  // Nothing held could be released: everything is in use by the ops
  // running now. Typically a budget cut (for a newcomer) came while a
  // recompute chain pins its parents, and only this allocation can unwind
  // it. Room in chunks this process already maps takes nothing from anyone
  // (the daemon waits for those very chunks), so the op goes on in them;
  // the excess goes back once it ends (ExecutorLoop). A device without
  // chunks has only the budget's bytes.
  if (device_->chunk_backend().empty()) {
    return absl::ResourceExhaustedError("no chunks held");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    device_bytes_ += bytes;
  }
  absl::StatusOr<void*> device = device_->Allocate(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (!device.ok()) {
    device_bytes_ -= bytes;
    return device.status();
  }
  NotePeakLocked();
  ++stats_.past_budget_allocations;
  return device;
}

bool Client::MapPastBudgetInProcess(int64_t bytes) {
  // No daemon: the budget is the caller's target in bytes, and the chunks
  // full of rounding (pages of small blocks partly empty, a tensor of a
  // chunk and a bit taking two) hold nothing a release could free whole.
  // A daemon lends such room while the GPU has it; in-process the device's
  // own memory is the limit, so the step runs rather than fail, and the
  // overshoot is counted and said once.
  const int64_t held = device_->chunk_bytes_held();
  const int64_t chunk = std::max<int64_t>(1, device_->chunk_bytes());
  const int64_t want = held + (bytes + chunk - 1) / chunk * chunk;
  if (!device_->AddLocalChunks(want).ok()) return false;
  const int64_t now = device_->chunk_bytes_held();
  if (now <= held) return false;  // the device itself is full
  bool first = false;
  int64_t budget = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = stats_.past_budget_bytes == 0;
    budget = budget_bytes_;
    stats_.past_budget_bytes =
        std::max(stats_.past_budget_bytes, now - budget / chunk * chunk);
  }
  if (first) {
    std::fprintf(stderr,
                 "deltad client: without a daemon, mapped device chunks past "
                 "the budget of %lld bytes (now %lld bytes of chunks): what "
                 "rounding to %lld-byte chunks takes cannot be released\n",
                 static_cast<long long>(budget), static_cast<long long>(now),
                 static_cast<long long>(chunk));
  }
  return true;
}

}  // namespace deltad::client
