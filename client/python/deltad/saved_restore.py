"""The restoring half of deltad.saved's store: bringing a released group
back (reloaded from host memory or recomputed), rebuilding its members as
views of the restored storage, and prefetching the groups backward unpacks
next. A mixin of deltad.saved.SavedStore, whose state it works on (see
there, and _Group's description, for the fields)."""

import time

import torch as _torch

from deltad._extension import load_savedcore

_core = load_savedcore()
RESIDENT, OFFLOADED, EVICTED = _core.RESIDENT, _core.OFFLOADED, _core.EVICTED

# The tensor's untyped storage: PyTorch 2.x's untyped_storage, 1.13's
# _storage (its storage() builds a typed one, 15 times slower).
_storage = getattr(_torch.Tensor, "untyped_storage", None) or \
    _torch.Tensor._storage

# What PyTorch raises when its allocator (or deltad's, plugged in) has no
# room (bound here: the tests stand in for torch.cuda).
_OutOfMemory = _torch.cuda.OutOfMemoryError
# How deltad's allocator begins the message of an allocation the budget
# cannot hold (client/client_raw.cc). Under the global swap PyTorch raises
# it as a RuntimeError (it cannot raise its own OutOfMemoryError from a
# pluggable allocator: deltad_torch_malloc_or_raise).
_NO_ROOM = "deltad: no room for "


def _out_of_memory(exc):
    """Whether `exc` says an allocation found no room: PyTorch's
    OutOfMemoryError, or deltad's allocator's RuntimeError."""
    return isinstance(exc, _OutOfMemory) or (
        isinstance(exc, RuntimeError) and _NO_ROOM in str(exc))


def _flat(tensor, nbytes):
    """The whole storage under `tensor`, as a 1-d tensor of its dtype."""
    size = tensor.element_size()
    with _torch.no_grad():
        return tensor.detach().as_strided((nbytes // size,), (1,), 0)


class Restoring:
    """SavedStore's methods that bring released groups back (the lock is
    held by their callers)."""

    def _restore(self, group, need):
        """Brings a released group back (its storage in group.flat; the
        members are rebuilt by _settle)."""
        c = self.counters
        budget = self.budget
        held = c.resident_bytes + group.nbytes
        if not need and held + self.in_flight_bytes > budget:
            return False  # (bytes copies still hold are no room yet)
        if held > budget:
            self._make_room(budget, group, extra=group.nbytes)
        if group.state == OFFLOADED:
            host = group.host
            if self.cuda:
                # Allocated on the compute stream, which will read it and
                # free it: it waits for the copy's event before either.
                current = _torch.cuda.current_stream(self.device)
                flat = _torch.empty(host.shape, dtype=host.dtype,
                                    device=self.device)
                self.copy_stream.wait_stream(current)
                with _torch.cuda.stream(self.copy_stream):
                    flat.copy_(host, non_blocking=True)
                event = _torch.cuda.Event()
                event.record(self.copy_stream)
                group.event = event
                group.stream = current
            else:
                flat = _torch.empty_like(host)
                flat.copy_(host)
                c.host_waits += 1
            group.host = None
            c.host_bytes -= group.nbytes
            self.host_held -= self._host_size(group)
            c.reloads += 1
            c.reloaded_bytes += group.nbytes
            if not need:
                c.prefetches += 1
        else:
            start = time.perf_counter_ns()
            out = self.recompute.rebuild(group)
            flat = _flat(out, group.nbytes)
            c.recomputes += 1
            c.recompute_ns += time.perf_counter_ns() - start
            self._sources_read(group)
        self._now_resident(group, flat)
        return True

    def _sources_read(self, group):
        """An evicted group is back: the groups its rebuild read may go."""
        for source in group.evicted_sources:
            source.dependents -= 1
            if source.dependents == 0 and source.live == 0:
                self._drop(source)
        group.evicted_sources = ()

    def rebuilt_alongside(self, group, tensor, reserve=0):
        """A rerun for another group saved `tensor`, the bytes of evicted
        `group` (saved before it by the same call): kept where the budget
        has room beside `reserve` bytes (the other group's, restored
        next), so that backward, which reads it soon after, need not rerun
        the call again."""
        c = self.counters
        if group.state != EVICTED or group.live == 0 or \
                c.resident_bytes + reserve + group.nbytes > self.budget:
            return
        self._sources_read(group)
        self._now_resident(group, _flat(tensor, group.nbytes))

    def _now_resident(self, group, flat):
        """The common end of a restore: `flat` holds the group's bytes."""
        c = self.counters
        group.flat = flat
        group.state = RESIDENT
        # Keyed by where its bytes are now. The old address was freed when
        # the group was released and may belong to a newer tensor: under
        # the old key that tensor would be packed into this group, or taken
        # for a recompute's argument from it (wrong bytes, once a graph
        # kept with retain_graph outlives the next forward).
        if self.groups.get(group.key) is group:
            del self.groups[group.key]
        group.key = _storage(flat).data_ptr()
        self.groups[group.key] = group
        if not self.closed:
            # A victim again (the last in line: it is needed soon), so that
            # a restore that backward has not reached yet can make way.
            self.order.append(group)
        c.resident_bytes += group.nbytes
        if c.resident_bytes > c.peak_resident_bytes:
            c.peak_resident_bytes = c.resident_bytes

    def _settle(self, group):
        """Rebuilds a restored group's members as views of its storage, the
        compute stream waiting for the copy that filled it."""
        flat = group.flat
        if flat is None:
            return
        if group.event is not None:
            current = _torch.cuda.current_stream(self.device)
            current.wait_event(group.event)
            group.event = None
            if current != group.stream and self.pytorch_allocator:
                # Restored for a node of another stream (a forward pass
                # that ran parts on streams of its own): the allocator
                # must not reuse the block once freed until this stream
                # has read it. (deltad's allocator drops record_stream:
                # docs/PYTORCH.md, "Several streams".)
                _torch.Tensor.record_stream(flat, current)
            group.stream = None
        released = group.versions
        shift = [0] * len(group.metas)
        for i, meta in enumerate(group.metas):
            if meta is None:
                continue
            shape, stride, offset, dtype = meta
            view = flat if dtype == flat.dtype else flat.view(dtype)
            group.tensors[i] = view.as_strided(shape, stride, offset)
            shift[i] = group.tensors[i]._version - released[i]
        # The members are views of the store's own storage now: nobody else's.
        group.origins = [None] * len(group.tensors)
        group.versions = shift
        if group.live == 0:
            group.retained = flat  # for the dependents' recomputes only
        group.flat = None
        group.metas = None
        group.rebuilt = True

    def _prefetch_after(self, group):
        """Restores, ahead of use and within the budget, the released
        groups backward will unpack next: in the previous iteration's
        unpack order when this one has the same groups, else in reverse
        pack order. Called only while some group is offloaded."""
        if self.prefetch_bytes <= 0 or self.prefetch_paused:
            return
        plan = self.plan
        by_position = self.by_position
        if plan.unpack_order and plan.groups == len(by_position):
            # The positions the last iteration unpacked after as many as
            # this one has (none left when this one unpacked more: a graph
            # that differs, or one unpacked twice).
            order = plan.unpack_order
            upcoming = (order[j] for j in range(len(self.unpacked),
                                                len(order)))
        else:
            upcoming = range(group.position - 1, -1, -1)
        ahead = 0
        for position in upcoming:
            if ahead >= self.prefetch_bytes or position >= len(by_position):
                break
            other = by_position[position]
            if other.state is None or other.used:
                continue
            ahead += other.nbytes
            if other.state == OFFLOADED and other.live > 0:
                try:
                    if not self._restore(other, need=False):
                        break
                except RuntimeError as e:
                    if not _out_of_memory(e):
                        raise
                    # Backward's temporaries took the room: the group is
                    # as it was (offloaded), and a prefetch is optional.
                    # No more in this iteration: each such failure costs
                    # PyTorch's allocator a flush of its cache.
                    self.prefetch_paused = True
                    break
