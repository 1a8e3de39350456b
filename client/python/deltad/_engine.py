"""What a deltad.torch.managed block runs on (_Engine): the store of saved
activations, the recorder for recompute and the hooks, built for one set of
settings, with the budget it gives saved activations at each iteration and
the Director's choice between offloading and evicting. deltad.torch keeps
the blocks' API; this module, their machinery."""

import weakref

import torch as _torch

from deltad import allocator as _allocator
from deltad.budget import (
    _measure_bandwidth, _next_saved_budget, warm_up_libraries)
from deltad.client import DeltadError
from deltad.recompute import Recorder
from deltad.saved import SavedStore, _storage

# Per CUDA device: how many times a block restarted its peak statistics.
# They are the device's, so a block reads them only where none restarted
# them since it did (two models trained in turn, each in its own block).
_peak_restarts = {}


def _size(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


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
        self.recorder.fixed = fixed
        self.store = SavedStore(device, budget_bytes, self._director,
                                self.recorder, host_bytes, prefetch_bytes,
                                self.plan, self._on_iteration)
        self.store.price = self._pricer()
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
                          self._director, self._on_iteration,
                          self._pricer())

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

    def _pricer(self):
        """The store's `price` under policy 'recompute' (DTR's Filter);
        None otherwise: the oldest goes first. (Where copies can run
        beside compute, as under 'auto' on a GPU, a copy's price is not
        the time it stalls the step: priced as such, the cheap rebuilds
        of fresh tensors would go before the copies of old ones, which a
        prefetch hides. Unmeasured on a GPU, so not changed there.)"""
        return self._price if self.policy == "recompute" else None

    def _price(self, group, memo):
        """The ns bringing `group` back would take: its rebuild (with the
        evicted groups that reads), or, where it cannot be rebuilt, its
        copy out and back."""
        c_s = 2e9 * group.nbytes / self.bandwidth
        if not self.recorder.can_rebuild(group):
            return c_s
        c_r = self.recorder.rebuild_cost(group, memo)
        return c_s if c_r is None else c_r

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
