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
from deltad.budget import (
    _HOST_DEFAULT, _SEGMENT_SLACK, _measure_bandwidth, _next_saved_budget,
    warm_up_libraries)
from deltad.client import DEFAULT_SOCKET, Client, ClientStats, DeltadError
from deltad.recompute import Recorder
from deltad.saved import SavedStore, _storage
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
# Per CUDA device: how many times a block restarted its peak statistics.
# They are the device's, so a block reads them only where none restarted
# them since it did (two models trained in turn, each in its own block).
_peak_restarts = {}


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


class _Engine:
    """What a managed block runs on: its store (deltad.saved), its
    recorder (deltad.recompute) and the hooks, built for one set of
    settings. Building them is most of what entering a block costs, so a
    block entered every step takes the one its model's last block left
    idle (_Plan.spare: nothing of that block is saved any more) when the
    settings are the same."""

    def __init__(self, settings, model, plan, device, fixed):
        (budget_bytes, min_bytes, policy, prefetch_bytes, max_depth,
         host_bytes, reserve_bytes, client, link_bytes_per_second) = settings
        self.settings = settings
        self.model = model
        self.device = device
        self.fixed = fixed
        self.cuda = device.type == "cuda"
        self.requested_budget = budget_bytes
        self.min_bytes = min_bytes
        self.policy = policy
        self.prefetch_bytes = prefetch_bytes
        self.reserve = reserve_bytes
        self.client = client
        self.iterations = 0  # over all the blocks it served
        self.peak_from = None  # iteration since whose start PyTorch's
        # peak statistics count (CUDA; see _on_iteration), and the device's
        # restart count then (_peak_restarts)
        self.peak_restart = None
        self.plan = plan
        if self.cuda:
            warm_up_libraries(device)
        self.bandwidth = link_bytes_per_second or _measure_bandwidth(
            device, budget_bytes)
        self.recorder = Recorder(device, min_bytes, max_depth)
        self.store = SavedStore(device, budget_bytes, self._director,
                                self.recorder, host_bytes, prefetch_bytes,
                                self.plan, self._on_iteration)
        if self.cuda:
            self.store.pytorch_allocator = _allocator.mode() is None
            self.store.in_flight_cap = max(reserve_bytes // 2, 1 << 20)
            if _allocator.mode() == "global" and \
                    _allocator.installed_client(device.index) is not None:
                # Release on allocation failure: an allocation of the step
                # (a temporary larger than the reserve) that the budget
                # cannot hold has the store release saved activations. Not
                # under a MemPool, whose cache would keep what it frees.
                _allocator.add_reclaimer(self.store.reclaim)
        # Weak: the store keeps the recorder for rebuilds, and a cycle
        # would leave every block's objects to the garbage collector.
        self.recorder.store = weakref.proxy(self.store)
        # The hooks: the hot path of the block, in C (deltad/_savedcore.c).
        # `fixed`: the storages of parameters and buffers, the model's
        # memory, not autograd's: saved as they are (BatchNorm saves its
        # running statistics, which it then updates in place). None when
        # the block has no model: leaves that need grad and their views are
        # taken for them. A CUDA graph being captured keeps its tensors
        # where they are: nothing of it is released.
        self.store.configure_hooks(
            cuda=self.cuda, device_index=device.index if self.cuda else -1,
            min_bytes=self.min_bytes,
            capturing=(_torch.cuda.is_current_stream_capturing
                       if self.cuda else None),
            strided=_torch.strided, fixed=fixed, storage=_storage)
        self.pack, self.unpack = self.store.hook_pack, self.store.hook_unpack

    def serves(self, settings, device, fixed):
        # (The device of a model's cached memory is the very object.)
        return (self.settings == settings and self.fixed is fixed and
                (self.device is device or self.device == device))

    def reopen(self, model):
        """Serves another block: laid aside idle (lay_aside), it stays so,
        its hooks being out of use."""
        self.model = model
        self.store.reopen(self.requested_budget, self.prefetch_bytes,
                          self._director, self._on_iteration)

    def lay_aside(self):
        """Whether it can wait for the next block of its model: only when
        idle, and then without what its block recorded, nor the model (the
        model's plan keeps it, and must not keep the model alive)."""
        if not self.store.idle():
            return False
        if self.recorder.recorded or self.recorder.calls:
            self.recorder.reset()
        self.model = None
        return True

    # --- budget and decisions

    @property
    def activation_budget(self):
        return self.store.budget

    def _on_iteration(self):
        """A forward begins: the budget saved activations get in it, and
        the recording recompute needs if the last iteration was short."""
        self.iterations += 1
        budget = self.requested_budget
        if self.client is not None:
            try:
                if self.iterations > 1 or self.plan.unpack_order:
                    # The last one's peak becomes the job's floor (streamed).
                    self.client.iteration_done()
                granted = self.client.stats().budget_bytes  # local, no RPC
            except DeltadError:
                # Closed: a block with other settings (nested in this one)
                # or close_sessions() ended the process's one session. The
                # block goes on with the budget it asked for.
                granted = 0
            if granted > 0:
                budget = min(budget, granted)
        if self.cuda:
            # Parameters, gradients, optimizer state, inputs: what the
            # caching allocator holds while no activation is saved.
            # The last iteration's peak, read at the next one's start: the
            # peak statistics restart with each iteration under a block
            # (what a caller reads of PyTorch's covers the iteration under
            # way).
            restarts = _peak_restarts.get(self.device.index, 0)
            read_peak = (self.peak_from == self.iterations - 1 and
                         self.peak_restart == restarts)
            self.peak_from = self.iterations
            self.peak_restart = _peak_restarts[self.device.index] = (
                restarts + 1)
            peak = None
            if _allocator.mode() == "global":
                # PyTorch 2.0-2.7 with deltad's allocator in place of its
                # own: memory_allocated raises there (a pluggable allocator
                # keeps no statistics); the library counts what PyTorch
                # allocated through it, and its peak.
                usage = _allocator.stats()
                others = usage.allocated_bytes
                if read_peak:
                    peak = usage.peak_allocated_bytes
                _allocator.reset_peak()
            else:
                others = _torch.cuda.memory_allocated(self.device)
                if read_peak:
                    peak = _torch.cuda.max_memory_allocated(self.device)
                _torch.cuda.reset_peak_memory_stats(self.device)
            store = self.store
            learned = _next_saved_budget(
                budget, others, self.reserve, store.budget_used, peak,
                store.released_last_iteration,
                store.in_flight_cap if store.pytorch_allocator else 0)
            first_guess = max(budget - others - self.reserve, 0)
            # More than the first guess only once this iteration shows it
            # is like the last (the same batch: see _pack_over_budget).
            budget = min(learned, first_guess)
            store.budget_if_same = learned if learned > budget else None
            store.budget_used = budget
        self.store.budget = max(budget, 0)
        if self.policy == "auto" and self.plan.pressure:
            self.recorder.wrap(self.model)

    def _director(self, group):
        """'offload' or 'evict' for a group the store releases."""
        if self.policy == "offload":
            return "offload"
        can = self.recorder.can_rebuild(group)
        if not can:
            return "offload"
        if self.policy == "recompute":
            return "evict"
        c_r = group.call.cost_ns()
        if c_r is None:
            return "offload"  # not measured yet (see Call.cost_ns)
        c_s = 2e9 * group.nbytes / self.bandwidth  # out and back, ns
        return "evict" if c_r <= c_s else "offload"

    def describe_memory(self):
        """What deltad held and could release, for an out-of-memory error."""
        held, releasable, storages = self.store.holding()
        c = self.store.counters
        text = (f"deltad: a budget of {_size(self.requested_budget)}, "
                f"{_size(self.store.budget)} of it for saved activations; "
                f"they hold {_size(held)} in {storages} storages, "
                f"{_size(releasable)} of it releasable now (the rest is "
                f"still in use by the step or referenced outside autograd), "
                f"{_size(c.host_bytes)} offloaded to host memory. ")
        if self.cuda and releasable > 0 and \
                _allocator.mode() != "global":
            # PyTorch's allocator (or a MemPool) ran short while saved
            # activations could have made room: deltad releases them ahead
            # of need only, and the step's temporaries outgrew the reserve.
            return text + (
                f"The step's temporaries needed more than the "
                f"{_size(self.reserve)} reserved for them (deltad cannot "
                f"release inside PyTorch's allocations): pass a larger "
                f"reserve_bytes, lower the batch, or raise the budget.")
        return text + ("Lower the batch, raise the budget, or use "
                       "policy='recompute'.")

    def connected(self):
        if self.client is None:
            return False
        try:
            return self.client.stats().connected
        except DeltadError:
            return False


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


def _size(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


__all__ = ["managed", "Manager", "ManagerStats", "DeltadError",
           "OutOfMemoryError", "record_trace", "disabled", "close_sessions",
           "forget"]
