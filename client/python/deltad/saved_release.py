"""The releasing half of deltad.saved's store: making room under the
budget by releasing the oldest groups the store alone holds, each
offloaded (copied to host memory, on CUDA on the copy stream, its device
bytes let go once the copy has run) or evicted (dropped, rebuilt later by
recompute), as the Director says; and giving room back to deltad's
allocator when an allocation finds none (reclaim). A mixin of
deltad.saved.SavedStore, whose state it works on (see there, and
_Group's description, for the fields)."""

import sys

import torch as _torch

from deltad._extension import load_savedcore
from deltad.saved_restore import _flat

_core = load_savedcore()
RESIDENT, OFFLOADED, EVICTED = _core.RESIDENT, _core.OFFLOADED, _core.EVICTED


# A priced release looks at this many of the oldest resident groups, and
# at as many of the others (_release_cheapest).
_CANDIDATES = 32


class Releasing:
    """SavedStore's release path (see the module's description)."""

    def _keep_until_copied(self, tensor, nbytes, event=None):
        """Keeps the device bytes of `tensor`, which a copy on the copy
        stream (up to `event`, else its end now) reads or writes, from
        being reused under it, the store letting go of them. Either way
        they are no room until the copy has run (polled): they count in
        in_flight_bytes, which prefetches leave alone, and past
        in_flight_cap the store waits for the oldest copies."""
        if event is None:
            event = _torch.cuda.Event()
            event.record(self.copy_stream)
        if self.pytorch_allocator:
            # PyTorch's caching allocator reuses the block only once the
            # copy stream has passed this point: the store keeps no
            # reference. (Short of memory, it waits for such copies only
            # to free whole cached segments, and then asks the device for
            # new ones: a block freed that way inside a segment is not
            # found in that allocation, hence the cap here too.)
            _torch.Tensor.record_stream(tensor, self.copy_stream)
            tensor = None
        elif self.closed:
            # After its block nothing polls, and the store can die with its
            # list (a prefetched group dying unread once the block ended):
            # the compute stream, whose pool the bytes return to, waits for
            # this copy instead, so no later work there reuses them under
            # it.
            _torch.cuda.current_stream(self.device).wait_event(event)
            return
        # Under deltad's allocator the store keeps the reference: PyTorch's
        # pluggable allocator drops record_stream, and a MemPool routed
        # for every thread defers such frees until routing ends.
        self.in_flight.append((event, tensor, nbytes))
        self.in_flight_bytes += nbytes
        if self.in_flight_bytes > self.in_flight_cap:
            self._poll_copies()
            while self.in_flight_bytes > self.in_flight_cap:
                self.in_flight[0][0].synchronize()
                self.counters.host_waits += 1
                self._poll_copies()

    def _poll_copies(self):
        """Lets go of device bytes whose copy has run. Copies on one
        stream finish in order: the first one still running ends it."""
        done = freed = 0
        for event, _, nbytes in self.in_flight:
            if not event.query():
                break
            done += 1
            freed += nbytes
        if done:
            del self.in_flight[:done]
            self.in_flight_bytes -= freed

    def _make_room(self, budget, protect=None, extra=0):
        """Releases the oldest groups this store alone holds until the
        resident bytes plus `extra` fit in `budget` less some slack (so
        that the next packs do not each release again)."""
        c = self.counters
        if self.in_flight:
            self._poll_copies()
        self._release_down_to(budget - budget // 16 - extra, protect)
        if c.resident_bytes + extra > budget:
            # Nothing more can be released: what is left is still in use
            # by the forward (or held outside autograd), so it occupies
            # memory whatever deltad does. The allocator has the last word.
            c.overshoots += 1

    def _release_down_to(self, target, protect=None):
        """Releases the oldest groups this store alone holds (but
        `protect`) until the resident bytes are at most `target`."""
        c = self.counters
        # Groups that the module calls running now made can be rebuilt by
        # them: said before the Director chooses (an offload otherwise).
        self.recompute.claim_pending()
        if self.price is not None:
            self._release_cheapest(target, protect)
            return
        kept = []
        released = False
        order, self.order = self.order, []
        i = 0
        try:
            while i < len(order) and c.resident_bytes > target:
                group = order[i]
                if group.state == RESIDENT:
                    if group is not protect and self._releasable(group) \
                            and self._release(group):
                        released = True
                    else:
                        kept.append(group)
                i += 1
        finally:
            # The groups not looked at stay victims, also when a release
            # raised (its group among them: it is still resident).
            kept.extend(order[i:])
            self.order = kept
        if released:
            self.released_this_iteration = True

    def _release_cheapest(self, target, protect):
        """_release_down_to where groups are priced (the owner's `price`:
        group, memo -> ns to bring it back): releases first the group
        whose price per byte and per step of staleness is least (DTR's
        choice; staleness is the distance from the end of the order,
        which is pack and restore order). A block's output, whose rebuild
        reruns the block (and the blocks before it once their outputs are
        gone too), then stays; what a cheap op made goes first. With every
        price alike this is oldest first. In a model of many layers the
        candidates are a sample, so that a release costs the same: the
        _CANDIDATES oldest resident groups and as many spread over the
        rest (DTR samples too; the oldest alone could all be groups kept
        for their price, crowding out the cheap newer ones)."""
        c = self.counters
        order, self.order = self.order, []
        n = len(order)
        memo = {}
        ranked = []
        released = False
        try:
            resident = [i for i, g in enumerate(order)
                        if g.state == RESIDENT and g is not protect]
            rest = resident[_CANDIDATES:]
            step = -(-len(rest) // _CANDIDATES) if rest else 1
            for i in resident[:_CANDIDATES] + rest[step - 1::step]:
                group = order[i]
                price = self.price(group, memo)
                ranked.append((price / (max(group.nbytes, 1) * (n - i)), i))
            ranked.sort()
            for _, i in ranked:
                if c.resident_bytes <= target:
                    break
                group = order[i]
                if self._releasable(group) and self._release(group):
                    released = True
            if c.resident_bytes > target:
                # Past the candidates: the rest, oldest first.
                for group in order:
                    if c.resident_bytes <= target:
                        break
                    if group.state == RESIDENT and group is not protect \
                            and self._releasable(group) and \
                            self._release(group):
                        released = True
        finally:
            # What stays resident stays a victim, in its order (restores
            # made meanwhile, appended to self.order, after it), also when
            # a price or a release raised.
            self.order = [g for g in order if g.state == RESIDENT] + \
                self.order
        if released:
            self.released_this_iteration = True

    def reclaim(self, nbytes):
        """Frees `nbytes` of device memory for an allocation that deltad's
        allocator could not serve within the budget (it calls this through
        deltad.allocator's reclaimers): releases the oldest groups this
        store alone holds, and waits for the copies of those offloaded, so
        that their bytes are free on return. The rest of the iteration
        saves no more than is left. Returns the bytes freed: 0 while the
        store is at work on this thread (the allocation is its own) or
        another thread holds it (an allocation must not wait on it)."""
        if not self.lock.acquire(blocking=False):
            return 0
        try:
            if self.busy or self.closed:
                return 0
            self.busy = True
            try:
                c = self.counters
                resident = c.resident_bytes
                before = resident + self.in_flight_bytes
                self._release_down_to(resident - nbytes)
                if c.resident_bytes < resident:
                    # No more for the rest of the iteration, and what it
                    # ran with is what the next one learns from.
                    cap = c.resident_bytes
                    self.budget = min(self.budget, cap)
                    self.budget_if_same = None
                    if self.budget_used is not None:
                        self.budget_used = min(self.budget_used, cap)
                if self.in_flight:
                    # Under deltad's allocator the store holds the bytes of
                    # copies still running (_keep_until_copied), all on the
                    # copy stream, though not listed in the order they
                    # were queued (a dropped prefetch's is older).
                    self.copy_stream.synchronize()
                    c.host_waits += 1
                    self.in_flight = []
                    self.in_flight_bytes = 0
                return before - c.resident_bytes - self.in_flight_bytes
            finally:
                self._done(False)
        finally:
            self.lock.release()

    def _host_size(self, group):
        """The host memory offloading `group` takes."""
        n = group.nbytes
        return 1 << (n - 1).bit_length() if self.cuda and n > 0 else n

    def _releasable(self, group):
        """Whether releasing frees the bytes: the store holds the group's
        tensors alone (Python holds no other reference to them, or to the
        base they view)."""
        if group.used or group.flat is not None or group.live == 0 or \
                group.retained is not None:
            return False
        held = {}  # id -> references from group.tensors
        for t in group.tensors:
            if t is not None:
                held[id(t)] = held.get(id(t), 0) + 1
        tensors, origins = group.tensors, group.origins
        for i in range(len(tensors)):  # (a zip's tuple would hold t too)
            t = tensors[i]
            if t is None:
                continue
            origin = origins[i]
            if origin is not None:
                # A detached alias (_savedcore's keep_member): the tensor
                # autograd saved, or its base, may still be the caller's.
                tensor, base = origin
                if tensor() is not None or (base is not None and
                                            base() is not None):
                    return False
            # The loop variable and getrefcount's argument are the others.
            if sys.getrefcount(t) > held[id(t)] + 2:
                return False
            base = t._base
            if base is not None and \
                    sys.getrefcount(base) > held.get(id(base), 0) + 2:
                return False
        return True

    def _release(self, group):
        c = self.counters
        how = self.director(group)
        if how == "offload" and \
                self.host_held + self._host_size(group) > self.host_cap:
            if not self.recompute.can_rebuild(group):
                c.host_full += 1
                return False  # kept: no host memory left for it
            how = "evict"
        members = [t for t in group.tensors if t is not None]
        # Set on the group only once its bytes are copied or it is evicted:
        # the pinned allocation below can fail, and the group then stays
        # resident as it was.
        metas = [None if t is None else
                 (t.shape, t.stride(), t.storage_offset(), t.dtype)
                 for t in group.tensors]
        # The restored members have new version counters: keep what each
        # member's version was (as its SavedTensor counts), so that a
        # member changed in place before this still raises in unpack.
        shift = group.versions
        versions = [
            None if t is None else
            t._version - (shift[i] if shift and i < len(shift) else 0)
            for i, t in enumerate(group.tensors)]
        if how == "offload":
            flat = _flat(members[0], group.nbytes)
            if self.cuda:
                current = _torch.cuda.current_stream(self.device)
                self.copy_stream.wait_stream(current)
                compute = self.compute_stream
                if compute is not None and compute != current:
                    self.copy_stream.wait_stream(compute)
                with _torch.cuda.stream(self.copy_stream):
                    host = _torch.empty(flat.shape, dtype=flat.dtype,
                                        pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                self._keep_until_copied(flat, group.nbytes)
            else:
                host = _torch.empty_like(flat)
                host.copy_(flat)
                c.host_waits += 1  # a CPU copy blocks
            group.metas, group.versions = metas, versions
            group.host = host
            group.state = OFFLOADED
            c.offloads += 1
            c.offloaded_bytes += group.nbytes
            c.host_bytes += group.nbytes
            self.host_held += self._host_size(group)
        else:
            sources = self.recompute.sources_of(group)
            group.metas, group.versions = metas, versions
            for source in sources:
                source.dependents += 1
            group.evicted_sources = sources
            group.state = EVICTED
            c.evictions += 1
        group.tensors = [None] * len(group.tensors)
        group.origins = [None] * len(group.tensors)
        c.resident_bytes -= group.nbytes
        if self.groups.get(group.key) is group:
            del self.groups[group.key]
        return True
