"""deltad for PyTorch, in two lines:

    import deltad.torch
    with deltad.torch.managed(model, budget_bytes=2 << 30):
        loss = model(x).sum(); loss.backward()

Inside the block, autograd's saved activations (above `min_bytes`) are kept
by reference: saving one costs a few microseconds, with no copy, no host
wait and no call into the client library, and backward gets the very
tensor back. Only when they would pass the budget does deltad release some,
the oldest first, each either

- offloaded: copied to host memory (on CUDA asynchronously, on a copy
  stream, the device memory reused once the copy has run) and reloaded
  ahead of backward in the order the previous iteration used, or
- evicted: dropped, and rebuilt in backward by running the module that
  produced it again, with the random number generator's state of the
  original run (dropout draws the same mask) and the module's buffers left
  as they were (BatchNorm counts the batch once).

The Director chooses between the two from the module's measured time and
the tensor's size at the measured link bandwidth (DELTA's F = c_r / c_s);
`policy="offload"` or `"recompute"` fixes the choice. What recompute needs
is recorded only from the iteration after one that had to release memory
(deltad.recompute), so a run that fits pays nothing for it.

The budget: on the CPU, the bytes saved activations may hold; on CUDA, the
bytes the whole process may hold (the daemon's budget when one grants it):
saved activations get what parameters, gradients, optimizer state and a
reserve for temporaries leave, measured when each iteration begins. With a
daemon, a budget it lowers is followed from the next iteration on.

Set DELTAD_DISABLE=1 to run the block unmanaged without changing code.
"""

import dataclasses
import weakref

import torch as _torch

from deltad import allocator as _allocator
from deltad.allocator import disabled
from deltad._engine import _Engine
from deltad.budget import _HOST_DEFAULT, _SEGMENT_SLACK
from deltad.client import DEFAULT_SOCKET, Client, ClientStats, DeltadError
from deltad.saved import _storage
from deltad.saved_restore import _out_of_memory
from deltad.trace import record_trace  # noqa: F401 (API)

_POLICIES = ("auto", "offload", "recompute")

# What each model learned in earlier blocks: whether it had to release
# memory, and backward's unpack order.
_plans = weakref.WeakKeyDictionary()


class OutOfMemoryError(_torch.cuda.OutOfMemoryError):
    """PyTorch ran out of memory inside a managed block: its message, and
    what deltad held then."""


class _Plan:
    __slots__ = ("pressure", "unpack_order", "groups", "memory", "anchor",
                 "spare")

    def __init__(self):
        self.pressure = False
        self.unpack_order = []
        self.groups = 0
        self.memory = None  # _model_memory's answer, while `anchor` holds
        # (and whether its device is CUDA: torch.device.type costs a
        # block entered every step ~20 us with the caches cold)
        self.anchor = None  # the first parameter then (_first_parameter)
        self.spare = None  # an idle _Engine its next block may take


# The plan of blocks given no model.
_any_model_plan = _Plan()


def _memory_of(model, plan):
    """_model_memory, walked again only when the model's parameters moved
    (model.to() and the like give them new storages): a block entered
    every step would pay the walk every step. What moved is told by the
    first parameter, looked up where it was found (its module's table and
    name), not by walking the modules again."""
    if plan.memory is not None and plan.anchor is not None:
        table, name, address = plan.anchor
        first = table.get(name)
        if first is not None and first.data_ptr() == address:
            return plan.memory
    device, fixed = _model_memory(model)
    plan.memory = device, fixed, device.type == "cuda"
    plan.anchor = _first_parameter(model)
    return plan.memory


def _first_parameter(model):
    """(its module's parameter table, its name, its address) of the
    model's first parameter; None without one."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                return module._parameters, name, p.data_ptr()
    return None


@dataclasses.dataclass
class ManagerStats(ClientStats):
    """What a managed block did: deltad.ClientStats's fields, where
    `device_bytes` and `peak_device_bytes` count the saved activations
    resident on the device, and the store's own."""

    offloads: int
    reloads: int
    saved_tensors: int
    saved_storages: int
    recorded_calls: int
    host_waits: int  # synchronizes and blocking copies on the caller
    daemon_round_trips: int  # calls that waited for the daemon's answer
    iterations: int
    overshoots: int  # saves left above the budget: nothing releasable
    host_full: int  # releases refused: host memory full, no recompute


class Manager:
    """One managed block, as `managed` yields it: its stats(), and its
    engine's store, recorder, hooks and budget (read through it)."""

    def __init__(self, engine, round_trips):
        self._engine = engine
        self._iterations_before = engine.iterations
        self.round_trips = round_trips
        self._final = None

    def __getattr__(self, name):
        if name == "_engine":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self._engine, name)

    @property
    def iterations(self):
        return self._engine.iterations - self._iterations_before

    def stats(self):
        """What the block did (after the block, as it ended)."""
        if self._final is not None:
            return self._stats(*self._final)
        e = self._engine
        return self._stats(e.store.counters, e.activation_budget,
                           e.connected(), e.recorder.recorded,
                           self.iterations)

    def _stats(self, c, budget, connected, recorded, iterations):
        return ManagerStats(
            device_bytes=c.resident_bytes,
            peak_device_bytes=c.peak_resident_bytes,
            budget_bytes=budget, host_bytes=c.host_bytes,
            offloaded_bytes=c.offloaded_bytes,
            reloaded_bytes=c.reloaded_bytes, evictions=c.evictions,
            recomputes=c.recomputes, recompute_ns=c.recompute_ns,
            stall_ns=c.stall_ns, connected=connected,
            prefetches=c.prefetches, offloads=c.offloads,
            reloads=c.reloads, saved_tensors=c.saved_tensors,
            saved_storages=c.saved_groups,
            recorded_calls=recorded,
            host_waits=c.host_waits, daemon_round_trips=self.round_trips,
            iterations=iterations, overshoots=c.overshoots,
            host_full=c.host_full)

    def _close(self):
        e = self._engine
        # What stats() reports from now on, frozen as the block ends (a
        # graph of the block unpacked later still counts in the store);
        # the ManagerStats is built only when asked for: a block entered
        # every step would build one every step.
        store, recorder = e.store, e.recorder
        try:
            self._final = (store.counters.snapshot(), store.budget,
                           e.client is not None and e.connected(),
                           recorder.recorded,
                           e.iterations - self._iterations_before)
        finally:
            # Whatever failed above (a MemoryError), the model's modules
            # must not keep forwards that record into a closed store.
            try:
                if recorder.wrapped:
                    recorder.unwrap()
            finally:
                store.close()


def _model_memory(model):
    """The model's device, and the storages of its parameters and buffers
    (saved as they are), in one walk over the modules' own tables."""
    devices, fixed = set(), set()
    stack = [model]
    while stack:
        module = stack.pop()
        for table in (module._parameters, module._buffers):
            for t in table.values():
                if t is not None:
                    devices.add(t.device)
                    fixed.add(_storage(t).data_ptr())
        stack.extend(m for m in module._modules.values() if m is not None)
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
    return device, fixed


# Daemon sessions by (socket, label, budget, host bytes), opened by the
# first block that asks and kept for the process: a script that enters the
# block every step opens one session, not one per step (the daemon allows
# one per process).
_sessions = {}


def _session(socket, label, budget_bytes, host_bytes):
    """(client, round trips): the process's session for these settings."""
    key = (socket, label, budget_bytes, host_bytes)
    client = _sessions.get(key)
    if client is not None:
        return client, 0
    for other in _sessions.values():
        other.close()  # one session per process
    _sessions.clear()
    client = Client(socket=socket, budget_bytes=budget_bytes,
                    host_bytes=host_bytes, label=label,
                    device_memory_bytes=budget_bytes)
    _sessions[key] = client
    return client, 1


def close_sessions():
    """Ends the daemon sessions managed blocks opened (they otherwise last
    as long as the process)."""
    for client in _sessions.values():
        client.close()
    _sessions.clear()


def forget(model=None):
    """Drops what managed blocks learned of `model` (None: of the blocks
    given no model): whether it had to release memory, which makes its
    later blocks record module calls for recompute from their first
    iteration, backward's unpack order for prefetches, and the idle engine
    kept for its next block. For a model whose batch or budget changed for
    good, and for runs that must not inherit each other's state (a
    benchmark's). A block of it still open keeps what it has."""
    global _any_model_plan
    if model is None:
        _any_model_plan = _Plan()
    else:
        _plans.pop(model, None)


class managed:
    """Keeps the activations autograd saves inside the block within a
    budget.

    model: the nn.Module trained in the block, all on one device (CPU or
    one CUDA GPU); None for any model on `device` (default: the current
    CUDA device, else the CPU), offloading only, since recompute reruns the
    model's modules (what `python -m deltad.run` uses). budget_bytes: on
    the CPU the bytes saved activations may hold; on CUDA all the process
    may hold (asked of the daemon, whose grant lowers it). socket: the
    daemon's; None for the in-process policy only. policy: "auto" (the
    Director chooses offload or recompute per tensor), "offload" (never
    recompute) or "recompute" (evict whatever can be recomputed).
    prefetch_bytes: how far backward reloads ahead (default: a quarter of
    the budget; 0: off). max_depth: how many module calls back a recompute
    may rerun. host_bytes: host memory for offloads (default: half the
    machine's). reserve_bytes (CUDA): what temporaries and workspaces need
    beside saved activations (default: an eighth of the budget, at least
    two of PyTorch's 20 MiB segments up to half of it). client: an
    open deltad.Client for the daemon session (default: the installed
    allocator's on its GPU, else the process's session on `socket`, opened
    by the first block and kept; see close_sessions()).
    Entering it gives the Manager, whose stats() says what the block did
    (None when DELTAD_DISABLE is set). One object is one block at a time:
    it may be entered again once it ended.
    """

    # A class, not a generator wrapped by contextlib: a block entered
    # every step pays its entry and exit with the CPU's caches cold after
    # the step, where the generator's machinery alone cost ~15 us.
    __slots__ = ("_args", "_manager", "_hooks", "_plan")

    def __init__(self, model, budget_bytes=1 << 30, socket=DEFAULT_SOCKET,
                 min_bytes=64 << 10, host_bytes=0, label="pytorch",
                 client=None, policy="auto", prefetch_bytes=None,
                 max_depth=4, reserve_bytes=None,
                 link_bytes_per_second=None, device=None):
        self._args = (model, budget_bytes, socket, min_bytes, host_bytes,
                      label, client, policy, prefetch_bytes, max_depth,
                      reserve_bytes, link_bytes_per_second, device)
        self._manager = None

    def __enter__(self):
        if self._manager is not None:
            raise RuntimeError("a managed block is not reentrant: make a "
                               "new one with managed(...)")
        (model, budget_bytes, socket, min_bytes, host_bytes, label, client,
         policy, prefetch_bytes, max_depth, reserve_bytes,
         link_bytes_per_second, device) = self._args
        if model is not None and not isinstance(model, _torch.nn.Module):
            raise TypeError(
                f"managed() takes an nn.Module, got {type(model).__name__}")
        # (torch.compile's wrapper keeps the module among its submodules;
        # a hasattr would go through Module.__getattr__ and raise inside,
        # which costs a block entered every step more than the rest of
        # this check.)
        if model is not None and "_orig_mod" in model._modules:
            # torch.compile's OptimizedModule. Saved-tensor hooks and module
            # wrappers under compiled autograd have not been tried yet.
            raise NotImplementedError(
                "deltad.torch.managed does not manage a torch.compile'd "
                "model yet: pass the module before torch.compile (and run "
                "it eagerly), or set DELTAD_DISABLE=1 to run without deltad")
        if model is None and policy == "recompute":
            raise ValueError("policy='recompute' reruns the model's "
                             "modules: pass the model")
        if budget_bytes <= 0:
            raise ValueError(
                f"budget_bytes must be positive, got {budget_bytes}")
        if policy not in _POLICIES:
            raise ValueError(
                f"policy must be one of {_POLICIES}, got {policy!r}")
        if max_depth < 1:
            raise ValueError(
                f"max_depth must be at least 1, got {max_depth}")
        if disabled():
            return None
        if model is None:
            plan, fixed = _any_model_plan, None
            device = _torch.device(device) if device is not None else (
                _torch.device("cuda", _torch.cuda.current_device())
                if _torch.cuda.is_available() else _torch.device("cpu"))
            if device.type == "cuda" and device.index is None:
                device = _torch.device("cuda", _torch.cuda.current_device())
            policy = "offload"
            cuda = device.type == "cuda"
        else:
            # (setdefault would make a weakref each time)
            plan = _plans.get(model)
            if plan is None:
                plan = _plans[model] = _Plan()
            device, fixed, cuda = _memory_of(model, plan)
        round_trips = 0
        if client is None and cuda:
            client = _allocator.installed_client(device.index)
        if client is None and socket is not None:
            # The daemon session: its grant bounds the budget. Connecting is
            # the one round trip, at the process's first block; without a
            # daemon the client falls back to the budget asked for.
            client, round_trips = _session(socket, label, budget_bytes,
                                           host_bytes)
        if prefetch_bytes is None:
            prefetch_bytes = budget_bytes // 4
        if reserve_bytes is None:
            reserve_bytes = max(budget_bytes // 8, min(
                _SEGMENT_SLACK, budget_bytes // 2)) if cuda else 0
        host_bytes = host_bytes or _HOST_DEFAULT
        settings = (budget_bytes, min_bytes, policy, prefetch_bytes,
                    max_depth, host_bytes, reserve_bytes, client,
                    link_bytes_per_second)
        engine, plan.spare = plan.spare, None
        if engine is not None and engine.serves(settings, device, fixed):
            engine.reopen(model)
        else:
            engine = _Engine(settings, model, plan, device, fixed)
        manager = Manager(engine, round_trips)
        if policy == "recompute":
            manager.recorder.wrap(model)
        hooks = _torch.autograd.graph.saved_tensors_hooks(manager.pack,
                                                          manager.unpack)
        hooks.__enter__()
        self._manager, self._hooks, self._plan = manager, hooks, plan
        return manager

    def __exit__(self, exc_type, exc, tb):
        manager = self._manager
        if manager is None:
            return False  # disabled
        self._manager = None
        engine = manager._engine
        error = None
        try:
            self._hooks.__exit__(exc_type, exc, tb)
            if (_out_of_memory(exc) and
                    not isinstance(exc, OutOfMemoryError)):
                # Described before the block closes: what it held then.
                error = OutOfMemoryError(
                    f"{str(exc).strip()}\n{manager.describe_memory()}")
        finally:
            self._hooks = None
            manager._close()
            if engine.lay_aside():
                self._plan.spare = engine
            self._plan = None
        if error is not None:
            raise error from exc
        return False


__all__ = ["managed", "Manager", "ManagerStats", "DeltadError",
           "OutOfMemoryError", "record_trace", "disabled", "close_sessions",
           "forget"]
