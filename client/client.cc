#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

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
  {
    std::lock_guard<std::mutex> lock(mu_);
    // While no session is open it is dropped with the batch.
    pending_.set_iteration_peak_bytes(std::max<int64_t>(iteration_peak_, 1));
    iteration_peak_ = device_bytes_;
  }
  // Sent now (streamed: no answer waited for), so that the iteration ends
  // at the daemon between this batch's accesses and the next one's, and
  // when it ended (the daemon times iterations; see PrefetchOrder).
  FlushIfDue(/*force=*/true);
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
    if (options_.copy_ahead && info.copy_ahead && !info.offload_pinned) {
      r->ahead = Record::Ahead::kQueued;
      QueueCopyAheadLocked(info.id);
    }
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
  if (r.pins == 0 && r.ahead == Record::Ahead::kQueued && !ahead_ready_) {
    ahead_ready_ = true;  // its op is done with it: the executor may copy
    work_.notify_all();
  }
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
    return r->where != Where::kOffloading && r->where != Where::kReloading &&
           r->ahead != Record::Ahead::kCopying;
  });
  DropCopyLocked(r);
  if (r->device != nullptr) {
    device_->Free(r->device, r->info.bytes);
    device_bytes_ -= r->info.bytes;
    r->device = nullptr;
  }
  if (!r->host.empty()) {
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
  s.host_bytes = arena_.used_bytes() - ahead_bytes_;
  s.chunk_bytes = device_->chunk_bytes_held();
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
  {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beat_link_.reset();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : records_) {
      if (r->device != nullptr) device_->Free(r->device, r->info.bytes);
      if (!r->host.empty()) arena_.Free(r->host);
      if (!r->ahead_host.empty()) arena_.Free(r->ahead_host);
    }
    records_.clear();
    ahead_queue_.clear();
    ahead_landed_.clear();
    ahead_bytes_ = 0;
    // AllocateRaw's blocks stay mapped, and FreeRaw may still come for
    // them.
    device_bytes_ = raw_bytes_;
  }
  // The chunks that emptied go back before the session ends: the daemon
  // counts what a live process still maps after its session as in use
  // (left mapped) until the process is gone.
  {
    std::lock_guard<std::mutex> lock(chunk_mu_);
    if (link != nullptr) {
      (void)ShrinkChunksTo(*link, 0);
    } else {
      (void)device_->ShrinkChunksTo(0);
    }
  }
  if (link != nullptr) link->Close();
  if (lost != nullptr) lost->Close();
}

}  // namespace deltad::client
