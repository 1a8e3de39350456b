// The Client's session with deltad: opening one and telling it everything
// the process holds, the orders that come on its stream, and its loss.
// Apart from client.cc, which holds the tensors' life cycle; the
// SessionKeeper decides when these run (on its own thread, for all but the
// first attach).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/monotonic_clock.h"

namespace deltad::client {

using Kind = v1::TensorEvent;

SessionKeeper::Hooks Client::KeeperHooks() {
  return {[this] { return EndLostSession(); },
          [this]() -> absl::StatusOr<std::string> {
            if (absl::Status s = TryConnect(); !s.ok()) return s;
            const std::string released = ReleaseDownToBudget();
            std::lock_guard<std::mutex> lock(mu_);
            return absl::StrCat("session ", stats_.session_id, ", ",
                                records_.size(), " tensors re-reported",
                                released);
          },
          [this] { CheckLink(); }};
}

std::string Client::ReleaseDownToBudget() {
  // What the process holds beyond a new session's grant (tensors kept
  // while the daemon was away, or under a larger grant before) would stay:
  // the daemon orders releases only when the GPU is short of bytes, and
  // the chunks mapped before this session are not the new session's to
  // give back. An allocation would then find the chunks full while the
  // daemon answers that there is room (a soak trainer failed so, holding
  // 28.8 MB against 15 MiB, with nothing released in 16 tries).
  int64_t before;
  int64_t over;
  {
    std::lock_guard<std::mutex> lock(mu_);
    before = device_bytes_;
    over = device_bytes_ - budget_bytes_;
  }
  if (over <= 0) return "";
  const absl::Status s = ReleaseInProcess(over, NowNs(), /*up_to=*/true);
  std::lock_guard<std::mutex> lock(mu_);
  return absl::StrCat("; held ", over, " bytes past its budget of ",
                      budget_bytes_, " bytes, released ",
                      before - device_bytes_,
                      s.ok() ? "" : absl::StrCat(" (", s.message(), ")"));
}

void Client::CheckLink() {
  std::shared_ptr<DaemonLink> link;
  {
    // Not mu_: the training thread may hold it for a while on a loaded
    // machine, and the daemon would hear no heartbeat meanwhile.
    std::lock_guard<std::mutex> beat(beat_mu_);
    link = beat_link_;
  }
  // A daemon that stopped reading blocks the writer, and whoever waits to
  // send after it (an allocation asking for room): cutting the stream off
  // frees them, and the loss takes its usual course.
  // The keeper checks every quarter second: a check that comes much later
  // means this process was stopped (SIGSTOP, a debugger) or starved, and a
  // write under way since then has waited on it, not on the daemon.
  const int64_t now = common::MonotonicNs();
  if (last_check_ns_ != 0 &&
      now - last_check_ns_ > int64_t{options_.link.rpc_timeout_ms} * 1000000) {
    resumed_ns_ = now;
  }
  last_check_ns_ = now;
  if (link != nullptr && link->WriteStalled(resumed_ns_)) {
    link->Cancel(absl::StrCat("a write on the session stream waited over ",
                              options_.link.rpc_timeout_ms,
                              " ms (the daemon stopped reading)"));
    return;
  }
  if (link != nullptr) link->Heartbeat(UnlistedChunkBytes(*link));
}

int64_t Client::UnlistedChunkBytes(const DaemonLink& link) {
  // Held for a whole fetch at times (a side-socket round trip): the
  // figure waits for the next check rather than the keeper for the lock.
  std::unique_lock<std::mutex> lock(chunk_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return -1;
  const int64_t granted = &link == chunk_link_
                              ? static_cast<int64_t>(daemon_chunk_.size()) *
                                    link.session().chunk_bytes()
                              : 0;
  return std::max<int64_t>(0, device_->chunk_bytes_held() - granted);
}

absl::Status Client::TryConnect() {
  const DaemonLink::OpenFn open =
      options_.open_link ? options_.open_link : DaemonLink::Open;
  auto link = open(
      options_.link,
      [this](const DaemonLink* from, const v1::Orders& o) {
        OnOrders(from, o);
      },
      [this](const DaemonLink* from, const std::string& why) {
        OnLost(from, why);
      });
  // Destroyed after the locks below are released: its destructor joins its
  // reader thread, which may be waiting for mu_.
  std::shared_ptr<DaemonLink> shared;
  absl::Status status = link.status();
  if (link.ok()) {
    shared = std::move(*link);
    {
      std::lock_guard<std::mutex> lock(mu_);
      connecting_ = shared.get();
    }
    // Before the locks: it waits on the daemon. A device that cannot map
    // the daemon's chunks cannot use the session at all.
    status = SyncChunks(
        shared,
        InWholeChunks(*shared, shared->session().granted_budget_bytes()));
    if (!status.ok()) {
      std::fprintf(stderr, "deltad client: %s; going on without the daemon\n",
                   std::string(status.message()).c_str());
    }
  }
  std::shared_ptr<DaemonLink> old;
  std::lock_guard<std::mutex> send_lock(send_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  connecting_ = nullptr;
  // A stream that ended already would never report its loss (its reader
  // found it was not the current link): it must not become the session.
  if (status.ok() && !shared->alive()) {
    status = absl::UnavailableError("the session stream ended at once");
  }
  // On failure `shared`, declared before the locks, is closed after them.
  if (!status.ok()) return status;
  for (common::side::Grant& slab : shared->TakeSlabs()) {
    (void)arena_.AddSlab(slab.fd.release(), slab.bytes,
                         shared->session().session_id());
  }
  // With a session, host memory for offloads is what the daemon granted:
  // more heap would pass the node's host quota, and with none granted (the
  // pool exhausted) the in-process policy must evict as the daemon does.
  // Heap taken while the daemon was away stays until its tensors leave.
  arena_.SetHeapAllowance(0);
  const v1::OpenSessionResponse& session = shared->session();
  budget_bytes_ = session.granted_budget_bytes();
  chunks_due_ =
      !device_->chunk_backend().empty() &&
      device_->chunk_bytes_held() != InWholeChunks(*shared, budget_bytes_);
  stats_.session_id = session.session_id();
  // Any session after a first one is a reconnect, even at a moment this
  // process held no tensors (between two iterations); so is a first one
  // that comes after tensors were tracked without the daemon.
  if (had_session_ || !records_.empty()) {
    ++stats_.reconnects;
  }
  old = std::move(link_);
  link_ = std::move(shared);
  {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beat_link_ = link_;
  }
  had_session_ = true;
  batches_sent_ = 0;
  draining_seen_ = false;
  stats_.connected = true;
  ReplayTensorsLocked();
  return absl::OkStatus();
}

void Client::ReplayTensorsLocked() {
  // A new session knows nothing: every tensor is created again, in one
  // batch (the daemon accepts a batch's parents in any order), then
  // brought to its state.
  pending_.Clear();
  pending_freed_.clear();
  for (const auto& [id, r] : records_) AddCreated(pending_, r->info);
  for (const auto& [id, r] : records_) {
    // One being restored is reported as where it comes from, so that the
    // event that ends it (RELOADED, RECOMPUTED, or none for a freed one)
    // is legal.
    const Where where =
        r->where == Where::kReloading ? r->restoring_from : r->where;
    switch (where) {
      case Where::kOffloaded:
        AddEventLocked(Kind::OFFLOADED, id);
        break;
      case Where::kEvicted:
        AddEventLocked(Kind::EVICTED, id);
        break;
      case Where::kFreed:
        AddEventLocked(Kind::FREED, id);
        break;
      case Where::kResident:
        // A freed tensor rebuilt for a child's recompute is freed to the
        // daemon.
        if (r->rebuilt_freed) AddEventLocked(Kind::FREED, id);
        if (r->ahead == Record::Ahead::kLanded && !r->rebuilt_freed) {
          AddEventLocked(Kind::HOST_COPIED, id);
        }
        break;
      case Where::kOffloading:  // ends with OFFLOADED, legal from resident
      case Where::kReloading:   // restoring_from is never kReloading
        break;
    }
  }
}

bool Client::EvacuateSlabsOf(uint64_t session) {
  std::unique_lock<std::mutex> lock(mu_);
  // A compute thread waiting for them (MakeRoom) must not wait on this
  // thread.
  DropOrdersLocked();
  // The slabs' tensors move to the heap.
  arena_.SetHeapAllowance(options_.fallback_host_bytes);
  arena_.Retire(session);
  bool all_moved = true;
  // By id, not by iterator: the waits below let other threads add and drop
  // records, which may rehash the map.
  std::vector<uint64_t> ids;
  ids.reserve(records_.size());
  for (const auto& [id, r] : records_) ids.push_back(id);
  for (uint64_t id : ids) {
    // A copy in flight reads or writes its block: wait for it to end.
    Record* rec = nullptr;
    changed_.wait(lock, [&] {
      auto it = records_.find(id);
      rec = it == records_.end() ? nullptr : it->second.get();
      return rec == nullptr || (rec->where != Where::kOffloading &&
                                rec->where != Where::kReloading &&
                                rec->ahead != Record::Ahead::kCopying);
    });
    if (rec == nullptr) continue;
    // A copy made ahead is only a saving: it goes with the slab.
    if (rec->ahead == Record::Ahead::kLanded &&
        arena_.IsRetired(rec->ahead_host)) {
      DropCopyLocked(rec);
      (void)local_.table().SetHostCopy(id, false);
    }
    if (!arena_.IsRetired(rec->host)) continue;
    auto moved = arena_.Allocate(rec->info.bytes);
    if (!moved.ok()) {
      // No heap left for it: the session must stay open, or its bytes go.
      all_moved = false;
      std::fprintf(stderr,
                   "deltad client: no host memory to move tensor %llu out "
                   "of session %llu's slabs: %s\n",
                   static_cast<unsigned long long>(id),
                   static_cast<unsigned long long>(session),
                   std::string(moved.status().message()).c_str());
      continue;
    }
    HostArena::Copy(rec->host, *moved);
    arena_.Free(rec->host);
    rec->host = *moved;
  }
  return all_moved;
}

void Client::OnOrders(const DaemonLink* from, const v1::Orders& orders) {
  std::string lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A link being set up gets its budget; one that is no longer the
    // session (lost, or replaced) has nothing more to say.
    const bool current = from == link_.get() && stats_.connected;
    if (!current && from != connecting_) return;
    if (orders.new_budget_bytes() > 0) {
      budget_bytes_ = orders.new_budget_bytes();
      chunks_due_ = true;
      if (orders.budget_note() != budget_note_) {
        const bool was_short = !budget_note_.empty();
        budget_note_ = orders.budget_note();
        int64_t held_back = 0;
        if ((was_short || !budget_note_.empty()) &&
            budget_note_log_.Allow(&held_back)) {
          std::fprintf(stderr, "deltad client: budget now %lld bytes: %s\n",
                       static_cast<long long>(budget_bytes_),
                       budget_note_.empty()
                           ? "memory held by a session that stopped "
                             "answering is counted on again"
                           : budget_note_.c_str());
        }
      }
    }
    if (!orders.rejected_batch().empty() && current) {
      // Nothing of that batch was applied: the daemon's view and ours now
      // differ, so the session is opened anew with the whole state.
      ++stats_.rejected_batches;
      lost = absl::StrCat("the daemon refused a batch (",
                          orders.rejected_batch(), ")");
      DetachLocked();
    }
    if (orders.draining()) draining_seen_ = true;
    if (lost.empty()) {
      for (const v1::ReleaseOrder& o : orders.release()) {
        ++stats_.orders_received;
        ++queued_releases_;
        ordered_.insert(o.tensor_id());
        jobs_.push_back({o.action() == v1::ReleaseOrder::EVICT ? Job::kEvict
                                                               : Job::kOffload,
                         o.tensor_id()});
      }
      for (uint64_t id : orders.prefetch_tensor_ids()) {
        ++stats_.orders_received;
        jobs_.push_back({Job::kPrefetch, id});
      }
    }
    work_.notify_all();
  }
  if (!lost.empty()) keeper_.Lost(lost);
}

void Client::OnLost(const DaemonLink* from, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A link already replaced, or lost before, was dealt with then.
    if (from == nullptr || from != link_.get() || !stats_.connected) return;
    DetachLocked();
  }
  keeper_.Lost(why);
}

void Client::DetachLocked() {
  stats_.connected = false;
  {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beat_link_.reset();
  }
  budget_note_.clear();
  DropOrdersLocked();  // the daemon's state went with it
  arena_.SetHeapAllowance(options_.fallback_host_bytes);
  // Kept open until the keeper ends it: its slabs may hold offloaded bytes
  // that must be moved out first.
  lost_link_ = std::move(link_);
  lost_draining_ = draining_seen_;
  work_.notify_all();
}

bool Client::EndLostSession() {
  std::shared_ptr<DaemonLink> lost;
  bool draining;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lost = lost_link_;
    draining = lost_draining_;
  }
  if (lost == nullptr) return true;
  const uint64_t session = lost->session().session_id();
  // A daemon that still holds the session (it stalled, or refused a batch)
  // wipes its slabs once it is closed, and may grant them to another
  // process: their offloaded bytes move to the heap first. One that is
  // going away (it said it drains, or closed the side connection: it died)
  // will never touch them: their mappings keep the bytes, and the process
  // keeps using them as its own host memory.
  const bool wiped = !draining && !lost->SideClosedByDaemon();
  if (wiped && !EvacuateSlabsOf(session)) return false;
  {
    // Its chunk ids mean nothing to the next session; and once it is gone
    // a new link may take its address, which the bookkeeping must not
    // mistake for it.
    std::lock_guard<std::mutex> lock(chunk_mu_);
    if (chunk_link_ == lost.get()) {
      (void)device_->ShrinkChunksTo(0);
      daemon_chunk_.clear();
      chunk_link_ = nullptr;
    }
  }
  // Cut off, not closed: the daemon must see a broken stream (and log and
  // count it) rather than a process that ended its session in order.
  lost->Cancel("the session was lost");
  lost->Close();
  // Those of earlier sessions may have emptied since, too.
  arena_.UnmapRetired();
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_link_ == lost) lost_link_.reset();
  return true;
}

void Client::DropOrdersLocked() {
  // Orders of a session that ended are moot; whoever waits for them to be
  // carried out waits no more.
  for (const Job& job : jobs_) {
    if (job.release()) UnorderLocked(job.id);
  }
  jobs_.clear();
  queued_releases_ = 0;
  changed_.notify_all();
}

bool Client::connected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.connected;
}

}  // namespace deltad::client
