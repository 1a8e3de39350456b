"""What recompute needs: which module call produced a saved storage, and how
to run that call again.

Recording costs a wrapper around every module's forward (a few
microseconds per call: the RNG state, the arguments' sources, a clock), so
it runs only where a recompute may be chosen: from the iteration after one
that had to release memory (policy "auto"), or from the start with policy
"recompute". A run with a budget that nothing exceeds records nothing.

A call can be run again when each of its tensor arguments is a saved
storage (restored first if released), the output of another recorded call
(run again too, up to `max_depth` calls back), a parameter or buffer, or
small (copied when the call ran). It is run under no_grad with the RNG
state, autocast state and module buffers of the original run, so dropout
draws the same mask and BatchNorm does not count the batch twice.

Thread safety: wrappers run on the forward thread; the store reads `calls`
and calls into this module with its lock held.
"""

import itertools
import threading
import time
import weakref

import torch as _torch

from deltad.saved import EVICTED, _flat, _storage
from deltad._trace_recorder import _tensors_in
from deltad.recompute_inside import (
    Intermediate, Intermediates, _NotRecomputable, _meta, _needing_grad)


def _view(flat, meta):
    shape, stride, offset, dtype = meta
    view = flat if dtype == flat.dtype else flat.view(dtype)
    return view.as_strided(shape, stride, offset)


# Module -> the GPU time of its last run whose events were read.
_last_ns = weakref.WeakKeyDictionary()


class Call:
    """One run of a module's forward, as recompute runs it again."""

    __slots__ = ("module", "forward", "args", "kwargs", "cpu_rng",
                 "cuda_rng", "autocast", "own_ns", "events", "depth",
                 "out_meta", "out_nbytes", "out_version", "grads",
                 "kwarg_grads", "packs")

    def cost_ns(self):
        """This run's time plus that of the calls it reruns for its
        arguments: what recomputing its output costs; None while unknown
        (on CUDA the CPU runs ahead of the GPU: a call whose events have
        not completed is priced at its module's last measured run, and
        without one the Director offloads rather than take it as free)."""
        own = self.own_ns
        if own is None:  # still running: its module's last run, if any
            own = _last_ns.get(self.module)
            if own is None:
                return None
        elif self.events is not None:
            start, end = self.events
            if end.query():  # read lazily, once the GPU ran it
                own = self.own_ns = int(start.elapsed_time(end) * 1e6)
                self.events = None
                _last_ns[self.module] = own
            else:
                own = _last_ns.get(self.module)
                if own is None:
                    return None
        for v in self.sources():
            if v[0] == "call":
                cost = v[1].cost_ns()
                if cost is None:
                    return None
                own += cost
        return own

    def sources(self):
        return itertools.chain(self.args, self.kwargs.values())


if hasattr(_torch, "get_autocast_dtype"):  # 2.4 on: the old names warn
    def _autocast_state():
        return (_torch.is_autocast_enabled("cuda"),
                _torch.get_autocast_dtype("cuda"),
                _torch.is_autocast_enabled("cpu"),
                _torch.get_autocast_dtype("cpu"))
else:
    def _autocast_state():
        return (_torch.is_autocast_enabled(), _torch.get_autocast_gpu_dtype(),
                _torch.is_autocast_cpu_enabled(),
                _torch.get_autocast_cpu_dtype())


class _Recording:
    """A module's forward while its calls are recorded (Recorder.wrap), in
    the module's own table. Copied with the module (copy.deepcopy: an EMA
    copy, AveragedModel) or pickled with it (torch.save), it becomes the
    copy's own forward, unrecorded: a closure would run the original
    module's forward on the copy's calls, and could not be pickled."""

    __slots__ = ("recorder", "module", "forward")

    def __init__(self, recorder, module, forward):
        self.recorder = recorder
        self.module = module
        self.forward = forward  # the module's own, bound

    def __call__(self, *args, **kwargs):
        return self.recorder._record(self.module, self.forward, args, kwargs)

    def __deepcopy__(self, memo):
        # The copy of the module is in `memo` before its table is copied;
        # its table is still empty, so this finds its class's forward.
        copy = memo.get(id(self.module))
        return self if copy is None else getattr(copy, "forward")

    def __reduce__(self):
        # Rebuilt as getattr(module, "forward") once unpickled, before the
        # module's table is restored: its class's forward, and no deltad
        # needed to load it.
        return getattr, (self.module, "forward")


class Recorder(Intermediates):
    """Records module calls while wrapped; reruns them for the store."""

    def __init__(self, device, min_bytes, max_depth):
        self.device = device
        self.cuda = device.type == "cuda"
        self.min_bytes = min_bytes
        self.max_depth = max_depth
        self.store = None  # set by deltad.torch once the store exists
        # The storages of the model's parameters and buffers (what the
        # store's hooks hand back as they are), or None: leaves that need
        # grad and their views are taken for them (see _savedcore).
        self.fixed = None
        # Module -> {argument shapes: whether a rerun saves what the call
        # saved} (_claim_intermediates).
        self.verified = weakref.WeakKeyDictionary()
        self.local = threading.local()  # .depth, .recomputing
        self.calls = {}  # storage key -> the Call that returned it
        self.wrapped = []
        self.recorded = 0

    def reset(self):
        """Forgets the calls of a block whose saved tensors are all gone
        (and with them the modules and inputs they keep)."""
        self.calls = {}
        self.recorded = 0

    # --- wrapping

    def wrap(self, model):
        if self.wrapped:
            return
        for module in model.modules():
            own = module.__dict__.get("forward")
            if isinstance(own, _Recording) and own.recorder is not self:
                # Left by a block whose exit failed half-way: it would
                # record into that block's closed store.
                del module.__dict__["forward"]
                own = None
            if own is not None and not (
                    getattr(own, "__self__", None) is module and
                    getattr(own, "__func__", None) is type(module).forward):
                continue  # patched by the user: left as it is
            # (Its class's forward in its table: a copy of a wrapped one.)
            module.forward = _Recording(self, module, module.forward)
            self.wrapped.append(module)

    def unwrap(self):
        for module in self.wrapped:
            module.__dict__.pop("forward", None)
        self.wrapped.clear()

    def recomputing(self):
        return getattr(self.local, "recomputing", False)

    def _record(self, module, forward, args, kwargs):
        """A wrapped module's call: its forward, recorded."""
        if self.recomputing() or not _torch.is_grad_enabled():
            return forward(*args, **kwargs)
        before = [(t, t._version)
                  for t in _tensors_in((args, kwargs), [])]
        call = Call()
        # Rerun without the module's hooks: the arguments recorded are
        # those its forward pre-hooks gave, and the output the one its
        # forward hooks were given (__call__ would apply them again).
        call.forward = forward
        call.module = module
        call.args = None  # until its output or intermediates are recorded
        call.grads = None  # until its intermediates are
        call.own_ns = None  # until it returns (cost_ns then guesses)
        call.cpu_rng = _torch.get_rng_state()
        call.cuda_rng = (_torch.cuda.get_rng_state(self.device)
                         if self.cuda else None)
        call.autocast = _autocast_state()
        call.events = None
        # The store's groups so far: those it makes while the call runs
        # and that no call returns are the call's intermediates, claimed
        # as it returns or, when the store releases before that, then
        # (claim_pending).
        store = self.store
        frame = None
        if store is not None:
            # (The store's count of packs: what the call's ops save is
            # numbered from here, Intermediate.ordinal.)
            call.packs = store.counters.saved_tensors
            frame = [module, call, args, kwargs, before, store.by_position,
                     len(store.by_position)]
            pending = getattr(self.local, "pending", None)
            if pending is None:
                pending = self.local.pending = []
            pending.append(frame)
        try:
            if self.cuda:
                start = _torch.cuda.Event(enable_timing=True)
                end = _torch.cuda.Event(enable_timing=True)
                start.record()
                out = forward(*args, **kwargs)
                end.record()
                call.events = (start, end)
                call.own_ns = 0  # until the events are read
            else:
                start = time.perf_counter_ns()
                out = forward(*args, **kwargs)
                call.own_ns = time.perf_counter_ns() - start
                _last_ns[module] = call.own_ns
        finally:
            if frame is not None:
                pending.pop()
        self._produced_by(module, call, out, args, kwargs, before)
        if frame is not None:
            self._claim_intermediates(*frame, final=True)
        return out

    def _produced_by(self, module, call, out, args, kwargs, before):
        if (not isinstance(out, _torch.Tensor) or out.layout !=
                _torch.strided or out.device != self.device or
                out.numel() * out.element_size() < self.min_bytes):
            return
        # The module's own parameter or buffer, or a view of one (a
        # position table sliced to the sequence): no activation, nothing to
        # rebuild; and a finalizer on it would keep every iteration's call.
        base = out if out._base is None else out._base
        if isinstance(base, _torch.nn.Parameter) or any(
                base is b for b in module.buffers(recurse=False)):
            return
        storage = _storage(out)
        key = storage.data_ptr()
        changed = None  # the argument it changed in place and returned
        for t, version in before:
            same = _storage(t).data_ptr() == key
            if t._version != version:
                if not same:
                    return  # changed another argument in place
                changed = (t, version)
            elif same:
                return  # handed its argument back (identity, dropout off)
        producer = self.calls.get(key)
        if changed is None:
            if producer is not None and \
                    producer.out_version == out._version:
                return  # an inner module returned it: cheaper to rerun
            # None, or an inner call whose output was changed since (a
            # residual block's `out += identity; relu(out)`): this call
            # rebuilds the bytes as they are now.
            replaces = producer
        else:
            # ReLU(inplace=True) after a BatchNorm: rerunning the call that
            # made the argument, then this one on it, rebuilds the bytes.
            # Only for an argument that is its whole storage, so that the
            # rebuilt copy has the storage's layout.
            t, version = changed
            if (producer is None or producer.out_version != version or
                    t.storage_offset() != 0 or not t.is_contiguous() or
                    t.numel() * t.element_size() != storage.nbytes()):
                return
            replaces = producer
        try:
            sources = tuple(
                ("call", producer, _meta(a)) if changed is not None and
                a is changed[0] else self._source(a) for a in args)
            call.kwargs = {k: self._source(v) for k, v in kwargs.items()}
        except _NotRecomputable:
            return
        call.args = sources
        call.depth = 1 + max((v[1].depth for v in call.sources()
                              if v[0] == "call"), default=0)
        if call.depth > self.max_depth:
            return
        call.out_meta = _meta(out)
        call.out_nbytes = storage.nbytes()
        # What a rerun reproduces: the bytes as the call left them, not
        # after a later in-place op (ReLU(inplace=True) on a BatchNorm's
        # output), which bumps this.
        call.out_version = out._version
        self.calls[key] = call
        self.recorded += 1
        # A later tensor at this address is another one. `out` may be a
        # view (nn.Linear over 3-d input returns one) that dies while views
        # of the same storage live on (qkv.chunk(3)); its base lives as
        # long as the storage's views do.
        weakref.finalize(out if out._base is None else out._base, _forget,
                         self.calls, key, call)
        store = self.store
        if store is not None:
            store.adopt(key, call, replaces)

    def _source(self, value):
        if not isinstance(value, _torch.Tensor):
            # Kept by reference and read again by the rerun: only a value
            # that cannot change meanwhile. An object that holds tensors,
            # or is changed after the call (a state object, a cache, a
            # list), would rerun on what it holds then: other gradients.
            if not _immutable(value):
                raise _NotRecomputable()
            return ("value", value)
        if value.layout != _torch.strided:
            raise _NotRecomputable()
        if isinstance(value, _torch.nn.Parameter):
            return ("value", value)
        key = _storage(value).data_ptr()
        group = self.store.group_at(key) if self.store is not None else None
        if group is not None:
            return ("group", group, _meta(value))
        producer = self.calls.get(key)
        if producer is not None:
            if value._version != producer.out_version:
                # Changed in place since the producer returned it: a rerun
                # of the producer would not give this argument.
                raise _NotRecomputable()
            return ("call", producer, _meta(value))
        if value.is_leaf and value.requires_grad:
            return ("value", value)  # a parameter-like leaf
        if value.numel() * value.element_size() < self.min_bytes:
            return ("value", value.detach().clone())
        raise _NotRecomputable()

    # --- for the store

    def can_rebuild(self, group):
        call = group.call
        if call is None:
            return False
        shift = group.versions
        for i, t in enumerate(group.tensors):
            # Saved after an in-place op on the call's output (a ReLU with
            # inplace=True after the BatchNorm that produced it): rerunning
            # the call would rebuild the bytes from before that op. (The
            # members of a restored group are new views, whose versions
            # count anew: less what they were at the restore.)
            if t is None:
                continue
            version = t._version - (shift[i] if shift and i < len(shift)
                                    else 0)
            if version != call.out_version:
                return False
        stack = [call]
        while stack:
            for source in stack.pop().sources():
                if source[0] == "group" and source[1].state is None:
                    return False  # dropped: its bytes are gone
                if source[0] == "call":
                    stack.append(source[1])
        return True

    def sources_of(self, group):
        """The saved groups a rebuild of `group` reads, each once."""
        out, stack = [], [group.call]
        while stack:
            for source in stack.pop().sources():
                if source[0] == "group" and source[1] is not group and \
                        not any(source[1] is g for g in out):
                    out.append(source[1])
                elif source[0] == "call":
                    stack.append(source[1])
        return tuple(out)

    def rebuild_cost(self, group, memo):
        """The ns a rebuild of `group` takes: its call's, and the rebuilds
        of the evicted groups it reads (DTR's evicted neighbourhood);
        None while a time is unknown. `memo`: group id -> cost, for one
        choice of victims."""
        key = id(group)
        if key in memo:
            return memo[key]
        memo[key] = 0  # (a cycle adds nothing)
        cost = group.call.cost_ns()
        if cost is not None:
            for source in self.sources_of(group):
                if source.state == EVICTED and source.call is not None:
                    more = self.rebuild_cost(source, memo)
                    if more is None:
                        cost = None
                        break
                    cost += more
        memo[key] = cost
        return cost

    def rebuild(self, group):
        call = group.call
        if isinstance(call, Intermediate):
            return self._rebuild_intermediate(call)
        out = self._run(call)
        shape, stride, offset, dtype = call.out_meta
        if (tuple(out.shape) != tuple(shape) or out.stride() != stride or
                out.storage_offset() != offset or out.dtype != dtype or
                _storage(out).nbytes() != call.out_nbytes):
            raise RuntimeError(
                f"deltad: recomputing {type(call.module).__name__} gave "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}, "
                f"not {tuple(shape)} {dtype} strides {stride}; use "
                "policy='offload' for this model")
        return out

    def _run(self, call, capture=None, pack=None, alongside=None):
        # One copy per source: a module that tells self-attention by
        # `query is key` takes the same path again.
        made = {}

        def materialize(source):
            if source[0] == "value":
                return source[1]
            key = (source[0], id(source[1]), source[2])
            copy = made.get(key)
            if copy is None:
                copy = made[key] = self._materialize(source)
            return copy
        args = [materialize(s) for s in call.args]
        kwargs = {k: materialize(s) for k, s in call.kwargs.items()}
        captured = None
        if capture is not None:
            pack, captured = self._capturing(capture, alongside)
        if pack is None:
            pack = _dropped
        else:
            # Rerun to save what the call saved: its copies need grad
            # where the call's arguments did.
            _needing_grad(args, call.grads)
            _needing_grad(list(kwargs.values()),
                          [call.kwarg_grads.get(k) for k in kwargs])
        module = call.module
        buffers = [(b, b.clone()) for b in module.buffers()]
        cpu_rng = _torch.get_rng_state()
        cuda_rng = (_torch.cuda.get_rng_state(self.device)
                    if call.cuda_rng is not None else None)
        gpu_on, gpu_dtype, cpu_on, cpu_dtype = call.autocast
        # (Nested: a call's argument rebuilt by rerunning another call.)
        outer = self.recomputing()
        self.local.recomputing = True
        try:
            _torch.set_rng_state(call.cpu_rng)
            if call.cuda_rng is not None:
                _torch.cuda.set_rng_state(call.cuda_rng, self.device)
            # With grad, as the call ran: some code takes another path
            # without it (PyTorch's fast path of TransformerEncoderLayer in
            # eval(); the attention backend, and with it the dropout mask,
            # chosen by whether the inputs need grad). The rerun's graph is
            # never used: what it would save is dropped at once (no memory
            # held for it) and the output detached.
            with _torch.enable_grad(), \
                    _torch.autograd.graph.saved_tensors_hooks(
                        pack, _never_unpacked), \
                    _torch.autocast("cpu", dtype=cpu_dtype,
                                    enabled=cpu_on), \
                    _autocast_cuda(gpu_dtype, gpu_on):
                try:
                    out = call.forward(*args, **kwargs)
                except Exception:
                    if captured:  # the rerun stopped where it had saved it
                        return captured[0]
                    raise
            if captured is not None:
                return None  # never saved it: _rebuild_intermediate says so
            return out.detach() if isinstance(out, _torch.Tensor) else out
        finally:
            self.local.recomputing = outer
            _torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                _torch.cuda.set_rng_state(cuda_rng, self.device)
            with _torch.no_grad():
                for b, before in buffers:
                    b.copy_(before)

    def _materialize(self, source):
        kind = source[0]
        if kind == "value":
            return source[1]
        if kind == "call":
            flat = _flat(self._run(source[1]), source[1].out_nbytes)
        else:
            flat = self.store.storage_of(source[1])
        # A copy: the module may work in place on its argument, and the
        # saved bytes must stay as they were. With its strides: clone()
        # makes a view with gaps (a strided slice) or repeats (expand)
        # contiguous, and a kernel may then take another path; such a view
        # gets a copy of its whole storage instead.
        view = _view(flat, source[2])
        copy = view.clone()
        if copy.stride() != view.stride():
            copy = _view(flat.clone(), source[2])
        return copy


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes,
              _torch.dtype, _torch.device, _torch.layout,
              _torch.memory_format, type(Ellipsis), range)


def _immutable(value):
    if isinstance(value, _IMMUTABLE):
        return True
    # torch.Size and named tuples are tuples too.
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return False


def _dropped(tensor):
    return None


def _never_unpacked(nothing):
    raise RuntimeError("deltad: a rebuild's own graph was used for backward")


def _autocast_cuda(dtype, enabled):
    # Disabled explicitly too: autograd's threads run backward with the
    # autocast state of the thread that called backward(), so a call
    # recorded outside autocast would otherwise be rebuilt under it. (A
    # CPU-only PyTorch warns at any CUDA autocast: nothing to disable.)
    if not enabled and not _torch.cuda.is_available():
        return _NullContext()
    return _torch.autocast("cuda", dtype=dtype, enabled=enabled)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _forget(table, key, entry):
    if table.get(key) is entry:
        del table[key]
