"""Saved activations held by reference, released only when memory is short.

Packing a tensor records it: no copy, no host wait, no call into the client
library. Tensors that share a storage (a view and its base, q, k and v split
from one projection) form one group: the storage is what occupies memory, so
it is what is counted, offloaded, evicted and restored, and every saved view
of it comes back with its own size, strides and offset.

When the resident bytes pass the budget, the oldest groups are released
first (backward needs them last), and only groups this store alone holds:
freeing memory that Python still references would free nothing, and a
tensor someone else can still write to must not be snapshotted early. A
group is

- offloaded: its storage copied to host memory, on CUDA asynchronously on a
  copy stream (the device bytes are let go once that copy's event has
  completed, found by polling, never by waiting), or
- evicted: dropped, and rebuilt when needed by running the module call that
  produced it again (deltad.recompute),

whichever the Director prefers: evict when recomputing costs no more than
moving the bytes both ways (F = c_r / c_s <= 1). Unpacking restores a
released group (reload or recompute) and hints the groups backward unpacks
next, in the order the previous iteration unpacked them.

Thread safety: one re-entrant lock guards the store's state; autograd
unpacks on its own threads and a SavedTensor may be collected anywhere.
"""

import threading
import time

import torch as _torch

from deltad._extension import load_savedcore
from deltad.saved_release import Releasing
from deltad.saved_restore import (  # noqa: F401 (_storage: theirs too)
    Restoring, _flat, _storage)

# The hot path in C (deltad/_savedcore.c): the hooks, pack, unpack and a
# member's death; the rest of the store is below. Its types:
# SavedTensor: what autograd keeps instead of a saved tensor, its group and
# its place there (the tensor, or a detached alias of it, stays in the
# group while resident).
# _Group: one storage's bytes and the saved tensors that view them, with
#   store, key, nbytes, position (pack order within the iteration),
#   first_pack (the counters' saved_tensors at the pack that made it: its
#   place among what the module call running then saved), state,
#   tensors (members; None once dead or released), origins (per member:
#   None when the member is the saved tensor itself, else weak references
#   to the saved tensor and its base, the member being a detached alias;
#   see keep_member in _savedcore_store.c), live, metas ((size,
#   stride, offset, dtype) while released), host (the host copy while
#   offloaded), flat (the restored storage, until members are rebuilt),
#   event (CUDA: the copy that fills `flat` or `host`), stream (CUDA: the
#   stream `flat` was allocated on, until members are rebuilt), call (the module
#   call that produced it, if known), dependents (evicted groups whose
#   recompute reads this), retained (keeps the bytes for dependents when
#   unused), used (unpacked: backward is reading it), rebuilt (members are
#   views of a restored storage), evicted_sources (groups this one's
#   recompute reads), versions (released: each member's version then;
#   rebuilt: each member's version less that, since views of a new storage
#   count anew, so that a change in place before the release still raises
#   in unpack).
# Counters: what the store did; ints, read without the lock.
_core = load_savedcore()
RESIDENT, OFFLOADED, EVICTED = _core.RESIDENT, _core.OFFLOADED, _core.EVICTED
SavedTensor, _Group, Counters = _core.SavedTensor, _core.Group, _core.Counters


class SavedStore(Releasing, Restoring, _core.Core):
    """The saved activations of one managed block.

    budget: the bytes saved activations may hold on the device now (an
    attribute the owner updates: read on every new storage).
    director(group) -> "offload" or "evict" (deltad.torch decides with the
    policy and the prices). recompute: the deltad.recompute.Recorder (its
    `calls` by storage address, can_rebuild, sources_of, rebuild,
    claim_pending).
    host_bytes: the most host memory offloads may use.
    """

    def __init__(self, device, budget, director, recompute, host_bytes,
                 prefetch_bytes, plan, on_iteration):
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget = budget
        self.director = director
        # Set by the owner: group, memo -> the ns bringing it back would
        # take, for the choice of victims (_release_cheapest); None:
        # oldest first.
        self.price = None
        self.recompute = recompute
        self.host_cap = host_bytes
        # What offloads hold of it: on CUDA PyTorch's pinned pool rounds
        # each request up to a power of two (CachingHostAllocator), so a
        # cap counted in exact bytes could pin up to twice as much.
        self.host_held = 0
        self.prefetch_bytes = prefetch_bytes
        self.plan = plan  # deltad.torch's per-model state: unpack order
        self.on_iteration = on_iteration  # a forward begins
        self.lock = threading.RLock()
        # Storage address -> resident group. A released group's address
        # is freed with its bytes (and soon another tensor's), so it is
        # keyed again only once restored.
        self.groups = {}
        self.alive = 0  # groups not dropped: resident or released
        self.order = []   # groups in pack order (victims from the front)
        self.by_position = []  # this iteration's groups by position
        self.unpacked = []     # positions in unpack order, this iteration
        self.released_this_iteration = False
        self.released_last_iteration = False
        # The size of the last iteration's first storage, and a budget
        # that holds if this iteration's is the same (see
        # _pack_over_budget; the owner sets it with the budget).
        self.first_nbytes_last = None
        self.budget_if_same = None
        self.budget_used = None  # the budget this iteration ran with (CUDA)
        self.closed = False
        self.copy_stream = (_torch.cuda.Stream(device) if self.cuda
                            else None)
        # CUDA: the forward thread's stream, taken as each iteration
        # begins: an offload asked for by another thread (the allocator's
        # reclaimer runs on whichever thread allocates) must wait for the
        # kernels writing the tensors, not for that thread's stream alone.
        self.compute_stream = None
        # CUDA: (event, tensor, bytes) for device bytes a copy still reads
        # or writes (see _keep_until_copied), and their sum.
        self.in_flight = []
        self.in_flight_bytes = 0
        # Set by the owner: whether PyTorch's own caching allocator serves
        # the device (not deltad's), and the most bytes copies may still
        # hold before the store waits for the oldest.
        self.pytorch_allocator = True
        self.in_flight_cap = 1 << 62
        self.prefetch_paused = False  # a prefetch ran out of memory
        # Members that died (SavedTensor.__del__, run by the garbage
        # collector at any allocation, on the thread that holds the
        # re-entrant lock) while the store was releasing or restoring:
        # handled once that work is done, not in the middle of it.
        self.busy = False
        self.dying = []

    # --- pack and unpack (the hot path)

    # pack, unpack and _member_died are Core's (C); they call these for
    # what is not the common case.

    def _pack_over_budget(self, group):
        """A new storage took the resident bytes past the budget (lock
        held)."""
        if self.budget_if_same is not None:
            # A larger budget learned from the last iteration, which holds
            # if this one is alike: its first storage of the same size.
            learned, self.budget_if_same = self.budget_if_same, None
            first = self.by_position[0].nbytes if self.by_position else None
            if first is not None and first == self.first_nbytes_last:
                self.budget = self.budget_used = learned
                if self.counters.resident_bytes <= learned:
                    return
        busy, self.busy = self.busy, True
        try:
            self._make_room(self.budget, group)
        finally:
            self._done(busy)

    def _unpack_slow(self, saved):
        """Unpacks a member of a group that is released, restored or being
        prefetched (or while something is offloaded: the first use of a
        group prefetches the next ones)."""
        group = saved.group
        self.lock.acquire()
        busy, self.busy = self.busy, True
        try:
            if self.in_flight:
                self._poll_copies()  # backward's room for prefetches
            if group.state != RESIDENT:
                start = time.perf_counter_ns()
                self._restore(group, need=True)
                self._settle(group)
                self.counters.stall_ns += time.perf_counter_ns() - start
            elif group.flat is not None:
                self._settle(group)  # prefetched
            tensor = group.tensors[saved.index]
            if not group.used:
                group.used = True
                self.unpacked.append(group.position)
                if self.counters.host_bytes:
                    self._prefetch_after(group)
        finally:
            try:
                self._done(busy)
            finally:
                self.lock.release()
        if tensor._version != saved.version:
            self._check_version(group, saved, tensor)
        return tensor

    def _kept_changed(self, tensor, version):
        """Raises as PyTorch does for a tensor the hooks handed back as it
        is (_savedcore's Kept), changed in place since it was saved."""
        raise _modified(tensor, version)

    def _check_version(self, group, saved, tensor):
        """Raises as PyTorch does if `tensor`, whose version differs from
        its SavedTensor's, was changed in place since it was saved."""
        if _changed(group, saved, tensor):
            raise _modified(tensor, saved.version)

    def _done(self, busy):
        """Ends a stretch of work begun with `busy, self.busy = self.busy,
        True` (lock held): the members that died during it die now."""
        self.busy = busy
        if not busy:
            while self.dying:
                self._member_died(*self.dying.pop())

    def holding(self):
        """(resident bytes, of them releasable now, resident storages)."""
        with self.lock:
            held = [g for g in self.groups.values() if g.state == RESIDENT]
            releasable = sum(g.nbytes for g in held if self._releasable(g))
            return self.counters.resident_bytes, releasable, len(held)

    def group_at(self, key):
        """The resident group of the storage at `key`, if any."""
        group = self.groups.get(key)
        return group if group is not None and group.state == RESIDENT \
            else None

    def adopt(self, key, call, replaces=None):
        """A recorded module call returned the storage at `key`: the group
        saved from it (by an op inside that module) can be rebuilt by it
        (in place of `replaces`, the call whose output it changed)."""
        with self.lock:
            group = self.group_at(key)
            if group is not None and group.live and (
                    group.call is None or group.call is replaces):
                group.call = call

    def storage_of(self, group):
        """The whole storage of `group`, restored if it was released: what
        a recompute reads of it as an argument."""
        with self.lock:
            if group.state != RESIDENT:
                self._restore(group, need=True)
            self._settle(group)
            if group.retained is not None:
                # A member kept for this (or the restored storage): the
                # whole storage either way.
                return _flat(group.retained, group.nbytes)
            for t in group.tensors:
                if t is not None:
                    return _flat(t, group.nbytes)
        raise RuntimeError("deltad: a recompute's argument is gone")

    # --- groups

    def _new_iteration(self):
        """No saved tensor is alive: a new forward begins."""
        self._end_iteration()
        if self.in_flight:
            self._poll_copies()
        self.unpacked = []
        self.by_position = []
        self.order = []
        self.prefetch_paused = False
        if self.cuda:
            self.compute_stream = _torch.cuda.current_stream(self.device)
        if self.on_iteration is not None:  # None once the block ended
            self.on_iteration()

    def _end_iteration(self):
        """The iteration that ended leaves its unpack order as the next
        one's prefetch plan, and whether it had to release memory."""
        if self.unpacked:
            self.plan.unpack_order = self.unpacked
            self.plan.groups = len(self.by_position)
        if self.released_this_iteration:
            self.plan.pressure = True
        self.released_last_iteration = self.released_this_iteration
        self.released_this_iteration = False
        self.first_nbytes_last = (self.by_position[0].nbytes
                                  if self.by_position else None)

    def _drop(self, group):
        if group.state is None:
            return  # dropped already
        c = self.counters
        if group.event is not None:
            # Prefetched and never read: its block may be reused only once
            # the copy into it has run.
            self._keep_until_copied(group.flat, group.nbytes, group.event)
            group.event = None
        if self.groups.get(group.key) is group:
            del self.groups[group.key]
        self.alive -= 1
        if group.state == RESIDENT:
            c.resident_bytes -= group.nbytes
        elif group.state == OFFLOADED:
            c.host_bytes -= group.nbytes
            self.host_held -= self._host_size(group)
        for source in group.evicted_sources:
            source.dependents -= 1
            if source.dependents == 0 and source.live == 0:
                self._drop(source)
        group.evicted_sources = ()
        group.tensors = []
        group.origins = []
        group.retained = group.host = group.flat = group.call = None
        group.state = None  # gone

    def close(self):
        """The block ended. Graphs saved in it can still be unpacked (the
        bytes are kept until autograd lets go of them); nothing more is
        released."""
        with self.lock:
            # _end_iteration's work, inline: a block entered every step
            # pays its exit with the caches cold, a call more costs.
            if self.unpacked:
                self.plan.unpack_order = self.unpacked
                self.plan.groups = len(self.by_position)
                self.unpacked = []
            if self.released_this_iteration:
                self.plan.pressure = True
                self.released_this_iteration = False
            self.closed = True
            if self.in_flight:
                self._poll_copies()
            if self.in_flight:
                # Nothing polls after the block, and the store may die (its
                # list with it) while these copies still run: the compute
                # stream, whose pool their memory returns to, waits for all
                # that the copy stream holds now (the list is not in queue
                # order: a dropped prefetch's copy is older), so that no
                # later work there can reuse it under a copy.
                _torch.cuda.current_stream(self.device).wait_stream(
                    self.copy_stream)
                self.in_flight = []
                self.in_flight_bytes = 0
            self.budget = 1 << 62
            # Graphs of the block may still be unpacked, restoring what
            # they need, but nothing is released or prefetched any more:
            # the store lets go of the block's lists and of its owner, so
            # that nothing but live groups keeps it.
            self.prefetch_bytes = 0
            self.order = []
            self.by_position = []
            self.director = self.on_iteration = self.price = None

    def idle(self):
        """Whether nothing of its last block is left: no saved tensor
        alive, no copy running, no member's death pending."""
        return (self.closed and not self.alive and not self.groups and
                not self.in_flight and not self.dying)

    def reopen(self, budget, prefetch_bytes, director, on_iteration,
               price=None):
        """An idle store (idle()) serves the next block: its counters
        start from 0, its lock, copy stream and hooks stay."""
        with self.lock:
            self.counters.reset()
            self.budget = budget
            self.prefetch_bytes = prefetch_bytes
            self.director = director
            self.on_iteration = on_iteration
            self.price = price
            self.released_this_iteration = False
            self.closed = False


def _changed(group, saved, tensor):
    """Whether a member whose version differs from its SavedTensor's was
    changed in place since it was saved: the versions of a rebuilt group's
    members count anew from its restore (group.versions)."""
    shift = group.versions
    if shift is None or saved.index >= len(shift):
        return True
    return tensor._version - shift[saved.index] != saved.version


def _modified(tensor, version):
    return RuntimeError(
        "one of the variables needed for gradient computation has been "
        f"modified by an inplace operation: [{tensor.type()} "
        f"{list(tensor.shape)}] is at version {tensor._version}; expected "
        f"version {version} instead (deltad keeps saved tensors by "
        "reference, as PyTorch does)")
