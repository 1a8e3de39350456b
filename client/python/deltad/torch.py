"""deltad for PyTorch, in two lines:

    import deltad.torch
    with deltad.torch.managed(model, budget_bytes=2 << 30):
        loss = model(x).sum(); loss.backward()

Inside the block every activation autograd saves for backward (above
`min_bytes`) is handed to the deltad client: it lives in the client's device
memory, within the budget, and the daemon's policy (or the same policy
in-process when no daemon answers) releases it when the budget is short:

- offload: its bytes go to host memory, and backward reloads them;
- evict: its bytes are dropped, and backward recomputes them by running the
  module that produced it again, from that module's inputs, with the random
  number generator's state of the original run (so dropout draws the same
  mask) and the module's buffers (BatchNorm's running statistics) left as
  they were.

The Director chooses between the two from the measured cost of the module's
forward and the tensor's size (DELTA's F = c_r / c_s); `policy="offload"`
or `"recompute"` fixes the choice. While backward unpacks a tensor, the ones
it will unpack next (reverse order of the forward) are prefetched, up to
`prefetch_bytes`.

What can be recomputed: a tensor returned by a module's forward whose tensor
arguments are themselves managed, returned by such a module (up to
`max_depth` modules back), parameters, or small (below `min_bytes`, copied
when the module runs). Anything else, e.g. a tensor made by a functional op
between modules, is only ever offloaded.

CPU models use the client's simulated device (memory of this process in
place of the GPU's); CUDA models the GPU itself, with memory from the
daemon's chunks.
"""

import bisect
import contextlib
import ctypes
import itertools
import threading
import time
import weakref

import torch as _torch

from deltad.client import DEFAULT_SOCKET, Client, DeltadError
from deltad.trace import _tensors_in, record_trace  # record_trace: API

_POLICIES = ("auto", "offload", "recompute")
_RESOURCE_EXHAUSTED = 8


def _key(tensor, version):
    """Identifies a tensor's bytes while it lives: contiguous tensors by
    address and element count, so that a reshaped view (what matmul saves of
    a Linear's input) finds the bytes saved for its base."""
    if tensor.is_contiguous():
        return (tensor.device, tensor.data_ptr(), tensor.dtype,
                tensor.numel(), version)
    return (tensor.device, tensor.data_ptr(), tensor.dtype,
            tuple(tensor.shape), tensor.stride(), version)


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


class _CudaBytes:
    """A device address as an object torch.as_tensor can view."""

    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1",
            "data": (address, False), "version": 2}


def _bytes_at(address, nbytes, device):
    """A uint8 tensor viewing `nbytes` of client memory at `address`."""
    if device.type == "cpu":
        return _torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(
            address), dtype=_torch.uint8)
    return _torch.as_tensor(_CudaBytes(address, nbytes), device=device)


def _as_bytes(tensor):
    return tensor.reshape(-1).view(_torch.uint8)


class _Saved:
    """What autograd keeps instead of a saved tensor: the client's id for
    its bytes. The bytes are freed with the last reference to it."""

    __slots__ = ("manager", "tensor_id", "shape", "dtype", "device",
                 "nbytes", "call", "seq", "pending", "tracked",
                 "__weakref__")

    def __init__(self, manager, tensor_id, tensor, seq):
        self.manager = manager
        self.tensor_id = tensor_id
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.nbytes = _nbytes(tensor)
        self.call = None  # the module run that rebuilds it, once known
        self.seq = seq
        self.pending = None  # the tensor, until its bytes are the client's
        self.tracked = False

    def __del__(self):
        if not self.tracked:
            return
        try:
            self.manager.drop(self.tensor_id)
        except Exception:  # the client may be closed already at exit
            pass


class _SavedView:
    """A tensor saved as another shape of bytes already managed (matmul
    saves a Linear's 3-d input as a matrix)."""

    __slots__ = ("saved", "shape")

    def __init__(self, saved, shape):
        self.saved = saved
        self.shape = shape


class _Call:
    """One run of a module's forward, as recompute needs it again: the
    module, where each tensor argument comes from, the RNG state before it
    ran and its measured time. Sources: ("saved", _Saved), ("call", _Call),
    ("value", object)."""

    __slots__ = ("module", "args", "kwargs", "cpu_rng", "cuda_rng",
                 "own_ns", "events", "depth")

    def cost_ns(self):
        """This run's time plus that of the runs it rebuilds its arguments
        with: what recomputing its output costs."""
        if self.events is not None:
            start, end = self.events
            if end.query():  # until the GPU ran it, own_ns is an estimate
                self.own_ns = int(start.elapsed_time(end) * 1e6)
                self.events = None
        total = self.own_ns
        for kind, value in self.sources():
            if kind == "call":
                total += value.cost_ns()
        return total

    def sources(self):
        return itertools.chain(self.args, self.kwargs.values())

    def saved_parents(self):
        """The managed tensors it reads, through the runs it rebuilds."""
        out, stack = [], [self]
        while stack:
            for kind, value in stack.pop().sources():
                if kind == "saved":
                    out.append(value)
                elif kind == "call":
                    stack.append(value)
        return out


class Manager:
    """The hooks of one `managed` block and the client behind them."""

    def __init__(self, client, min_bytes, policy, prefetch_bytes,
                 max_depth, device, pending_limit):
        self.client = client
        self.min_bytes = min_bytes
        self.policy = policy
        self.prefetch_bytes = prefetch_bytes
        self.max_depth = max_depth
        self.device = device
        self.managed_tensors = 0
        self.recomputable_tensors = 0
        # Recomputes whose argument was rebuilt outside the budget.
        self.budget_overflows = 0
        self._ids = itertools.count(1)
        self._seqs = itertools.count()
        self._lock = threading.RLock()
        self._final_stats = None
        # Both keyed by _key, each entry dropped when its tensor dies, so
        # that a later tensor at the same address is never mistaken for it.
        self._packed = {}    # -> weakref to the _Saved holding its bytes
        self._produced = {}  # -> the _Call that returned it
        # Live _Saved in forward order, for prefetch in backward order.
        self._order_seqs = []
        self._order = {}  # seq -> weakref to _Saved
        self._local = threading.local()  # .recomputing
        self._pending_unpins = []  # CUDA: (event, id) until the copy ran
        self._pending = []  # (_Saved, key) not yet handed to the client
        self._pending_bytes = 0
        # Held by PyTorch past that, they go to the client at once (and a
        # module's output saved inside it is then not recomputable).
        self.pending_limit = pending_limit
        self._wrapped = []

    # --- module hooks

    def wrap(self, model):
        """Puts a timing wrapper around every module's forward; unwrap()
        takes them off."""
        for module in model.modules():
            if "forward" in module.__dict__:
                continue  # already wrapped (or patched by the user)
            module.forward = self._wrapper(module, module.forward)
            self._wrapped.append(module)

    def unwrap(self):
        for module in self._wrapped:
            module.__dict__.pop("forward", None)
        self._wrapped.clear()

    def _wrapper(self, module, forward):
        manager = self

        def forward_with_deltad(*args, **kwargs):
            if getattr(manager._local, "recomputing", False):
                return forward(*args, **kwargs)
            local = manager._local
            local.depth = getattr(local, "depth", 0) + 1
            try:
                out, call, before = manager._timed(forward, args, kwargs)
            finally:
                local.depth -= 1
            manager._produced_by(module, call, out, args, kwargs, before)
            manager._flush()
            return out

        return forward_with_deltad

    def _timed(self, forward, args, kwargs):
        """Runs a module's forward: its output, the _Call that can run it
        again, and the arguments' versions before it ran."""
        before = [(t, t._version) for t in _tensors_in((args, kwargs), [])]
        call = _Call()
        call.cpu_rng = _torch.get_rng_state()
        cuda = self.device.type == "cuda"
        call.cuda_rng = _torch.cuda.get_rng_state(self.device) if cuda \
            else None
        call.events = None
        if cuda:
            start = _torch.cuda.Event(enable_timing=True)
            end = _torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(*args, **kwargs)
            end.record()
            call.events = (start, end)
            # Until the GPU has run it: its output's bytes at 1 TB/s.
            call.own_ns = (_nbytes(out) // 1000
                           if isinstance(out, _torch.Tensor) else 0)
        else:
            start = time.perf_counter_ns()
            out = forward(*args, **kwargs)
            call.own_ns = time.perf_counter_ns() - start
        return out, call, before

    def _produced_by(self, module, call, out, args, kwargs, before):
        if (not isinstance(out, _torch.Tensor) or out.layout != _torch.strided
                or _nbytes(out) < self.min_bytes):
            return
        key = _key(out, out._version)
        with self._lock:
            if key in self._produced:
                return  # an inner module returned it: cheaper to rerun
        if any(_key(t, v) == key for t, v in before):
            return  # handed its argument back (an identity, dropout off)
        versions = {id(t): v for t, v in before}
        try:
            call.args = tuple(self._source(a, versions) for a in args)
            call.kwargs = {k: self._source(v, versions)
                           for k, v in kwargs.items()}
        except _NotRecomputable:
            return
        call.module = module
        call.depth = 1 + max((v.depth for k, v in call.sources()
                              if k == "call"), default=0)
        if call.depth > self.max_depth:
            return
        with self._lock:
            self._produced[key] = call
        weakref.finalize(out, self._forget, self._produced, key, call)

    def _source(self, value, versions):
        if not isinstance(value, _torch.Tensor):
            if _tensors_in(value, []):
                raise _NotRecomputable()
            return ("value", value)
        if value.layout != _torch.strided:
            raise _NotRecomputable()
        version = versions.get(id(value), value._version)
        key = _key(value, version)
        with self._lock:
            ref = self._packed.get(key)
            saved = ref() if ref is not None else None
            if saved is not None:
                return ("saved", (saved, value.shape))
            producer = self._produced.get(key)
        if producer is not None:
            return ("call", producer)
        if isinstance(value, _torch.nn.Parameter):
            return ("value", value)
        if _nbytes(value) < self.min_bytes and value._version == version:
            return ("value", value.detach().clone())
        raise _NotRecomputable()

    @staticmethod
    def _forget(table, key, entry):
        current = table.get(key)
        if current is entry:
            del table[key]

    # --- saved-tensor hooks

    def pack(self, tensor):
        nbytes = _nbytes(tensor)
        # Parameters (leaves that need grad) and their views (a Linear's
        # transposed weight) are kept anyway; small tensors are not worth a
        # call; other devices are not this client's.
        base = tensor if tensor._base is None else tensor._base
        if (nbytes == 0 or nbytes < self.min_bytes or
                tensor.device != self.device or
                (base.is_leaf and base.requires_grad) or
                tensor.layout != _torch.strided or
                getattr(self._local, "recomputing", False)):
            return tensor
        key = _key(tensor, tensor._version)
        with self._lock:
            ref = self._packed.get(key)
            saved = ref() if ref is not None else None
            if saved is not None:  # saved by another op too: one copy
                if saved.shape == tensor.shape:
                    return saved
                return _SavedView(saved, tensor.shape)
            saved = _Saved(self, next(self._ids), tensor, next(self._seqs))
            self.managed_tensors += 1
            ref = weakref.ref(saved)
            self._packed[key] = ref
            self._order_seqs.append(saved.seq)
            self._order[saved.seq] = ref
            # An op that saves its own output (ReLU does) saves it before
            # the module returns it, so before anyone knows which module
            # made it: the bytes go to the client when the module returns.
            saved.pending = tensor
            self._pending.append((saved, key))
            self._pending_bytes += nbytes
            flush = (getattr(self._local, "depth", 0) == 0 or
                     self._pending_bytes > self.pending_limit)
        weakref.finalize(tensor, self._forget, self._packed, key, ref)
        if flush:
            self._flush()
        return saved

    def _flush(self):
        """Hands the tensors saved since the last module returned to the
        client, each recomputable when a module returned it."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._pending_bytes = 0
        for saved, key in pending:
            with self._lock:
                call = self._produced.get(key)
            self._hand_over(saved, call)

    def _hand_over(self, saved, call):
        tensor, saved.pending = saved.pending, None
        recompute = None
        parents = ()
        if call is not None:
            self.recomputable_tensors += 1
            parents = [s.tensor_id for s, _ in call.saved_parents()]
            # A weak reference: the callback, which the client keeps, must
            # not keep the tensor alive.
            proxy = weakref.proxy(saved)
            recompute = (lambda _id, address, proxy=proxy:
                         self._recompute(proxy, address))
        self._settle_unpins()
        address = self._with_room(lambda: self.client.track(
            saved.tensor_id, saved.nbytes, parents=parents,
            compute_cost_ns=call.cost_ns() if call is not None else 0,
            recompute=recompute,
            offload_pinned=(self.policy == "recompute" and call is not None)))
        saved.call = call
        saved.tracked = True
        try:
            _bytes_at(address, saved.nbytes, saved.device).copy_(
                _as_bytes(tensor.contiguous()))
        finally:
            self._unpin_after_copy(saved.tensor_id)

    def unpack(self, saved):
        if isinstance(saved, _torch.Tensor):
            return saved
        if isinstance(saved, _SavedView):
            return self.unpack(saved.saved).view(saved.shape)
        if saved.pending is not None:
            self._flush()
        self._prefetch_before(saved)
        self._settle_unpins()
        # Reloaded or recomputed if it has to be.
        return self._copy_out(
            saved, self._with_room(lambda: self.client.pin(saved.tensor_id)))

    def _copy_out(self, saved, address):
        """A new tensor with the bytes of `saved`, pinned at `address`;
        unpins it once the copy ran."""
        try:
            out = _torch.empty(saved.shape, dtype=saved.dtype,
                               device=saved.device)
            _as_bytes(out).copy_(_bytes_at(address, saved.nbytes,
                                           saved.device))
        finally:
            self._unpin_after_copy(saved.tensor_id)
        return out

    # --- recompute

    def _recompute(self, saved, address):
        """The client's callback for an evicted tensor: runs its module
        again and writes the output's bytes to `address`."""
        out = self._run(saved.call)
        # The bytes, not the shape, are what was saved: matmul saves a
        # module's 3-d output as a matrix.
        if out.numel() * out.element_size() != saved.nbytes or \
                out.dtype != saved.dtype:
            raise RuntimeError(
                f"recomputing {type(saved.call.module).__name__} gave "
                f"{tuple(out.shape)} {out.dtype}, not {tuple(saved.shape)} "
                f"{saved.dtype}")
        _bytes_at(address, saved.nbytes, saved.device).copy_(_as_bytes(
            out.contiguous()))
        if saved.device.type == "cuda":
            # The client may hand these bytes to a reload's stream next.
            _torch.cuda.current_stream(saved.device).synchronize()

    def _run(self, call):
        args = [self._materialize(s) for s in call.args]
        kwargs = {k: self._materialize(s) for k, s in call.kwargs.items()}
        module = call.module
        buffers = [(b, b.clone()) for b in module.buffers()]
        cpu_rng = _torch.get_rng_state()
        cuda_rng = (_torch.cuda.get_rng_state(self.device)
                    if call.cuda_rng is not None else None)
        self._local.recomputing = True
        try:
            _torch.set_rng_state(call.cpu_rng)
            if call.cuda_rng is not None:
                _torch.cuda.set_rng_state(call.cuda_rng, self.device)
            with _torch.no_grad():
                return module(*args, **kwargs)
        finally:
            self._local.recomputing = False
            _torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                _torch.cuda.set_rng_state(cuda_rng, self.device)
            # Running it again must not count twice in BatchNorm's
            # statistics.
            with _torch.no_grad():
                for b, before in buffers:
                    b.copy_(before)

    def _materialize(self, source):
        kind, value = source
        if kind == "value":
            return value
        if kind == "call":
            return self._run(value)
        saved, shape = value
        if saved.call is not None and not self.client.resident(
                saved.tensor_id):
            # Rebuilt here, not by the client: the client would hold room
            # for it within the budget while it rebuilds its own arguments
            # in turn, and a chain of evicted tensors would then need room
            # for all of them at once.
            return self._run(saved.call).reshape(shape)
        try:
            address = self.client.pin(saved.tensor_id)
        except DeltadError as e:
            # No room to rebuild it within the budget while its descendants
            # being rebuilt hold theirs (evicted since the look above): it
            # is made here once more, outside the budget, for this use only.
            if e.code != _RESOURCE_EXHAUSTED or saved.call is None:
                raise
            self.budget_overflows += 1
            return self._run(saved.call).reshape(shape)
        # A copy: the module may work in place on its argument.
        return self._copy_out(saved, address).view(shape)

    # --- prefetch

    def _prefetch_before(self, saved):
        """Hints the tensors saved just before this one, which backward
        unpacks next, up to prefetch_bytes."""
        if self.prefetch_bytes <= 0:
            return
        ids, total, dead = [], 0, 0
        with self._lock:
            i = bisect.bisect_left(self._order_seqs, saved.seq)
            while i > 0 and total < self.prefetch_bytes:
                i -= 1
                seq = self._order_seqs[i]
                ref = self._order.get(seq)
                other = ref() if ref is not None else None
                if other is None:
                    dead += 1
                    continue
                ids.append(other.tensor_id)
                total += other.nbytes
            if dead * 2 > len(self._order_seqs):
                self._compact_order()
        self.client.prefetch(ids)

    def _compact_order(self):
        live = [s for s in self._order_seqs
                if self._order.get(s) is not None and self._order[s]()]
        self._order = {s: self._order[s] for s in live}
        self._order_seqs = live

    # --- CUDA copies

    def _unpin_after_copy(self, tensor_id):
        """Unpins once the copy queued on the compute stream ran: until
        then the client must not release (or reuse) the bytes."""
        if self.device.type != "cuda":
            self.client.unpin(tensor_id)
            return
        event = _torch.cuda.Event()
        event.record()
        self._pending_unpins.append((event, tensor_id))

    def drop(self, tensor_id):
        """Frees a saved tensor's bytes, once no copy still reads them."""
        for event, pending_id in self._pending_unpins:
            if pending_id == tensor_id:
                event.synchronize()
        self.client.free(tensor_id, forget_recompute=True)

    def _with_room(self, request):
        """Runs a track or pin; if it finds no room while copies still
        hold tensors pinned, waits for those and tries once more."""
        try:
            return request()
        except DeltadError as e:
            if e.code != _RESOURCE_EXHAUSTED or not self._pending_unpins:
                raise
        self._settle_unpins(wait=True)
        return request()

    def _settle_unpins(self, wait=False):
        keep = []
        for event, tensor_id in self._pending_unpins:
            if wait:
                event.synchronize()
            if wait or event.query():
                self.client.unpin(tensor_id)
            else:
                keep.append((event, tensor_id))
        self._pending_unpins = keep

    def stats(self):
        """The client's ClientStats; after the block, as it ended."""
        if self._final_stats is not None:
            return self._final_stats
        return self.client.stats()

    def _close(self, own_client):
        self.unwrap()
        with self._lock:
            self._pending = []  # their graph can no longer be unpacked
        self._settle_unpins(wait=True)
        self._final_stats = self.client.stats()
        if own_client:
            self.client.close()


class _NotRecomputable(Exception):
    pass


def _device_of(model):
    devices = {p.device for p in itertools.chain(model.parameters(),
                                                 model.buffers())}
    if len(devices) > 1:
        raise NotImplementedError(
            f"deltad.torch manages a model on one device; this one has "
            f"parameters on {sorted(str(d) for d in devices)}")
    device = devices.pop() if devices else _torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"deltad.torch manages CPU and CUDA models, not {device.type}")
    if device.type == "cuda" and device.index is None:
        device = _torch.device("cuda", _torch.cuda.current_device())
    return device


@contextlib.contextmanager
def managed(model, budget_bytes=1 << 30, socket=DEFAULT_SOCKET,
            min_bytes=64 << 10, host_bytes=0, label="pytorch", client=None,
            policy="auto", prefetch_bytes=None, max_depth=4):
    """Hands the activations autograd saves inside the block to deltad.

    model: the nn.Module trained in the block, all on one device (CPU or
    one CUDA GPU). budget_bytes: device memory for saved activations; asked
    of the daemon, and the budget when no daemon answers. socket: the
    daemon's; None for the in-process policy only. policy: "auto" (the
    Director chooses offload or recompute per tensor), "offload" (never
    recompute) or "recompute" (evict whatever can be recomputed).
    prefetch_bytes: how far backward reloads ahead (default: a quarter of
    the budget; 0: off). max_depth: how many modules back a recompute may
    rerun. client: an open deltad.Client to use instead of a new one (kept
    open at the end).
    Yields the Manager, whose stats() says what the client did.
    """
    if not isinstance(model, _torch.nn.Module):
        raise TypeError(
            f"managed() takes an nn.Module, got {type(model).__name__}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be at least 1, got {max_depth}")
    device = _device_of(model)
    own = client is None
    if own:
        client = Client(socket=socket, budget_bytes=budget_bytes,
                        host_bytes=host_bytes, label=label,
                        device="cuda" if device.type == "cuda" else "sim",
                        cuda_device=device.index or 0)
    if device.type == "cuda":
        client.set_compute_stream(
            _torch.cuda.current_stream(device).cuda_stream)
    if prefetch_bytes is None:
        prefetch_bytes = budget_bytes // 4
    manager = Manager(client, min_bytes, policy, prefetch_bytes, max_depth,
                      device, pending_limit=budget_bytes // 4)
    if policy != "offload":
        # The wrappers find what recompute needs; offload alone needs none
        # of it, so its modules run as they are.
        manager.wrap(model)
    try:
        with _torch.autograd.graph.saved_tensors_hooks(manager.pack,
                                                       manager.unpack):
            yield manager
    finally:
        # A graph that outlives the block (backward after it) cannot be
        # unpacked any more: its unpack raises DeltadError rather than
        # return bytes that are gone.
        manager._close(own)


__all__ = ["managed", "Manager", "DeltadError", "record_trace"]
