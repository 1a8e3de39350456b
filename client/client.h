#ifndef DELTAD_CLIENT_CLIENT_H_
#define DELTAD_CLIENT_CLIENT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/daemon_link.h"
#include "client/device.h"
#include "client/host_arena.h"
#include "client/local_policy.h"
#include "client/session_keeper.h"
#include "common/log_limit.h"
#include "deltad/v1/memory_manager.pb.h"

namespace deltad::client {

// What the framework reports when an op produces a tensor.
struct TensorInfo {
  uint64_t id = 0;  // unique among this process's live tensors
  int64_t bytes = 0;
  std::vector<uint64_t> parents;  // the tensors the op read
  int64_t compute_cost_ns = 0;    // measured time of the op
  bool evict_pinned = false;      // may not be evicted
  bool offload_pinned = false;    // may not be offloaded
  bool uncomputable = false;      // inputs, parameters: no recompute path
  uint64_t stable_key = 0;        // same across iterations; 0 if unknown
  // Read again only in a later pass (a forward activation kept for the
  // backward): the client may copy it to host memory while the link idles,
  // so that releasing it later waits for no copy (ClientOptions::copy_ahead).
  bool copy_ahead = false;
};

// Rebuilds tensor `id` into `out` (device memory of its size): pins its
// parents through the client, reruns the op, unpins them. Runs on the thread
// that needed the tensor, with no client lock held.
using RecomputeFn = std::function<absl::Status(uint64_t id, void* out)>;

struct ClientOptions {
  LinkOptions link;
  // Opens each session; empty: DaemonLink::Open (gRPC and the side
  // socket). Tests put a daemon of their own here.
  DaemonLink::OpenFn open_link;
  // False: never contact a daemon; the in-process policy decides alone.
  bool use_daemon = true;
  // The budget while no daemon has granted one (never connected, or gone
  // before it granted any); a daemon's last grant is kept when it goes.
  int64_t fallback_budget_bytes = int64_t{1} << 30;
  // Heap the client may use for offloads while the daemon is out of reach,
  // beside the slabs it already holds. With a session, offloads go to the
  // daemon's slabs only (its host quota).
  int64_t fallback_host_bytes = int64_t{4} << 30;
  // Events are sent when this many are waiting, or after flush_interval_ms.
  int batch_events = 256;
  int flush_interval_ms = 2;
  // After a session is lost (or none could be opened), the first wait
  // between attempts to open one; it doubles after each failure, up to
  // max_reconnect_interval_ms. 0: never try again (a lost session is still
  // ended on both sides).
  int reconnect_interval_ms = 1000;
  int max_reconnect_interval_ms = 8000;
  // How long an allocation may wait for device chunks the daemon owes this
  // process (its budget covers them, but other sessions have yet to give
  // them back) before it fails with RESOURCE_EXHAUSTED.
  int owed_chunks_wait_ms = 10000;
  // A daemon that refuses the session because the GPU's running jobs keep
  // their floors (RESOURCE_EXHAUSTED at admission) is asked again, with
  // backoff, for up to this long before Connect returns; 0: not waited for
  // (the keeper still tries in the background).
  int admission_wait_ms = 0;
  // Fail closed: Connect fails when no session could be opened (within
  // admission_wait_ms), instead of training on in-process decisions.
  bool require_session = false;
  // Tensors marked TensorInfo::copy_ahead are copied to host memory, oldest
  // first, while the executor has nothing else to do and no offload is in
  // flight, once the process has released a tensor or holds 3/4 of its
  // budget (DELTA's release ahead of need, without a plan): offloading one
  // of them then frees its device memory at once, and the policy prices it
  // at its reload alone. The copies take only host room already mapped
  // (the session's slabs, or heap regions already allocated), and give it
  // up, oldest first, to any offload that needs it.
  bool copy_ahead = true;
  // The in-process policy: the daemon's defaults (delta_cost, sampled past
  // kDefaultExactBelow candidates).
  policy::FilterOptions local_filter = DefaultLocalFilter();

  static policy::FilterOptions DefaultLocalFilter() {
    policy::FilterOptions f;
    f.heuristic = policy::Heuristic::kDeltaCost;
    f.sampled = true;
    f.skip_small = true;
    f.exact_below = policy::kDefaultExactBelow;
    return f;
  }
};

// What the client did, for the caller's summary and tests.
struct ClientStats {
  int64_t device_bytes = 0;       // held on the device now
  int64_t peak_device_bytes = 0;  // most held at once
  int64_t budget_bytes = 0;
  int64_t host_bytes = 0;  // offloaded bytes held now
  int64_t offloaded_bytes = 0;
  int64_t reloaded_bytes = 0;
  int64_t offloads = 0;
  int64_t reloads = 0;
  int64_t prefetches = 0;  // reloads done ahead of use
  int64_t evictions = 0;
  int64_t recomputes = 0;
  int64_t recompute_ns = 0;
  int64_t orders_received = 0;
  int64_t orders_refused = 0;  // pinned or gone: RELEASE_FAILED
  int64_t sync_releases = 0;   // allocations that waited for releases
  int64_t sync_release_ns = 0;
  int64_t raw_bytes = 0;        // of device_bytes, held by AllocateRaw
  int64_t stall_ns = 0;         // compute waiting for reloads and offloads
  int64_t local_decisions = 0;  // releases chosen in-process
  int64_t local_refused = 0;    // of them, not carried out:
  int64_t local_refused_no_host = 0;  // an offload the host quota lacked
  int64_t local_refused_in_use = 0;   // pinned by an op, or being restored
  int64_t reconnects = 0;             // sessions opened after the first
  int64_t copies_ahead = 0;           // tensors copied to the host ahead
  int64_t copied_ahead_bytes = 0;
  int64_t offloads_from_copies = 0;  // of offloads, those that took no copy
  int64_t copies_ahead_dropped = 0;  // given up for an offload's room
  int64_t copies_kept = 0;  // reloads whose host bytes stayed as a copy
  // Without a daemon: the most chunk bytes mapped past the budget's whole
  // chunks, for what rounding took (see MapPastBudgetInProcess). The
  // budget in bytes is passed only as past_budget_allocations says.
  int64_t past_budget_bytes = 0;
  // Allocations served past the budget from chunks already mapped, when
  // everything held was in use by running ops (a budget cut mid-op).
  int64_t past_budget_allocations = 0;
  // Device chunk bytes this process maps now (a chunk-backed device).
  int64_t chunk_bytes = 0;
  // Sessions that ended without this process closing them (the stream
  // broke, a call failed, the daemon refused a batch): each was ended on
  // both sides and a new one sought.
  int64_t sessions_lost = 0;
  int64_t attach_failures = 0;  // attempts that opened no session
  int64_t rejected_batches = 0;
  // Calls for room sent again because the daemon answered late (a busy or
  // stalled daemon), in the same session.
  int64_t release_calls_sent_again = 0;
  bool connected = false;
  uint64_t session_id = 0;
};

// The client library: tracks this process's tensors on one GPU, reports
// them to deltad, and carries out its orders with real copies, so that the
// training runs within a budget. Tensors live in device memory the client
// allocates (Track); an op pins the tensors it uses (Pin / Unpin) so they
// stay resident while it runs; the framework frees them (Free).
//
// Orders from the daemon run on the client's executor thread, apart from the
// compute thread, which waits only for a tensor it needs that is not
// resident. When the daemon is out of reach (never started, crashed,
// stalled, draining) the client goes on with the same policies in-process,
// and its SessionKeeper opens a new session in the background as soon as
// the daemon answers, reporting its tensors anew.
//
// Thread safe; Pin and Track may be called from several threads.
class Client {
 public:
  // Connects to the daemon when options.use_daemon (falling back to the
  // local policy if it cannot), then starts the executor. The client owns
  // `device`.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      ClientOptions options, std::unique_ptr<Device> device);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();  // Close()

  // A new tensor: device memory for it, releasing others first if needed.
  // Returned pinned, for the producing op to write; Unpin it after. Its
  // parents must be tracked. INVALID_ARGUMENT for a bad size or a known id;
  // RESOURCE_EXHAUSTED when no release can make room.
  absl::StatusOr<void*> Track(const TensorInfo& info, RecomputeFn recompute);
  // Makes the tensor resident (waiting for a reload, or recomputing it),
  // records the access and pins it. NOT_FOUND for an unknown id.
  // `restored`, when given, says whether it had to be reloaded or
  // recomputed (so a caller can verify the bytes).
  absl::StatusOr<void*> Pin(uint64_t id, bool* restored = nullptr);
  void Unpin(uint64_t id);
  // The framework is done with the tensor: its memory is freed. A tensor
  // that an evicted descendant may need to be recomputed keeps its record
  // (no bytes) until then.
  absl::Status Free(uint64_t id);
  // A hint from the framework, which knows its order of use (backward
  // unpacks saved tensors in reverse): reload these offloaded tensors ahead
  // of use, in this order, on the executor. Only within the budget, never
  // pushing another tensor out; anything not offloaded is skipped.
  void Prefetch(absl::Span<const uint64_t> ids);
  // Whether the tensor's bytes are on the device now (a framework can then
  // read them instead of rebuilding them its own way).
  bool Resident(uint64_t id) const;

  // Device memory with no tensor behind it: what a framework's own
  // allocator holds (PyTorch's, through deltad_torch_malloc), so that one
  // budget covers everything the process allocates. Counted in the device
  // bytes and the peak as a tensor is, but never released by a policy, and
  // known to the daemon only as bytes (a synchronous release asks for room
  // for them too). When the budget is short, tracked tensors are released
  // for it as for Track. While the device has room within the budget it
  // takes one short critical section and the device's own: no record, no
  // event, no daemon round trip. INVALID_ARGUMENT for bytes <= 0;
  // FAILED_PRECONDITION once closed; RESOURCE_EXHAUSTED, naming the
  // budget, what is held and the request, when no release makes room.
  absl::StatusOr<void*> AllocateRaw(int64_t bytes);
  // AllocateRaw's first step alone: the memory if the budget and the device
  // have room now, else nullptr, with nothing released and no daemon asked.
  void* TryAllocateRaw(int64_t bytes) {
    return bytes > 0 ? TryAllocateWithinBudget(bytes, /*raw=*/true) : nullptr;
  }
  // `p` and `bytes` as AllocateRaw gave and was given; the caller keeps
  // them (the client has no record of its own to check them against).
  // Valid after Close: the memory stays mapped until the client dies.
  void FreeRaw(void* p, int64_t bytes);

  // Ends the session with the daemon and stops the executor; tensors still
  // tracked are freed. Idempotent.
  void Close();

  ClientStats Stats() const;
  bool connected() const;
  // Sends the waiting events now.
  void Flush();
  // A training iteration completed: the most device bytes held during it
  // go to the daemon with the next batch, and become the session's floor
  // there (no later admission cuts its budget below it). Streamed, not a
  // round trip.
  void IterationDone();

 private:
  friend class ClientTestPeer;  // tests reach the release steps directly
  enum class Where {
    kResident,
    kOffloading,
    kOffloaded,
    kReloading,
    kEvicted,
    kFreed,  // dropped by the framework, kept for a descendant's recompute
  };
  struct Record {
    TensorInfo info;
    RecomputeFn recompute;
    Where where = Where::kResident;
    void* device = nullptr;
    HostArena::Block host;
    int pins = 0;
    int live_children = 0;
    bool rebuilt_freed = false;  // a kFreed tensor rebuilt for a child
    // While kReloading: what it is being restored from (kOffloaded for a
    // reload; kEvicted or kFreed for a recompute).
    Where restoring_from = Where::kOffloaded;
    // A copy of a resident tensor's bytes made ahead of need (copy_ahead).
    enum class Ahead { kNone, kQueued, kCopying, kLanded };
    Ahead ahead = Ahead::kNone;
    HostArena::Block ahead_host;  // kCopying, kLanded
  };
  struct Job {
    // kPrefetch: the daemon's order; kPrefetchHint: the framework's.
    enum Kind { kOffload, kEvict, kPrefetch, kPrefetchHint } kind;
    uint64_t id;
    bool release() const { return kind == kOffload || kind == kEvict; }
  };
  // Who asked for a release, on the stream or in a synchronous answer, or
  // the in-process policy: decides which events report it.
  enum class Origin { kDaemonOrder, kLocalPlan };

  Client(ClientOptions options, std::unique_ptr<Device> device);

  // --- daemon connection (client_session.cc)
  SessionKeeper::Hooks KeeperHooks();
  absl::Status TryConnect();  // mu_ not held
  // After an attach: releases what the process holds past the new grant,
  // chosen in-process. What it did, for the attach's log line ("" when
  // within the budget). mu_ not held.
  std::string ReleaseDownToBudget();
  void OnOrders(const DaemonLink* from, const v1::Orders& orders);
  // The session of `from` ended or can no longer be trusted; nothing when
  // it is not the current one.
  void OnLost(const DaemonLink* from, const std::string& why);
  // Runs on in-process decisions from now on; the link waits in
  // lost_link_ for EndLostSession.
  void DetachLocked();
  // The keeper's hook: closes the lost link, its slabs' bytes moved out
  // first where the daemon could still wipe them. False when some could
  // not be moved (no heap left): the session stays open for now.
  bool EndLostSession();
  // The keeper's periodic check: cuts off a stream whose writes stall.
  void CheckLink();
  void DropOrdersLocked();
  void ReplayTensorsLocked();  // reports every tracked tensor to a new session
  // Moves offloaded bytes out of a session's slabs before it is closed.
  // False when some could not be moved (no heap left).
  bool EvacuateSlabsOf(uint64_t session);
  static void AddCreated(v1::EventBatch& batch, const TensorInfo& info);

  // --- events
  void AddEventLocked(v1::TensorEvent::Kind kind, uint64_t id);
  v1::EventBatch TakeBatchLocked();
  void FlushIfDue(bool force);  // mu_ not held
  void NotePeakLocked();        // device_bytes_ grew
  // No daemon, chunks full of rounding, nothing releasable frees one: maps
  // local chunks past the budget for `bytes`. False when the device is full.
  bool MapPastBudgetInProcess(int64_t bytes);
  // Past the budget, in chunks already mapped only; see the definition.
  absl::StatusOr<void*> AllocateInHeldChunks(int64_t bytes);

  // --- byte work; mu_ not held on entry
  absl::Status Offload(uint64_t id, Origin origin);
  // The offload's end: the device bytes go, the host block holds them.
  void FinishOffloadLocked(Record* r);
  absl::Status Evict(uint64_t id, Origin origin);
  // True (and the plan's choice of `id` refused) when an in-process plan
  // would release a tensor the daemon ordered released meanwhile. mu_.
  bool OrderedElsewhereLocked(uint64_t id, Origin origin);
  enum class Need { kNow, kPrefetchOrder, kPrefetchHint };
  absl::Status Reload(uint64_t id, Need need);
  absl::Status Recompute(uint64_t id);
  absl::StatusOr<void*> AllocateDevice(int64_t bytes);
  // AllocateDevice's common case: the bytes fit the budget and the device
  // has them. Null when either is short (nothing is then reserved); `raw`
  // counts them as AllocateRaw's, and refuses once closed.
  void* TryAllocateWithinBudget(int64_t bytes, bool raw);
  // The rest of AllocateDevice: releases, chunks from the daemon, waits.
  absl::StatusOr<void*> AllocateDeviceSlow(int64_t bytes);
  absl::StatusOr<void*> AllocateDeviceInRounds(int64_t bytes);
  // Device chunk bytes mapped beside those `link`'s session granted
  // (SessionMessage.unlisted_chunk_bytes); -1 when the chunks are busy.
  int64_t UnlistedChunkBytes(const DaemonLink& link);
  // Unmaps the empty chunks past `keep` bytes and returns those `link`'s
  // session granted; chunk_mu_ is held.
  absl::Status ShrinkChunksTo(DaemonLink& link, int64_t keep);
  // Releases so that `bytes` more fit, and `extra` beyond them (device
  // memory lost to rounding, which the byte counts miss): true when the
  // daemon made room on the GPU for it (possibly beyond this session's
  // budget), false when the caller should check its budget again.
  absl::StatusOr<bool> MakeRoom(int64_t bytes, int64_t extra = 0);
  // Releases `need` bytes of this process's tensors, chosen in-process;
  // with `up_to`, as much of them as can be (an error only when nothing
  // can), for a need in whole chunks that part of the bytes may free.
  absl::Status ReleaseInProcess(int64_t need, int64_t start_ns,
                                bool up_to = false);

  // --- device chunks (chunk-backed devices only); mu_ not held
  // Brings the chunks the device holds to `want` bytes: fetches the missing
  // ones from the daemon (which may grant fewer) and returns the free ones
  // beyond it; without a daemon, makes local ones. FAILED_PRECONDITION when the
  // daemon's chunks cannot be mapped by this device (another backend, another
  // GPU).
  absl::Status SyncChunks(const std::shared_ptr<DaemonLink>& link,
                          int64_t want);
  static int64_t InWholeChunks(const DaemonLink& link, int64_t budget);
  // Bytes of the chunks `link`'s session granted that this process holds.
  int64_t SessionChunkBytes(const DaemonLink& link);
  // Waits until `deadline_ns` for chunks the daemon owes (the budget covers
  // more than this process holds), asking it again and again to have the
  // sessions above their share release for `bytes`: true when some came,
  // false when none is owed or none came in time.
  bool WaitForOwedChunks(const std::shared_ptr<DaemonLink>& link,
                         int64_t budget, int64_t bytes, int64_t deadline_ns);
  // False when an order could not be carried out.
  bool CarryOut(const std::vector<v1::ReleaseOrder>& orders, Origin origin);
  enum class Refusal { kInUse, kNoHost, kOther };
  void RefuseLocked(uint64_t id, Origin origin, Refusal why = Refusal::kOther);

  // --- copies ahead of need (client_copy_ahead.cc)
  void QueueCopyAheadLocked(uint64_t id);
  // Copies queued tensors to the host while the executor is idle; returns
  // when it is not, or nothing can be copied. mu_ not held.
  void CopyAheadWhileIdle();
  // Waits until no copy ahead reads tensor `id`'s device bytes; its record
  // then, or null when it is gone meanwhile.
  Record* WaitForCopyAheadLocked(std::unique_lock<std::mutex>& lock,
                                 uint64_t id);
  // A reload has landed: its host bytes stay as a copy made ahead where
  // the tensor is read only (TensorInfo::copy_ahead), or are freed.
  void KeepReloadedCopyLocked(Record* r);
  // `r`'s copy is on the host: marked for the in-process plan, reported to
  // the daemon (HOST_COPIED) and listed for DropOldestCopyLocked, whose
  // list is pruned of copies gone meanwhile when it has doubled.
  void LandCopyLocked(Record* r);
  // Forgets `r`'s copy (the tensor leaves the device, or its room is
  // wanted): its host block goes back to the arena. Not for one in flight.
  void DropCopyLocked(Record* r);
  // Drops the oldest landed copy of a tensor still resident, telling the
  // daemon; false when there is none.
  bool DropOldestCopyLocked();
  // Host memory for an offload: copies ahead give up their room, oldest
  // first, when the arena has too little.
  absl::StatusOr<HostArena::Block> AllocateHostLocked(int64_t bytes);
  // What an offload can count on: the arena's free room and the copies it
  // would drop.
  int64_t HostAvailableLocked() const;

  void DropLocked(uint64_t id);  // forgets a record, then its freed parents
  void ExecutorLoop();
  static int64_t NowNs();

  const ClientOptions options_;
  const std::unique_ptr<Device> device_;
  HostArena arena_;

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a record left a transient state
  std::unordered_map<uint64_t, std::unique_ptr<Record>> records_;
  LocalPolicy local_;
  int64_t device_bytes_ = 0;      // reserved or held on the device
  int64_t iteration_peak_ = 0;    // most device_bytes_ since IterationDone
  int64_t offloading_bytes_ = 0;  // of tensors whose copy out is in flight
  int64_t queued_releases_ = 0;   // the daemon's release orders not yet run
  int prefetching_ = 0;           // prefetches between claim and copy done
  int making_room_ = 0;           // MakeRoom calls under way: no prefetch
  // Device bytes the daemon does not know are held: tensors being
  // recomputed (reported once rebuilt) and freed ones rebuilt for a child.
  int64_t unreported_bytes_ = 0;
  // Of device_bytes_, held by AllocateRaw: never released by a policy,
  // and unknown to the daemon, which sees tensors only.
  int64_t raw_bytes_ = 0;
  int64_t budget_bytes_ = 0;
  // Why the daemon last changed the budget, when it said
  // (Orders.budget_note): another session stopped answering.
  std::string budget_note_;
  // The current session's link for the keeper's checks and heartbeats,
  // under a lock of its own (set with link_, under mu_).
  int64_t last_check_ns_ = 0;  // the keeper's thread only (CheckLink)
  int64_t resumed_ns_ = 0;     // ditto: when it last ran again after a stop
  std::mutex beat_mu_;
  std::shared_ptr<DaemonLink> beat_link_;
  common::LogLimit budget_note_log_{4, std::chrono::seconds(60)};
  ClientStats stats_;
  v1::EventBatch pending_;
  std::unordered_set<uint64_t> pending_freed_;  // ids FREED in pending_

  // The link is replaced on reconnect; guarded by mu_, used outside it
  // through a shared_ptr copy.
  std::shared_ptr<DaemonLink> link_;
  // The link TryConnect is setting up, until it is link_ or has failed:
  // SyncChunks takes it for the current one.
  const DaemonLink* connecting_ = nullptr;
  // A session lost but not yet ended on both sides; guarded by mu_.
  std::shared_ptr<DaemonLink> lost_link_;
  bool lost_draining_ = false;  // its daemon said it was going away
  bool had_session_ = false;    // some session was opened before
  bool draining_seen_ = false;
  // Serialises taking a batch with sending it, so batches reach the daemon
  // in the order they were taken; also counts the stream's batches.
  std::mutex send_mu_;
  uint64_t batches_sent_ = 0;  // on the current link; guarded by send_mu_

  // One chunk sync at a time. The device knows chunks by keys the client
  // gives them; the daemon's ids are valid only for the link that granted
  // them, so chunks kept from an earlier daemon are never sent back to a
  // new one (which may reuse their ids).
  std::mutex chunk_mu_;
  uint64_t next_chunk_key_ = 1;                          // chunk_mu_
  std::unordered_map<uint64_t, uint64_t> daemon_chunk_;  // key -> id
  const DaemonLink* chunk_link_ = nullptr;               // chunk_mu_
  bool chunks_due_ = false;          // mu_: the budget changed, sync soon
  int64_t next_chunk_check_ns_ = 0;  // mu_

  std::deque<Job> jobs_;  // guarded by mu_
  // mu_: tensors to copy ahead, in the order made, and those whose copy
  // has landed, in the order landed (both may hold stale ids, skipped).
  std::deque<uint64_t> ahead_queue_;
  std::deque<uint64_t> ahead_landed_;
  static constexpr size_t kMinLandedCompactAt = 4096;
  size_t landed_compact_at_ = kMinLandedCompactAt;
  int64_t ahead_bytes_ = 0;   // mu_: the copies' host blocks
  bool ahead_ready_ = false;  // mu_: a queued tensor's op unpinned it
  // mu_: tensors of the daemon's release orders not carried out yet
  // (queued in jobs_, or in hand: the executor's, or an allocation's from
  // a Release answer). No in-process plan may choose them: the daemon
  // holds them as releasing, and an eviction it did not order would make
  // it refuse the batch (and the session be opened anew).
  std::multiset<uint64_t> ordered_;
  void UnorderLocked(uint64_t id) {
    if (auto it = ordered_.find(id); it != ordered_.end()) ordered_.erase(it);
  }
  std::condition_variable work_;
  bool stopping_ = false;
  std::thread executor_;
  // Last: its thread calls into everything above, and is stopped first.
  SessionKeeper keeper_;
};

}  // namespace deltad::client

#endif  // DELTAD_CLIENT_CLIENT_H_
