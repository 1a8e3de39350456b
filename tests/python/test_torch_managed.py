"""deltad.torch.managed on the CPU: training under a budget well below the
unmanaged peak gives the same losses, parameters and buffers as without
deltad, whether saved activations are offloaded or evicted and recomputed,
with the in-process policy and with a daemon. (tests/python/
test_torch_correctness.py checks the cases one by one: views, in-place
updates, shared storages, double backward, AMP, ...)"""

import contextlib
import ctypes
import gc
import os
import sys
import tempfile
import unittest

import torch

import deltad
import deltad.torch
from models import CASES, small_cnn, small_mlp

# The daemon the benchmarks start too (bench/sim_daemon.py says why it
# lives there).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
from sim_daemon import SimDaemon  # noqa: E402

STEPS = 3


class _Counted:
    """A saved tensor, counted while autograd holds it: activations only
    (parameters and their views are not memory autograd adds), each
    storage once however many ops save it."""

    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor, counter):
        self.tensor = tensor
        self.counter = counter
        base = tensor if tensor._base is None else tensor._base
        self.key = None
        if not (base.is_leaf and base.requires_grad):
            self.key = base.data_ptr()
            counter.add(self.key, base.numel() * base.element_size())

    def __del__(self):
        if self.key is not None:
            self.counter.remove(self.key)


class _Counter:
    def __init__(self):
        self.live = 0
        self.peak = 0
        self.held = {}  # data_ptr -> [bytes, references]

    def add(self, key, nbytes):
        entry = self.held.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[1] += 1

    def remove(self, key):
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.held[key]


def train(case, manage=None):
    """STEPS steps of SGD from a fixed seed: (losses, parameters and
    buffers, peak bytes of saved activations held by PyTorch at once)."""
    make_model, make_input = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    inputs = [make_input() for _ in range(STEPS)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = _Counter()
    losses = []
    for x in inputs:
        optimizer.zero_grad()
        if manage is None:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: _Counted(t, counter), lambda c: c.tensor):
                loss = model(x).square().mean()
                loss.backward()
        else:
            with manage(model):
                loss = model(x).square().mean()
                loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = [p.detach().clone() for p in model.parameters()]
    state += [b.clone() for b in model.buffers()]
    return losses, state, counter.peak


def mlp_and_its_gradients():
    """small_mlp, an input and its gradients from one unmanaged step, the
    gradients zeroed again; the RNG seeded with 1, as a managed step must
    seed it before its forward (the same dropout masks)."""
    torch.manual_seed(0)
    model = small_mlp()
    x = torch.randn(128, 256)
    torch.manual_seed(1)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return model, x, expected


class ManagedTrainingTest(unittest.TestCase):

    def check_case(self, case, socket, connected=False, **options):
        """Trains `case` unmanaged and managed with 40% of its unmanaged
        peak; returns the managed steps' stats."""
        losses, state, peak = train(case)
        budget = int(peak * 0.4)
        stats = []

        def manage(model):
            return _Recording(deltad.torch.managed(
                model, budget_bytes=budget, socket=socket,
                min_bytes=4 << 10, **options), stats)

        m_losses, m_state, _ = train(case, manage)
        self.assertEqual(losses, m_losses)
        self.assertEqual(len(state), len(m_state))
        for i, (a, b) in enumerate(zip(state, m_state)):
            self.assertTrue(torch.equal(a, b), f"parameter/buffer {i}")
        # Saved tensors are held by reference: the ones the forward still
        # uses (the input, the layer running) cannot be released, so the
        # peak stays above the budget by up to that working set.
        managed_peak = max(s.peak_device_bytes for s in stats)
        self.assertLessEqual(managed_peak, peak * 0.85,
                             f"managed peak {managed_peak} of {peak}")
        self.assertGreater(sum(s.offloaded_bytes + s.evictions
                               for s in stats), 0)
        self.assertEqual(all(s.connected for s in stats), connected)
        # One session for the process, opened by the first block.
        self.assertEqual(sum(s.daemon_round_trips for s in stats),
                         1 if socket else 0)
        return stats

    def test_cnn_in_process(self):
        self.check_case("cnn", socket=None)

    def test_transformer_in_process(self):
        self.check_case("transformer", socket=None)

    def test_offloaded_tensors_are_prefetched_in_backward_order(self):
        stats = self.check_case("mlp", socket=None, policy="offload")
        self.assertGreater(sum(s.offloaded_bytes for s in stats), 0)
        self.assertEqual(sum(s.evictions for s in stats), 0)
        self.assertGreater(sum(s.prefetches for s in stats), 0)
        off = self.check_case("mlp", socket=None, policy="offload",
                              prefetch_bytes=0)
        self.assertEqual(sum(s.prefetches for s in off), 0)

    def test_evicted_tensors_are_recomputed_with_rng_and_buffers_kept(self):
        stats = self.check_case("mlp", socket=None, policy="recompute")
        self.assertGreater(sum(s.evictions for s in stats), 0)
        self.assertGreater(sum(s.recomputes for s in stats), 0)

    def test_cnn_and_transformer_recompute_what_they_can(self):
        for case in ("cnn", "transformer"):
            self.check_case(case, socket=None, policy="recompute")

    def test_every_case_with_the_daemon(self):
        for case, policy in (("cnn", "auto"), ("transformer", "auto"),
                             ("mlp", "recompute")):
            # The daemon lends a session room beyond its budget while the
            # GPU has some: a GPU whose budget (half of it) is 45% of the
            # case's peak keeps that below half of the peak too.
            gpu_bytes = int(train(case)[2] * 0.9) // (64 << 10) * (64 << 10)
            with daemon_or_skip(gpu_bytes) as socket:
                stats = self.check_case(case, socket=socket, connected=True,
                                        policy=policy)
            if policy == "recompute":
                self.assertGreater(sum(s.recomputes for s in stats), 0)

    def test_a_daemon_socket_with_no_daemon_falls_back_in_process(self):
        with tempfile.TemporaryDirectory() as d:
            self.check_case("cnn", socket=os.path.join(d, "none.sock"))

    def test_bad_arguments_are_refused(self):
        with self.assertRaises(TypeError):
            with deltad.torch.managed(object(), socket=None):
                pass
        with self.assertRaises(ValueError):
            with deltad.torch.managed(small_cnn(), budget_bytes=0,
                                      socket=None):
                pass
        with self.assertRaisesRegex(ValueError, "policy"):
            with deltad.torch.managed(small_cnn(), socket=None,
                                      policy="swap"):
                pass

    def test_the_model_is_left_as_it_was(self):
        model = small_mlp()
        with deltad.torch.managed(model, socket=None, policy="recompute"):
            self.assertIn("forward", model[0].__dict__)
        for m in model.modules():
            self.assertNotIn("forward", m.__dict__)

    def test_a_run_that_fits_records_nothing_for_recompute(self):
        model = small_mlp()
        for _ in range(2):
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=1 << 30) as manager:
                self.assertNotIn("forward", model[0].__dict__)
                model(torch.randn(8, 256)).sum().backward()
            stats = manager.stats()
            self.assertGreater(stats.saved_tensors, 0)
            self.assertEqual((stats.recorded_calls, stats.offloads,
                              stats.evictions, stats.host_waits),
                             (0, 0, 0, 0))

    def test_auto_records_calls_once_an_iteration_had_to_release(self):
        model = small_mlp()
        recorded = []
        for _ in range(2):
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=1 << 20) as manager:
                model(torch.randn(128, 256)).sum().backward()
            recorded.append(manager.stats().recorded_calls)
        self.assertEqual(recorded[0], 0)
        self.assertGreater(recorded[1], 0)

    def test_a_graph_unpacked_after_the_block_still_works(self):
        model, x, expected = mlp_and_its_gradients()
        with deltad.torch.managed(model, socket=None, min_bytes=1,
                                  budget_bytes=1 << 20) as manager:
            torch.manual_seed(1)
            loss = model(x).sum()
        self.assertGreater(manager.stats().offloads, 0)
        loss.backward()
        for a, p in zip(expected, model.parameters()):
            self.assertTrue(torch.equal(a, p.grad))


class ErrorsTest(unittest.TestCase):

    def test_out_of_memory_in_a_block_says_what_deltad_held(self):
        model = small_mlp()
        with self.assertRaises(torch.cuda.OutOfMemoryError) as e:
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=8 << 20):
                model(torch.randn(128, 256))  # saves some activations
                # What PyTorch's allocator raises when it has no room.
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB")
        self.assertIsInstance(e.exception, deltad.torch.OutOfMemoryError)
        self.assertRegex(
            str(e.exception),
            r"Tried to allocate 2\.00 GiB\ndeltad: a budget of 8\.0 MiB, "
            r"8\.0 MiB of it for saved activations; they hold [\d.]+ "
            r"[KM]iB in \d+ storages, [\d.]+ [KM]?i?B of it releasable")

    def test_a_compiled_model_is_refused_with_what_to_do(self):
        class Compiled(torch.nn.Module):  # what torch.compile returns
            def __init__(self, inner):
                super().__init__()
                self._orig_mod = inner

        with self.assertRaisesRegex(NotImplementedError,
                                    "before torch.compile"):
            with deltad.torch.managed(Compiled(small_mlp()), socket=None):
                pass

    def test_deltad_disable_leaves_the_block_unmanaged(self):
        os.environ["DELTAD_DISABLE"] = "1"
        try:
            with deltad.torch.managed(small_mlp(), socket=None) as manager:
                self.assertIsNone(manager)
        finally:
            del os.environ["DELTAD_DISABLE"]

    def test_without_a_model_parameters_stay_and_activations_offload(self):
        model, x, expected = mlp_and_its_gradients()
        with deltad.torch.managed(None, socket=None, min_bytes=1,
                                  budget_bytes=1 << 20) as manager:
            torch.manual_seed(1)
            model(x).sum().backward()
        stats = manager.stats()
        self.assertGreater(stats.offloads, 0)
        self.assertEqual((stats.evictions, stats.recorded_calls), (0, 0))
        for a, p in zip(expected, model.parameters()):
            self.assertTrue(torch.equal(a, p.grad))
        with self.assertRaisesRegex(ValueError, "pass the model"):
            with deltad.torch.managed(None, socket=None, policy="recompute"):
                pass


class ClientTest(unittest.TestCase):

    def test_a_client_that_cannot_connect_raises_and_leaves_nothing(self):
        unraisable = []
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        try:
            with self.assertRaisesRegex(deltad.DeltadError, "tpu"):
                deltad.Client(socket=None, budget_bytes=1 << 20,
                              device="tpu")
            gc.collect()
        finally:
            sys.unraisablehook = hook
        self.assertEqual(unraisable, [])

    def test_tensors_round_trip_and_report_residency(self):
        with deltad.Client(socket=None, budget_bytes=1 << 20) as c:
            address = c.track(1, 4096)
            ctypes.memset(address, 7, 4096)
            c.unpin(1)
            self.assertTrue(c.resident(1))
            self.assertFalse(c.resident(2))
            c.prefetch([1, 2])  # a hint: nothing to do, nothing fails
            self.assertEqual(ctypes.string_at(c.pin(1), 4), b"\x07" * 4)
            c.unpin(1)
            c.free(1)
            with self.assertRaises(deltad.DeltadError) as e:
                c.free(1)
            self.assertEqual(e.exception.code, 5)  # NOT_FOUND


class InplaceChangeBeforeReleaseTest(unittest.TestCase):
    """A saved tensor changed in place and then released (offloaded) must
    still raise in backward, as PyTorch does without deltad: the restored
    copy has a fresh version counter."""

    def test_a_tensor_changed_in_place_then_offloaded_still_raises(self):
        a = torch.randn(256, 256, requires_grad=True)
        with deltad.torch.managed(None, socket=None, min_bytes=1,
                                  budget_bytes=1 << 10,
                                  policy="offload") as manager:
            h = a * 2
            y = h.sin()  # saves h at version 0
            h.add_(1)    # ... which backward would then read changed
            del h
            z = (a * 3).sin()  # pushes h's storage out to host memory
            self.assertGreater(manager.stats().offloads, 0)
            with self.assertRaisesRegex(RuntimeError, "inplace operation"):
                (y.sum() + z.sum()).backward()

    def test_an_unchanged_offloaded_tensor_does_not_raise(self):
        a = torch.randn(256, 256, requires_grad=True)
        with deltad.torch.managed(None, socket=None, min_bytes=1,
                                  budget_bytes=1 << 10,
                                  policy="offload") as manager:
            h = a * 2
            y = h.sin()
            del h
            z = (a * 3).sin()
            (y.sum() + z.sum()).backward()
        self.assertGreater(manager.stats().reloads, 0)
        expected = (2 * torch.cos(a * 2) + 3 * torch.cos(a * 3)).detach()
        self.assertTrue(torch.allclose(a.grad, expected))


class _CollectingTorch:
    """torch, whose empty_like first runs the garbage collector: what any
    allocation in the store may trigger on the thread holding its lock."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def empty_like(self, *args, **kwargs):
        gc.collect()
        return self.real.empty_like(*args, **kwargs)


class CollectedWhileTheStoreWorksTest(unittest.TestCase):
    """SavedTensor.__del__ may run inside the store's own work (the garbage
    collector runs at any allocation, and the lock is re-entrant): a group
    that dies while it is being released or restored must be accounted
    once and end dropped, with the store's counters back at zero."""

    def setUp(self):
        import deltad.saved as saved
        self.saved = saved
        self.real = saved._torch
        saved._torch = _CollectingTorch(self.real)
        gc.collect()
        gc.disable()  # only the store's allocations collect

    def tearDown(self):
        gc.enable()
        self.saved._torch = self.real

    def check_empty(self, store):
        gc.collect()
        c = store.counters
        self.assertEqual((c.resident_bytes, c.host_bytes), (0, 0))
        self.assertEqual(store.groups, {})

    def test_a_group_collected_while_it_is_offloaded(self):
        a = torch.randn(256, 256, requires_grad=True)
        with deltad.torch.managed(None, socket=None, min_bytes=1 << 10,
                                  budget_bytes=1 << 10,
                                  policy="offload") as manager:
            y = (a * 2).sin()  # saves a * 2
            cycle = [y]
            cycle.append(cycle)
            del y, cycle  # the graph now lives only in a cycle
            z = (a * 3).sin()  # offloads a * 2: the collector runs there
            z.sum().backward()
            del z
        self.check_empty(manager.store)

    def test_a_group_collected_while_it_is_prefetched(self):
        a = torch.randn(256, 256, requires_grad=True)
        # min_bytes: the scalars mul saves stay out of the store.
        with deltad.torch.managed(None, socket=None, min_bytes=1 << 10,
                                  budget_bytes=1 << 30,
                                  policy="offload") as manager:
            store = manager.store
            z = (a * 3).sin()
            y = (a * 2).sin()
            store.budget = 1 << 10
            w = (a * 4).sin()  # offloads the older groups
            store.budget = 1 << 30
            cycle = [y]
            cycle.append(cycle)
            del y, cycle
            # Backward unpacks w first and prefetches the group saved just
            # before it, y's: it dies while being reloaded.
            (z.sum() + w.sum()).backward()
            self.assertGreater(store.counters.prefetches, 0)
            del z, w
        self.check_empty(manager.store)


class RestoredGroupsTest(unittest.TestCase):
    """A group restored ahead of its use (a recompute's argument, a
    prefetch) is a victim again while backward has not reached it, so that
    a restore backward needs now can make room."""

    def test_a_restored_unused_group_makes_way_for_one_needed_now(self):
        import deltad.saved as saved

        class Plan:
            pressure, unpack_order, groups = False, [], 0

        class NoRecompute:
            calls = {}

        store = saved.SavedStore(
            torch.device("cpu"), 1 << 30, lambda group: "offload",
            NoRecompute(), host_bytes=1 << 30, prefetch_bytes=0,
            plan=Plan(), on_iteration=lambda: None)

        def save(tensor):
            storage = saved._storage(tensor)
            return store.pack(tensor, storage.data_ptr(), storage)

        kib4 = 4096  # each tensor's bytes
        sa = save(torch.full((1024,), 1.0))
        sb = save(torch.full((1024,), 2.0))
        store.budget = kib4 + kib4 // 2
        sc = save(torch.full((1024,), 3.0))  # a and b offloaded
        self.assertEqual(store.counters.offloads, 2)
        store.budget = 2 * kib4 + kib4 // 2
        self.assertEqual(store.unpack(sa)[0].item(), 1.0)  # c offloaded
        store.storage_of(sb.group)  # b restored, not used yet
        self.assertEqual(store.unpack(sc)[0].item(), 3.0)
        # a is in use, so b made way for c.
        self.assertEqual(sb.group.state, saved.OFFLOADED)
        self.assertEqual(store.counters.overshoots, 0)
        self.assertLessEqual(store.counters.resident_bytes, store.budget)
        self.assertEqual(store.unpack(sb)[0].item(), 2.0)


class InplaceReluRecomputeTest(unittest.TestCase):
    """Conv, BatchNorm, ReLU(inplace=True), the torchvision pattern: the
    ReLU changes the BatchNorm's output in place, and the storage is
    rebuilt by rerunning the BatchNorm, then the ReLU on it."""

    @staticmethod
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(inplace=True)) for _ in range(4)])

    def test_relu_outputs_are_evicted_and_rebuilt_exactly(self):
        x = torch.randn(4, 8, 16, 16)
        model = self.model()
        for _ in range(2):
            model.zero_grad()
            model(x).square().mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        expected += [b.clone() for b in model.buffers()]
        model = self.model()
        for _ in range(2):
            model.zero_grad()
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=20000,
                                      policy="recompute") as manager:
                model(x).square().mean().backward()
        stats = manager.stats()
        # Conv outputs and the ReLUs' (the BatchNorms') are evicted; the
        # input and what no module returned are offloaded.
        self.assertGreater(stats.evictions, stats.offloads, stats)
        self.assertEqual(stats.evictions, stats.recomputes)
        got = [p.grad for p in model.parameters()] + list(model.buffers())
        for a, b in zip(expected, got):
            self.assertTrue(torch.equal(a, b))


class _ResidualBlock(torch.nn.Module):
    """torchvision's BasicBlock without downsampling."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(c)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResidualBlockRecomputeTest(unittest.TestCase):
    """A residual block's output, its last BatchNorm's bytes changed by
    `out += x` and an in-place ReLU, is rebuilt by rerunning the block."""

    @staticmethod
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1),
                                   *[_ResidualBlock(8) for _ in range(4)])

    def test_block_outputs_are_evicted_and_rebuilt_exactly(self):
        x = torch.randn(4, 3, 16, 16)
        model = self.model()
        for _ in range(2):
            model.zero_grad()
            model(x).square().mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        expected += [b.clone() for b in model.buffers()]
        model = self.model()
        for _ in range(2):
            model.zero_grad()
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=20000,
                                      policy="recompute") as manager:
                model(x).square().mean().backward()
        stats = manager.stats()
        # 23 evictions and 25 offloads before blocks rebuilt their
        # outputs; 50 and 16 since.
        self.assertGreater(stats.evictions, 2 * stats.offloads, stats)
        got = [p.grad for p in model.parameters()] + list(model.buffers())
        for a, b in zip(expected, got):
            self.assertTrue(torch.equal(a, b))


class NestedBlocksTest(unittest.TestCase):
    """A block with other settings inside another closes the process's
    daemon session (one per process): the outer block goes on with the
    budget it asked for instead of failing on the closed client."""

    def test_the_outer_block_survives_an_inner_one(self):
        a = torch.randn(256, 256, requires_grad=True)

        def step():
            (a * 2).sin().sum().backward()

        with tempfile.TemporaryDirectory() as d:
            socket = os.path.join(d, "none.sock")
            try:
                with deltad.torch.managed(None, socket=socket, min_bytes=1,
                                          budget_bytes=1 << 20) as outer:
                    step()
                    with deltad.torch.managed(None, socket=socket,
                                              min_bytes=1,
                                              budget_bytes=2 << 20):
                        step()
                    step()  # a new iteration of the outer block
                self.assertEqual(outer.stats().iterations, 2)
                self.assertEqual(outer.stats().budget_bytes, 1 << 20)
            finally:
                deltad.torch.close_sessions()


class CudaBudgetWithDeltadAllocatorTest(unittest.TestCase):
    """On PyTorch 2.0-2.7 deltad's allocator replaces PyTorch's
    (allocator mode "global"), and torch.cuda.memory_allocated then raises
    ("CUDAPluggableAllocator does not yet support getDeviceStats"): the
    budget of an iteration must come from the allocator's own count. (A
    stand-in for CUDA: this checks Manager._on_iteration alone.)"""

    def test_the_iteration_budget_reads_the_allocators_count(self):
        import types
        import deltad.allocator as allocator

        def no_stats(device=None):
            raise RuntimeError("CUDAPluggableAllocator does not yet "
                               "support getDeviceStats.")

        stand_in = types.SimpleNamespace(
            iterations=0, requested_budget=1 << 30, client=None,
            cuda=True, device=torch.device("cuda", 0), reserve=1 << 20,
            store=types.SimpleNamespace(budget=0), policy="offload",
            plan=types.SimpleNamespace(pressure=False))
        saved = (torch.cuda.memory_allocated, allocator.mode,
                 allocator.stats)
        torch.cuda.memory_allocated = no_stats
        allocator.mode = lambda: "global"
        allocator.stats = lambda: allocator.AllocatorStats(
            attached=True, allocated_bytes=100 << 20,
            device_bytes=100 << 20, peak_device_bytes=100 << 20,
            budget_bytes=1 << 30, blocks=1)
        try:
            deltad.torch.Manager._on_iteration(stand_in)
        finally:
            (torch.cuda.memory_allocated, allocator.mode,
             allocator.stats) = saved
        self.assertEqual(stand_in.store.budget,
                         (1 << 30) - (100 << 20) - (1 << 20))


class PendingCopiesAtCloseTest(unittest.TestCase):
    """Nothing polls the copies still running when the block ends, and the
    store may die any time after: their device memory must not go back to
    the compute stream's pool before the copy (a reload writes into it).
    The compute stream waits for the last copy instead (no host wait).
    Checked with test_saved_store_streams' stand-in torch.cuda."""

    def test_close_orders_the_compute_stream_after_pending_copies(self):
        import deltad.saved as saved
        from test_saved_store_streams import (FakeCuda, FakeTorch,
                                              NoRecompute, Plan)
        cuda = FakeCuda()
        real = saved._torch
        saved._torch = FakeTorch(cuda)
        try:
            store = saved.SavedStore(
                torch.device("cpu"), 1 << 30, lambda group: "offload",
                NoRecompute(), host_bytes=1 << 30, prefetch_bytes=1 << 30,
                plan=Plan(), on_iteration=lambda: None)
            store.cuda = True
            store.copy_stream = cuda.Stream(None)

            def save(tensor):
                storage = saved._storage(tensor)
                return store.pack(tensor, storage.data_ptr(), storage)

            sa = save(torch.arange(1024, dtype=torch.float32))
            store.budget = 1024
            sb = save(torch.ones(1024))  # offloads a: its copy runs on
            self.assertEqual(len(store.in_flight), 1)
            cuda.log.clear()
            store.close()
            self.assertEqual(store.in_flight, [],
                             "device bytes kept past the block, then freed "
                             "with no order after their copy")
            self.assertIn(("wait_event", "compute", "copy"), cuda.log)
            del sa, sb
        finally:
            saved._torch = real


class RunInstallsTheAllocatorBeforeCudaTest(unittest.TestCase):
    """python -m deltad.run with no --budget must install deltad's
    allocator before anything initializes CUDA in the process: on PyTorch
    2.0-2.7 install() refuses once it is (get_device_properties and
    current_device both initialize it). A stand-in for CUDA."""

    def test_no_cuda_initialization_before_install(self):
        import deltad.allocator as allocator
        import deltad.run as run
        state = {"initialized": False, "install": None}

        def initializing(value):
            def f(*args, **kwargs):
                state["initialized"] = True
                return value
            return f

        def install(budget_bytes=0, socket=None, **kwargs):
            state["install"] = (state["initialized"], budget_bytes)

        class Stats:
            iterations = saved_tensors = peak_device_bytes = 0
            budget_bytes = offloads = offloaded_bytes = prefetches = 0
            connected = False

        @contextlib.contextmanager
        def managed(model, **kwargs):
            yield types.SimpleNamespace(stats=Stats)

        import types
        props = types.SimpleNamespace(total_memory=80 << 30)
        names = ("is_available", "get_device_properties", "current_device")
        before = [getattr(torch.cuda, n) for n in names]
        saved = (allocator.install, deltad.torch.managed,
                 getattr(run, "_gpu_memory", None), sys.argv[:],
                 sys.path[:])
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_properties = initializing(props)
        torch.cuda.current_device = initializing(0)
        allocator.install = install
        deltad.torch.managed = managed
        # The child process that reads the GPU's memory: not run here.
        run._gpu_memory = lambda: 80 << 30
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "train.py")
            with open(script, "w") as f:
                f.write("pass\n")
            try:
                self.assertEqual(run.main(["--socket", "", script]), 0)
            finally:
                for n, f in zip(names, before):
                    setattr(torch.cuda, n, f)
                (allocator.install, deltad.torch.managed, gpu_memory,
                 sys.argv, sys.path) = saved
                if gpu_memory is None:
                    del run._gpu_memory
                else:
                    run._gpu_memory = gpu_memory
        self.assertEqual(state["install"], (False, 80 << 30))


class _Recording:
    """managed() that keeps the client's stats of the block."""

    def __init__(self, cm, stats):
        self.cm = cm
        self.stats = stats

    def __enter__(self):
        self.manager = self.cm.__enter__()
        return self.manager

    def __exit__(self, *exc):
        self.stats.append(self.manager.stats())
        return self.cm.__exit__(*exc)


@contextlib.contextmanager
def daemon_or_skip(gpu_bytes):
    """A SimDaemon of $DELTAD_BINARY with one simulated GPU of `gpu_bytes`
    (entering it returns its socket); the test is skipped when
    DELTAD_BINARY is not set. The sessions managed blocks kept open end
    before it stops (else it waits for them to drain)."""
    binary = os.environ.get("DELTAD_BINARY")
    if not binary:
        raise unittest.SkipTest("DELTAD_BINARY is not set")
    with SimDaemon(binary, gpu_bytes, prefix="deltad-python-") as socket:
        try:
            yield socket
        finally:
            deltad.torch.close_sessions()


if __name__ == "__main__":
    unittest.main()
