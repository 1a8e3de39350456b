#ifndef DELTAD_POLICIES_TENSOR_TABLE_H_
#define DELTAD_POLICIES_TENSOR_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "policies/epoch_marks.h"
#include "policies/evicted_components.h"
#include "policies/free_slots.h"
#include "policies/huge_page_allocator.h"
#include "policies/tensor.h"

namespace deltad::policy {

// Bytes of a GPU or a session, by where they are.
struct MemoryStats {
  int64_t device_bytes = 0;     // resident + offloading + reloading
  int64_t releasing_bytes = 0;  // offloading: on the device, leaving
  int64_t host_bytes = 0;       // offloaded (and offloading: the host copy)
  int64_t evicted_bytes = 0;    // evicted, to be recomputed when needed
  int64_t tensors = 0;          // tensors known, freed ones excluded
  // Bytes that count against a budget once releases in flight are done.
  int64_t committed_bytes() const { return device_bytes - releasing_bytes; }
};

// Every tensor the policy knows, indexed by id, GPU and session.
//
// Tensors live in slots of one vector; candidate lists (kResident tensors per
// GPU and per session) hold slot numbers with back-pointers so that adding,
// touching, freeing and state changes are O(1) amortised (O(degree) where
// parents and children are involved). The union-find of evicted components is
// kept current here because every state change passes through this class.
//
// Not thread safe: the owner serialises calls. References returned point into
// the table and are invalidated by Add/AddBatch.
class TensorTable {
 public:
  TensorTable() = default;
  TensorTable(const TensorTable&) = delete;
  TensorTable& operator=(const TensorTable&) = delete;

  // Adds one tensor, resident, accessed at `now_ns`. Its parents must exist
  // and belong to its session; a session's tensors all live on one GPU.
  absl::Status Add(const TensorSpec& spec, int64_t now_ns);
  // Adds a batch atomically: parents may be other tensors of the same batch
  // (in any order); a cycle among them is rejected and nothing is added.
  absl::Status AddBatch(absl::Span<const TensorSpec> specs, int64_t now_ns);

  // Records an access: advances the session's logical clock. Allowed while
  // the bytes occupy the device (reloading included: the op waits for it).
  absl::Status Touch(TensorId id, int64_t now_ns);
  // The framework dropped the tensor. Its bytes leave the device or the host
  // at once; its record stays while a live child may need it for recompute.
  absl::Status Free(TensorId id);
  // Moves a tensor to `to`, checking the transition is legal.
  absl::Status SetState(TensorId id, TensorState to);
  // A release that was planned but not carried out (the client refused or
  // failed): kOffloading, or kEvicted straight from the device, back to
  // kResident, no counters changed.
  absl::Status CancelRelease(TensorId id);
  // The tensor was rebuilt from its parents: resident again, count + 1.
  absl::Status MarkRecomputed(TensorId id, int64_t now_ns);
  // An op is using the tensor: it may not be released until unlocked.
  absl::Status Lock(TensorId id);
  absl::Status Unlock(TensorId id);
  // Free bytes around the tensor in the allocator (MegEngine's term).
  absl::Status SetAdjacentFreeBytes(TensorId id, int64_t bytes);
  // Whether a resident tensor's bytes are on the host already
  // (TensorFlags::host_copy).
  absl::Status SetHostCopy(TensorId id, bool copied);

  // Removes every tensor of the session at once, freed ones kept for
  // recompute included, and what the table keeps per session (its logical
  // clock, GPU binding, stats), so that a daemon serving sessions for
  // months does not grow. O(tensors in the table): freeing them one by one
  // would re-form evicted components over and over, quadratic in a long
  // chain. Sessions never share edges, so no other tensor is touched. The
  // table then gives back the memory its arrays no longer use.
  void RemoveSession(SessionId session);

  absl::StatusOr<const Tensor*> Get(TensorId id) const;
  const Tensor* Find(TensorId id) const;
  bool Contains(TensorId id) const { return index_.contains(id); }
  // The current tensor of a session with this stable key, if any.
  const Tensor* FindByKey(SessionId session, uint64_t key) const;

  MemoryStats GpuStats(GpuId gpu) const;
  MemoryStats SessionStats(SessionId session) const;
  MemoryStats ScopeStats(const Scope& scope) const;
  // Number of tensors recorded (freed but retained ones included).
  size_t size() const { return index_.size(); }

  // --- For the Filter and cost functions: slot-level access. -------------
  // The kResident tensors of the scope, in no particular order, each with
  // the fields a score's bound reads (CandidateEntry).
  absl::Span<const CandidateEntry> CandidateEntries(const Scope& scope) const;
  // Their slots, copied: for tests and reports, not for a search.
  std::vector<uint32_t> Candidates(const Scope& scope) const;
  // The scope's GPU: a session's is the one its tensors live on.
  GpuId ScopeGpu(const Scope& scope) const {
    if (!scope.session) return scope.gpu;
    auto it = session_gpu_.find(*scope.session);
    return it == session_gpu_.end() ? scope.gpu : it->second;
  }
  // Moves with every change that can add a candidate or lower a score
  // (an access, a tensor back on the device, an evicted one rebuilt or
  // gone, a host copy, ...), but not with a release (a candidate leaving
  // for kEvicted or kOffloading, which can only raise others' scores) or a
  // lock: a ranking of candidates (RankedCandidates) holds while it stays.
  uint64_t rank_epoch() const { return rank_epoch_; }
  // Summed bytes of the tensors in Candidates(scope).
  int64_t CandidateBytes(const Scope& scope) const;
  const Tensor& AtSlot(uint32_t slot) const { return slots_[slot]; }
  // Every slot is below this.
  size_t slot_count() const { return slots_.size(); }
  // Starts loading a tensor's first cache line; a hint, no effect on state.
  void Prefetch(uint32_t slot) const { __builtin_prefetch(&slots_[slot]); }
  uint32_t SlotOf(TensorId id) const;  // UINT32_MAX when unknown
  // The slot of a tensor of this table, without the id's lookup.
  uint32_t SlotOfTensor(const Tensor& t) const {
    return static_cast<uint32_t>(&t - slots_.data());
  }
  // The evicted components, rebuilt first if deferred changes left them
  // stale (DeferComponents).
  const EvictedComponents& components() const {
    if (components_stale_) RebuildComponents();
    return components_;
  }
  // While deferred, state changes leave the evicted components stale
  // instead of keeping them, and the next read of components() rebuilds
  // them from the states in one pass: what a table that only mirrors
  // another policy's decisions wants, since a hub (an optimizer step's
  // outputs list every parameter's tensors) costs a walk of its whole
  // component each time it leaves one. The components read are the same
  // either way (a partition of the graph). Ending the deferral rebuilds
  // them if stale, so that changes are kept from then on.
  void DeferComponents(bool defer);
  // Whether a tensor is a member of the evicted components (must be rebuilt).
  static bool NeedsRecompute(TensorState s) {
    return s == TensorState::kEvicted || s == TensorState::kFreed;
  }

 private:
  struct CandidateList {
    std::vector<CandidateEntry, HugePageAllocator<CandidateEntry>> entries;
    int64_t bytes = 0;
  };
  struct Group {  // one GPU or one session
    MemoryStats stats;
    CandidateList candidates;
    uint64_t clock = 0;  // a session's logical clock (a GPU's is unused)
  };

  absl::StatusOr<uint32_t> SlotFor(TensorId id) const;
  absl::Status ValidateSpec(const TensorSpec& spec) const;
  // A parent outside the spec's batch: in the table, of the same session,
  // not freed.
  absl::Status CheckParentInTable(const TensorSpec& spec, TensorId p) const;
  uint32_t Insert(const TensorSpec& spec, int64_t now_ns);
  void LinkParents(uint32_t slot, absl::Span<const TensorId> parents);
  void Account(const Tensor& t, int sign);
  void AddCandidate(uint32_t slot);
  void RemoveCandidate(uint32_t slot);
  // Records an access at `now_ns`, in the tensor and in its candidate
  // entries (the session's clock lives in its group: one lookup for both).
  void Stamp(uint32_t slot, int64_t now_ns);
  void ChangeState(uint32_t slot, TensorState to);
  void JoinComponents(uint32_t slot);
  void LeaveComponents(uint32_t slot);
  void RebuildComponents() const;
  bool StaleRatherThanReform(uint32_t slot) const;
  void MaybeRetire(uint32_t slot);
  void Retire(uint32_t slot);
  // Forgets the slot's id and key and makes the slot reusable.
  void ReleaseSlot(uint32_t slot);
  // Forgets the slot's id and key; the caller lists it as free.
  void ForgetSlot(uint32_t slot);
  // Drops the free slots at the end of the array: with the lowest free
  // slot reused first, the array shrinks back once a peak's tensors are
  // gone.
  void CutFreeTail();
  // Gives the kernel the pages past what the arrays and maps hold (after
  // a session's tensors left, the event that shrinks a table by the most):
  // a daemon's tables would otherwise stay at the largest size they ever
  // reached.
  void GiveBackMemory();

  std::vector<Tensor, HugePageAllocator<Tensor>> slots_;
  FreeSlots free_slots_;  // reused lowest first
  absl::flat_hash_map<TensorId, uint32_t> index_;
  absl::flat_hash_map<GpuId, Group> gpus_;
  absl::flat_hash_map<SessionId, Group> sessions_;
  // A session lives on one GPU; its first tensor binds it.
  absl::flat_hash_map<SessionId, GpuId> session_gpu_;
  absl::flat_hash_map<std::pair<SessionId, uint64_t>, uint32_t> by_key_;
  // Mutable: components() rebuilds them when stale.
  mutable EvictedComponents components_;
  mutable bool components_stale_ = false;
  // A tensor with more neighbours than this leaving the components may
  // leave them stale (StaleRatherThanReform).
  static constexpr size_t kHubNeighbours = 16;
  bool defer_components_ = false;
  uint64_t rank_epoch_ = 0;
  // LinkParents' parents already listed (a tensor of an optimizer step or a
  // concatenation has hundreds; checking each against the list was
  // quadratic in them).
  EpochMarks listed_;
};

}  // namespace deltad::policy

#endif  // DELTAD_POLICIES_TENSOR_TABLE_H_
