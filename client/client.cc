#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace deltad::client {

namespace {

using Kind = v1::TensorEvent;

policy::TensorSpec SpecOf(const TensorInfo& info) {
  policy::TensorSpec spec;
  spec.id = info.id;
  spec.session = LocalPolicy::kSession;
  spec.gpu = LocalPolicy::kGpu;
  spec.bytes = info.bytes;
  spec.flags = {info.evict_pinned, info.offload_pinned, info.uncomputable};
  spec.compute_cost_ns = info.compute_cost_ns;
  spec.parents = info.parents;
  spec.stable_key = info.stable_key;
  return spec;
}

}  // namespace

void Client::AddCreated(v1::EventBatch& batch, const TensorInfo& info) {
  v1::TensorCreated* c = batch.add_created();
  c->set_tensor_id(info.id);
  c->set_bytes(info.bytes);
  c->mutable_flags()->set_evict_pinned(info.evict_pinned);
  c->mutable_flags()->set_offload_pinned(info.offload_pinned);
  c->mutable_flags()->set_uncomputable(info.uncomputable);
  c->set_compute_cost_ns(info.compute_cost_ns);
  for (uint64_t p : info.parents) c->add_parent_ids(p);
  c->set_stable_key(info.stable_key);
}

int64_t Client::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Client::Client(ClientOptions options, std::unique_ptr<Device> device)
    : options_(std::move(options)),
      device_(std::move(device)),
      local_(policy::LinkBandwidth{}, options_.local_filter),
      keeper_({std::chrono::milliseconds(options_.reconnect_interval_ms),
               std::chrono::milliseconds(options_.max_reconnect_interval_ms),
               options_.reconnect_interval_ms > 0},
              KeeperHooks()) {
  budget_bytes_ = options_.fallback_budget_bytes;
  // The device outlives the arena (members die in reverse order).
  Device* d = device_.get();
  arena_.SetPinner({[d](void* p, int64_t n) { return d->RegisterHost(p, n); },
                    [d](void* p) { d->UnregisterHost(p); }});
  arena_.SetHeapAllowance(options_.fallback_host_bytes);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    ClientOptions options, std::unique_ptr<Device> device) {
  if (device == nullptr) {
    return absl::InvalidArgumentError("a client needs a device");
  }
  if (options.fallback_budget_bytes <= 0 || options.batch_events <= 0 ||
      options.flush_interval_ms <= 0 || options.reconnect_interval_ms < 0 ||
      options.max_reconnect_interval_ms < options.reconnect_interval_ms ||
      options.admission_wait_ms < 0 || options.link.min_budget_bytes < 0) {
    return absl::InvalidArgumentError(
        "client options: the fallback budget, batch size and flush interval "
        "must be positive, the reconnect interval not negative nor above its "
        "maximum, the admission wait and minimum budget not negative");
  }
  if (options.link.gpu < 0 && options.link.gpu_uuid.empty()) {
    options.link.gpu_uuid = device->gpu_uuid();
  }
  std::unique_ptr<Client> client(
      new Client(std::move(options), std::move(device)));
  client->executor_ = std::thread([c = client.get()] { c->ExecutorLoop(); });
  if (client->options_.use_daemon) {
    absl::Status first = client->TryConnect();
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::milliseconds(client->options_.admission_wait_ms);
    auto wait = std::chrono::milliseconds(50);
    if (absl::IsResourceExhausted(first) &&
        std::chrono::steady_clock::now() < deadline) {
      std::fprintf(stderr,
                   "deltad client: deltad refused the session (%s); asking "
                   "again for up to %d ms\n",
                   std::string(first.message()).c_str(),
                   client->options_.admission_wait_ms);
    }
    while (absl::IsResourceExhausted(first) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(
          wait, deadline - std::chrono::steady_clock::now()));
      wait = std::min(2 * wait, std::chrono::milliseconds(2000));
      first = client->TryConnect();
    }
    if (!first.ok() && client->options_.require_session) {
      // Fail closed: the caller asked to stop rather than train unmanaged.
      return absl::Status(
          first.code(),
          absl::StrCat("no session with deltad (require_session is set, so "
                       "the job does not train on in-process decisions): ",
                       first.message()));
    }
    // Not reaching the daemon is not an error: training goes on without
    // it, and the keeper attaches when it answers.
    client->keeper_.Start(first);
  }
  return client;
}

Client::~Client() { Close(); }

// --- events -----------------------------------------------------------------

void Client::AddEventLocked(v1::TensorEvent::Kind kind, uint64_t id) {
  v1::TensorEvent* e = pending_.add_events();
  e->set_kind(kind);
  e->set_tensor_id(id);
  e->set_at_ns(NowNs());
  if (kind == Kind::FREED) pending_freed_.insert(id);
}

v1::EventBatch Client::TakeBatchLocked() {
  v1::EventBatch batch;
  batch.Swap(&pending_);
  batch.set_device_bytes_in_use(device_bytes_);
  pending_freed_.clear();
  return batch;
}

void Client::FlushIfDue(bool force) {
  std::lock_guard<std::mutex> send_lock(send_mu_);
  std::shared_ptr<DaemonLink> link;
  v1::EventBatch batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int waiting = pending_.created_size() + pending_.events_size() +
                        (pending_.iteration_peak_bytes() > 0 ? 1 : 0);
    if (waiting == 0 || (!force && waiting < options_.batch_events)) return;
    if (link_ == nullptr || !stats_.connected) {
      // Nobody to tell; a new session gets the whole state replayed.
      pending_.Clear();
      pending_freed_.clear();
      return;
    }
    link = link_;
    batch = TakeBatchLocked();
  }
  if (link->Send(batch).ok()) ++batches_sent_;
}

void Client::Flush() { FlushIfDue(/*force=*/true); }

void Client::NotePeakLocked() {
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, device_bytes_);
  iteration_peak_ = std::max(iteration_peak_, device_bytes_);
}

void Client::IterationDone() {
  std::lock_guard<std::mutex> lock(mu_);
  // Streamed with the next batch (flush_interval_ms at most); while no
  // session is open it is dropped with the batch.
  pending_.set_iteration_peak_bytes(std::max<int64_t>(iteration_peak_, 1));
  iteration_peak_ = device_bytes_;
}

// --- public API --------------------------------------------------------------

absl::StatusOr<void*> Client::Track(const TensorInfo& info,
                                    RecomputeFn recompute) {
  if (info.bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", info.id, ": size must be positive, got ", info.bytes));
  }
  bool flush_first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (records_.contains(info.id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor id ", info.id, " is already tracked"));
    }
    for (uint64_t p : info.parents) {
      if (!records_.contains(p)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor ", info.id, ": parent ", p, " is not tracked"));
      }
    }
    // The daemon applies a batch's creations before its events, so an id
    // freed in the waiting batch must reach it before being created again.
    flush_first = pending_freed_.contains(info.id);
  }
  if (flush_first) Flush();
  auto device = AllocateDevice(info.bytes);
  if (!device.ok()) return device.status();
  bool flush = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = local_.table().Add(SpecOf(info), NowNs()); !s.ok()) {
      device_->Free(*device, info.bytes);
      device_bytes_ -= info.bytes;
      return s;
    }
    (void)local_.table().Lock(info.id);
    auto r = std::make_unique<Record>();
    r->info = info;
    r->recompute = std::move(recompute);
    r->device = *device;
    r->pins = 1;
    for (uint64_t p : info.parents) ++records_.at(p)->live_children;
    records_[info.id] = std::move(r);
    AddCreated(pending_, info);
    flush = pending_.created_size() + pending_.events_size() >=
            options_.batch_events;
  }
  if (flush) FlushIfDue(false);
  return *device;
}

absl::StatusOr<void*> Client::Pin(uint64_t id, bool* restored) {
  const int64_t start = NowNs();
  if (restored != nullptr) *restored = false;
  for (;;) {
    Record* r;
    Where where;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = records_.find(id);
      if (it == records_.end()) {
        return absl::NotFoundError(absl::StrCat("tensor ", id, " is unknown"));
      }
      r = it->second.get();
      // A copy in flight finishes first; the executor wakes us.
      changed_.wait(lock, [&] {
        return r->where != Where::kOffloading && r->where != Where::kReloading;
      });
      where = r->where;
      if (where == Where::kResident) {
        ++r->pins;
        // A freed tensor rebuilt for a child is freed to the daemon and the
        // local table alike: its use is not theirs to see.
        if (!r->rebuilt_freed) {
          (void)local_.table().Touch(id, NowNs());
          (void)local_.table().Lock(id);
          AddEventLocked(Kind::ACCESSED, id);
        }
        stats_.stall_ns += NowNs() - start;
        return r->device;
      }
    }
    absl::Status s =
        where == Where::kOffloaded ? Reload(id, Need::kNow) : Recompute(id);
    if (!s.ok()) return s;
    if (restored != nullptr) *restored = true;
  }
}

void Client::Unpin(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end() || it->second->pins == 0) return;
  Record& r = *it->second;
  --r.pins;
  if (r.rebuilt_freed) {
    if (r.pins == 0) {
      // Rebuilt only for a child's recompute: the framework had dropped it.
      device_->Free(r.device, r.info.bytes);
      device_bytes_ -= r.info.bytes;
      unreported_bytes_ -= r.info.bytes;
      r.device = nullptr;
      r.where = Where::kFreed;
      r.rebuilt_freed = false;
      changed_.notify_all();
    }
    return;
  }
  (void)local_.table().Unlock(id);
}

absl::Status Client::Free(uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", id, " is unknown"));
  }
  Record* r = it->second.get();
  if (r->where == Where::kFreed) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id, " was already freed"));
  }
  changed_.wait(lock, [&] {
    return r->where != Where::kOffloading && r->where != Where::kReloading;
  });
  if (r->device != nullptr) {
    device_->Free(r->device, r->info.bytes);
    device_bytes_ -= r->info.bytes;
    r->device = nullptr;
  }
  if (r->host.data != nullptr) {
    arena_.Free(r->host);
    r->host = {};
  }
  r->pins = 0;
  r->where = Where::kFreed;
  (void)local_.table().Free(id);
  AddEventLocked(Kind::FREED, id);
  if (r->live_children == 0) DropLocked(id);
  return absl::OkStatus();
}

void Client::Prefetch(absl::Span<const uint64_t> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : ids) {
    auto it = records_.find(id);
    // Checked again when the job runs; this only keeps the queue short.
    if (it == records_.end() || it->second->where != Where::kOffloaded) {
      continue;
    }
    jobs_.push_back({Job::kPrefetchHint, id});
  }
  work_.notify_all();
}

bool Client::Resident(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = records_.find(id);
  return it != records_.end() && it->second->where == Where::kResident;
}

void Client::DropLocked(uint64_t id) {
  std::vector<uint64_t> work{id};
  while (!work.empty()) {
    const uint64_t d = work.back();
    work.pop_back();
    auto it = records_.find(d);
    if (it == records_.end()) continue;
    for (uint64_t p : it->second->info.parents) {
      auto parent = records_.find(p);
      if (parent == records_.end()) continue;
      if (--parent->second->live_children == 0 &&
          parent->second->where == Where::kFreed) {
        work.push_back(p);
      }
    }
    records_.erase(it);
  }
}

ClientStats Client::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ClientStats s = stats_;
  s.device_bytes = device_bytes_;
  s.raw_bytes = raw_bytes_;
  s.budget_bytes = budget_bytes_;
  s.host_bytes = arena_.used_bytes();
  const SessionKeeper::Stats kept = keeper_.stats();
  s.sessions_lost = kept.sessions_lost;
  s.attach_failures = kept.attach_failures;
  return s;
}

void Client::Close() {
  // First: an attempt under way may wait for copies the executor makes.
  keeper_.Stop();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    work_.notify_all();
  }
  if (executor_.joinable()) executor_.join();
  std::shared_ptr<DaemonLink> link;
  std::shared_ptr<DaemonLink> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    link = std::move(link_);
    lost = std::move(lost_link_);
    stats_.connected = false;
  }
  if (link != nullptr) link->Close();
  if (lost != nullptr) lost->Close();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : records_) {
    if (r->device != nullptr) device_->Free(r->device, r->info.bytes);
    if (r->host.data != nullptr) arena_.Free(r->host);
  }
  records_.clear();
  // AllocateRaw's blocks stay mapped, and FreeRaw may still come for them.
  device_bytes_ = raw_bytes_;
  // Imported chunks keep their memory alive until dropped, whatever the
  // daemon's accounting says once the session is gone.
  (void)device_->ShrinkChunksTo(0);
}

// --- byte work ---------------------------------------------------------------

void Client::RefuseLocked(uint64_t id, Origin origin) {
  if (origin == Origin::kDaemonOrder) {
    ++stats_.orders_refused;
    AddEventLocked(Kind::RELEASE_FAILED, id);
  } else {
    ++stats_.local_refused;
    (void)local_.table().CancelRelease(id);
  }
}

absl::Status Client::Offload(uint64_t id, Origin origin) {
  Record* r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(id);
    if (it == records_.end()) return absl::OkStatus();  // gone meanwhile
    r = it->second.get();
    if (origin != Origin::kLocalPlan &&
        (r->where == Where::kOffloading || r->where == Where::kOffloaded ||
         r->where == Where::kFreed)) {
      return absl::OkStatus();  // done already: the order came twice
    }
    if (r->where != Where::kResident || r->pins > 0 || r->info.offload_pinned) {
      RefuseLocked(id, origin);
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", id, " cannot be offloaded now (in use or pinned)"));
    }
    auto host = arena_.Allocate(r->info.bytes);
    if (!host.ok()) {
      RefuseLocked(id, origin);
      return host.status();
    }
    r->host = *host;
    r->where = Where::kOffloading;
    offloading_bytes_ += r->info.bytes;
    if (origin != Origin::kLocalPlan) {
      (void)local_.table().SetState(id, policy::TensorState::kOffloading);
    }
  }
  // The copy runs unlocked: the compute thread goes on, and one that needs
  // this tensor waits on changed_.
  device_->CopyToHost(r->host.data, r->device, r->info.bytes);
  std::lock_guard<std::mutex> lock(mu_);
  device_->Free(r->device, r->info.bytes);
  device_bytes_ -= r->info.bytes;
  offloading_bytes_ -= r->info.bytes;
  r->device = nullptr;
  r->where = Where::kOffloaded;
  (void)local_.table().SetState(id, policy::TensorState::kOffloaded);
  AddEventLocked(Kind::OFFLOADED, id);
  ++stats_.offloads;
  stats_.offloaded_bytes += r->info.bytes;
  changed_.notify_all();
  return absl::OkStatus();
}

absl::Status Client::Evict(uint64_t id, Origin origin) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return absl::OkStatus();
  Record* r = it->second.get();
  if (origin != Origin::kLocalPlan &&
      (r->where == Where::kEvicted || r->where == Where::kFreed)) {
    return absl::OkStatus();  // done already: the order came twice
  }
  if (r->where != Where::kResident || r->pins > 0 || r->info.evict_pinned ||
      r->info.uncomputable || !r->recompute) {
    RefuseLocked(id, origin);
    return absl::FailedPreconditionError(
        absl::StrCat("tensor ", id,
                     " cannot be evicted now (in use, pinned, or no "
                     "recompute function)"));
  }
  device_->Free(r->device, r->info.bytes);
  device_bytes_ -= r->info.bytes;
  r->device = nullptr;
  r->where = Where::kEvicted;
  if (origin != Origin::kLocalPlan) {
    (void)local_.table().SetState(id, policy::TensorState::kEvicted);
  }
  AddEventLocked(Kind::EVICTED, id);
  ++stats_.evictions;
  return absl::OkStatus();
}

absl::Status Client::Reload(uint64_t id, Need need) {
  const bool prefetch = need != Need::kNow;
  // A daemon's prefetch order is answered (RELEASE_FAILED) when declined;
  // a hint is just dropped.
  auto decline = [&] {
    if (need == Need::kPrefetchOrder) RefuseLocked(id, Origin::kDaemonOrder);
  };
  Record* r;
  int64_t bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(id);
    if (it == records_.end()) return absl::OkStatus();
    r = it->second.get();
    bytes = r->info.bytes;
    if (r->where != Where::kOffloaded) {
      // Someone else brought it back (its RELOADED answers a prefetch
      // order too), or it is on its way.
      return absl::OkStatus();
    }
    if (prefetch &&
        (making_room_ > 0 || device_bytes_ + bytes > budget_bytes_)) {
      // A prefetch must not push others out, nor take room an allocation
      // is being made for: it is only a head start.
      decline();
      return absl::OkStatus();
    }
    // Claimed before the allocation, so a second Pin waits on this one;
    // a prefetch reserves its bytes with the check, so that an allocation
    // meanwhile cannot take the same room.
    if (prefetch) {
      ++prefetching_;
      device_bytes_ += bytes;
    }
    r->where = Where::kReloading;
    r->restoring_from = Where::kOffloaded;
    (void)local_.table().SetState(id, policy::TensorState::kReloading);
  }
  auto device = prefetch ? device_->Allocate(bytes) : AllocateDevice(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  if (!device.ok()) {
    r->where = Where::kOffloaded;
    (void)local_.table().SetState(id, policy::TensorState::kOffloaded);
    if (prefetch) {
      decline();
      --prefetching_;
      device_bytes_ -= bytes;
    }
    changed_.notify_all();
    return prefetch ? absl::OkStatus() : device.status();
  }
  lock.unlock();
  device_->CopyToDevice(*device, r->host.data, bytes);
  lock.lock();
  arena_.Free(r->host);
  r->host = {};
  r->device = *device;
  r->where = Where::kResident;
  (void)local_.table().SetState(id, policy::TensorState::kResident);
  AddEventLocked(Kind::RELOADED, id);
  ++stats_.reloads;
  if (prefetch) {
    ++stats_.prefetches;
    --prefetching_;
  }
  stats_.reloaded_bytes += bytes;
  NotePeakLocked();
  changed_.notify_all();
  return absl::OkStatus();
}

absl::Status Client::Recompute(uint64_t id) {
  RecomputeFn fn;
  int64_t bytes;
  bool was_freed;
  Record* r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = records_.find(id);
    if (it == records_.end()) return absl::OkStatus();  // Pin looks again
    r = it->second.get();
    if (r->where != Where::kEvicted && r->where != Where::kFreed) {
      return absl::OkStatus();  // rebuilt meanwhile; Pin looks again
    }
    if (!r->recompute) {
      return absl::DataLossError(absl::StrCat(
          "tensor ", id, " is gone and has no recompute function"));
    }
    fn = r->recompute;
    bytes = r->info.bytes;
    was_freed = r->where == Where::kFreed;
    // Claimed, like a reload, so that concurrent Pins and Free wait for
    // this one (which also keeps the record alive).
    r->restoring_from = r->where;
    r->where = Where::kReloading;
  }
  auto device = AllocateDevice(bytes);
  absl::Status status = device.status();
  if (device.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    unreported_bytes_ += bytes;
  }
  const int64_t start = NowNs();
  if (device.ok()) status = fn(id, *device);
  const int64_t took = NowNs() - start;
  std::lock_guard<std::mutex> lock(mu_);
  if (device.ok() && !was_freed) unreported_bytes_ -= bytes;
  if (!status.ok()) {
    if (device.ok()) {
      device_->Free(*device, bytes);
      device_bytes_ -= bytes;
      if (was_freed) unreported_bytes_ -= bytes;
    }
    r->where = was_freed ? Where::kFreed : Where::kEvicted;
    changed_.notify_all();
    return absl::Status(status.code(), absl::StrCat("recomputing tensor ", id,
                                                    ": ", status.message()));
  }
  r->device = *device;
  r->where = Where::kResident;
  ++stats_.recomputes;
  stats_.recompute_ns += took;
  if (was_freed) {
    // The framework dropped it; it lives only while a child's recompute
    // pins it (see Unpin). The daemon keeps it as freed.
    r->rebuilt_freed = true;
  } else {
    (void)local_.table().MarkRecomputed(id, NowNs());
    AddEventLocked(Kind::RECOMPUTED, id);
  }
  changed_.notify_all();
  return absl::OkStatus();
}

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
      response =
          link->Release(bytes + extra + unreported, batch, batches_sent_);
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

absl::Status Client::ReleaseInProcess(int64_t need, int64_t start_ns) {
  std::vector<v1::ReleaseOrder> orders;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The daemon's orders not carried out yet are not the plan's to choose
    // (see ordered_): locked while it plans, as an op's tensors are.
    std::vector<uint64_t> shielded;
    for (uint64_t id : ordered_) {
      if (local_.table().Lock(id).ok()) shielded.push_back(id);
    }
    auto plan = local_.Plan(need, NowNs(), arena_.available_bytes());
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
  int64_t local_refused_at_start = 0;
  for (int round = 0;; ++round) {
    bool reserved = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (round == 0) {
        refused_at_start = stats_.orders_refused;
        local_refused_at_start = stats_.local_refused;
      }
      if (granted || device_bytes_ + bytes <= budget_bytes_) {
        device_bytes_ += bytes;
        NotePeakLocked();
        reserved = true;
      } else if (round >= kRounds) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "no room for ", bytes, " bytes: ", device_bytes_, " of ",
            budget_bytes_, " budget bytes held after releasing what could be (",
            round, " tries in ", (NowNs() - start_ns) / 1000000, " ms, ",
            stats_.orders_refused - refused_at_start,
            " of deltad's orders and ",
            stats_.local_refused - local_refused_at_start,
            " in-process releases refused as pinned or without host room, ",
            stats_.connected ? "connected" : "not connected", ")"));
      }
    }
    if (!reserved) {
      auto made = MakeRoom(bytes);
      if (!made.ok()) return made.status();
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
      return device.status();
    }
    // Short of chunks: the budget's may not all have come yet, or the
    // daemon made room beyond the budget, which takes more chunks; others
    // may still be giving theirs back (see ExecutorLoop).
    const int64_t held = device_->chunk_bytes_held();
    const int64_t want = granted ? std::max(budget, held + bytes) : budget;
    (void)SyncChunks(link, want);
    if (device_->chunk_bytes_held() > held) continue;
    if (granted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * (round + 1)));
      (void)SyncChunks(link, want);
      if (device_->chunk_bytes_held() > held) continue;
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
    // quota short of them; then `bytes` alone, as much as can be.)
    if (over > bytes && ReleaseInProcess(over, NowNs()).ok()) continue;
    if (absl::Status s = ReleaseInProcess(bytes, NowNs()); !s.ok()) {
      if (link == nullptr && MapPastBudgetInProcess(bytes)) continue;
      return absl::ResourceExhaustedError(
          absl::StrCat(device.status().message(), "; ", s.message()));
    }
  }
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

bool Client::WaitForOwedChunks(const std::shared_ptr<DaemonLink>& link,
                               int64_t budget, int64_t bytes,
                               int64_t deadline_ns) {
  const int64_t owed = InWholeChunks(*link, budget);
  for (int i = 1; NowNs() < deadline_ns; ++i) {
    {
      // A session that ended (the daemon died, or this process reconnected
      // meanwhile) owes nothing: its link would fail every call until the
      // deadline, and every allocation would wait that long.
      std::lock_guard<std::mutex> lock(mu_);
      if (!stats_.connected || link_ != link) return false;
    }
    // Owed only while both counts are short: the device's (the budget
    // covers every chunk this process maps, those of an earlier session
    // that its tensors still use included) and the daemon's (which grants
    // up to the budget in its session's chunks, and knows nothing of an
    // earlier session's). Either one full, no chunk will come.
    const int64_t held = device_->chunk_bytes_held();
    if (held >= owed || SessionChunkBytes(*link) >= owed) return false;
    // The sessions holding them release only when told: an idle one, or
    // one whose tensors were pinned when it was last told, hears it again.
    (void)MakeRoom(bytes);
    if (!SyncChunks(link, owed).ok()) return false;
    if (device_->chunk_bytes_held() > held) return true;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(5 * i, 100)));
  }
  return false;
}

int64_t Client::SessionChunkBytes(const DaemonLink& link) {
  std::lock_guard<std::mutex> lock(chunk_mu_);
  if (&link != chunk_link_) return 0;
  return static_cast<int64_t>(daemon_chunk_.size()) *
         link.session().chunk_bytes();
}

int64_t Client::InWholeChunks(const DaemonLink& link, int64_t budget) {
  // Asking for a partial chunk's worth would round up past the budget.
  const int64_t chunk = link.session().chunk_bytes();
  return chunk > 0 ? budget / chunk * chunk : budget;
}

absl::Status Client::SyncChunks(const std::shared_ptr<DaemonLink>& link,
                                int64_t want) {
  if (device_->chunk_backend().empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(chunk_mu_);
  {
    // A link taken before the session changed (the daemon restarted while
    // an allocation waited) would switch the bookkeeping below back to it,
    // and the current session's chunks, in use, would be forgotten: never
    // given back, and counted by the daemon against every new grant.
    std::lock_guard<std::mutex> state(mu_);
    const DaemonLink* current =
        connecting_ != nullptr ? connecting_
                               : (stats_.connected ? link_.get() : nullptr);
    if (link.get() != current) {
      return absl::FailedPreconditionError(
          "the daemon session changed meanwhile");
    }
  }
  if (link.get() != chunk_link_) {
    // Chunks of an earlier session that tensors still use stay mapped
    // (their memory lives while mapped) but are ours alone now: the new
    // session never granted them. The free ones are dropped, so that
    // memory the daemon no longer counts is not kept beside the new grant.
    (void)device_->ShrinkChunksTo(0);
    daemon_chunk_.clear();
    chunk_link_ = link.get();
  }
  if (link == nullptr) {
    if (device_->chunk_bytes_held() >= want) return absl::OkStatus();
    return device_->AddLocalChunks(want);
  }
  const v1::OpenSessionResponse& session = link->session();
  if (session.backend() != device_->chunk_backend()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "deltad's device memory is ", session.backend(), " chunks, which a ",
        device_->name(), " device cannot map"));
  }
  if (const std::string uuid = device_->gpu_uuid();
      !uuid.empty() && uuid != session.gpu_uuid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("deltad's GPU ", link->gpu(), " is ", session.gpu_uuid(),
                     " but this process's device is ", uuid,
                     " (check CUDA_VISIBLE_DEVICES)"));
  }
  if (device_->chunk_bytes_held() < want) {
    auto chunks = link->FetchChunks(want);
    if (!chunks.ok()) return chunks.status();
    std::vector<uint64_t> unusable;
    absl::Status status;
    for (const common::side::Grant& c : *chunks) {
      const uint64_t key = next_chunk_key_++;
      absl::Status s =
          status.ok() ? device_->AddChunk(key, c.fd.get(), c.bytes) : status;
      if (s.ok()) {
        daemon_chunk_[key] = c.id;
      } else {
        status = s;
        unusable.push_back(c.id);
      }
    }
    if (!unusable.empty()) (void)link->ReturnChunks(unusable);
    if (!status.ok()) return status;
  }
  // Down to the whole chunks that cover `want`, never below it.
  const int64_t chunk = std::max<int64_t>(1, session.chunk_bytes());
  const int64_t keep = (want + chunk - 1) / chunk * chunk;
  if (device_->chunk_bytes_held() > keep) {
    std::vector<uint64_t> ids;
    for (uint64_t key : device_->ShrinkChunksTo(keep)) {
      auto it = daemon_chunk_.find(key);
      if (it == daemon_chunk_.end()) continue;
      ids.push_back(it->second);
      daemon_chunk_.erase(it);
    }
    if (!ids.empty()) return link->ReturnChunks(ids);
  }
  return absl::OkStatus();
}

// --- executor ----------------------------------------------------------------

void Client::ExecutorLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    work_.wait_for(lock, std::chrono::milliseconds(options_.flush_interval_ms),
                   [&] { return stopping_ || !jobs_.empty(); });
    if (stopping_) break;
    while (!jobs_.empty() && !stopping_) {
      const Job job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      switch (job.kind) {
        case Job::kOffload:
          (void)Offload(job.id, Origin::kDaemonOrder);
          break;
        case Job::kEvict:
          (void)Evict(job.id, Origin::kDaemonOrder);
          break;
        case Job::kPrefetch:
          (void)Reload(job.id, Need::kPrefetchOrder);
          break;
        case Job::kPrefetchHint:
          (void)Reload(job.id, Need::kPrefetchHint);
          break;
      }
      lock.lock();
      if (job.release()) UnorderLocked(job.id);
      if (job.release() && queued_releases_ > 0) {
        --queued_releases_;
        changed_.notify_all();
      }
    }
    // After a budget order (a cut, or the daemon asking for what it lent
    // beyond the budget because another session is short), chunks past the
    // budget go back as they come free, and chunks short of it are asked
    // for again; every 20 ms until the device holds the budget.
    std::shared_ptr<DaemonLink> chunk_link;
    const int64_t chunk_budget = budget_bytes_;
    const bool sync_chunks = stats_.connected &&
                             !device_->chunk_backend().empty() && chunks_due_ &&
                             NowNs() >= next_chunk_check_ns_;
    if (sync_chunks) {
      chunk_link = link_;
      next_chunk_check_ns_ = NowNs() + 20'000'000;
    }
    lock.unlock();
    if (sync_chunks) {
      const int64_t want = InWholeChunks(*chunk_link, chunk_budget);
      (void)SyncChunks(chunk_link, want);
      // Chunks in use past the budget although its bytes fit: rounding (a
      // tensor of a chunk and a bit takes two) and pages of small blocks
      // hold more than the bytes say, and another session waits for those
      // chunks. Tensors go until enough whole chunks come free, every 20 ms
      // while the chunks are due; each round releases the excess at the
      // device's rate of bytes to chunks, since a tensor frees more chunk
      // than its bytes and the whole excess would release up to twice it.
      // Only the daemon's chunks are owed: those an earlier session left
      // in use (the daemon restarted) are this process's alone.
      const int64_t in_use =
          device_->chunk_bytes_held() - device_->chunk_bytes_free();
      const int64_t owed =
          std::min(in_use, SessionChunkBytes(*chunk_link)) - want;
      if (owed > 0) {
        int64_t held_bytes;
        {
          std::lock_guard<std::mutex> relock(mu_);
          held_bytes = device_bytes_;
        }
        const int64_t release = std::max<int64_t>(
            1, static_cast<int64_t>(static_cast<double>(owed) *
                                    static_cast<double>(held_bytes) /
                                    static_cast<double>(in_use)));
        (void)ReleaseInProcess(release, NowNs());
        (void)SyncChunks(chunk_link, want);
      }
      // Short too (the others had not given theirs back yet) keeps it due.
      if (device_->chunk_bytes_held() == want) {
        std::lock_guard<std::mutex> relock(mu_);
        // Unless a newer order came meanwhile.
        if (budget_bytes_ == chunk_budget) chunks_due_ = false;
      }
    }
    FlushIfDue(/*force=*/true);
    lock.lock();
  }
}

}  // namespace deltad::client
