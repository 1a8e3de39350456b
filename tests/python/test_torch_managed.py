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
import types
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

    def test_forget_drops_what_earlier_blocks_learned(self):
        model = small_mlp()
        with deltad.torch.managed(model, socket=None, min_bytes=1,
                                  budget_bytes=1 << 20):
            model(torch.randn(128, 256)).sum().backward()
        deltad.torch.forget(model)
        # The next block starts as the first did: nothing recorded in its
        # first iteration although the last block had to release.
        with deltad.torch.managed(model, socket=None, min_bytes=1,
                                  budget_bytes=1 << 20) as manager:
            model(torch.randn(128, 256)).sum().backward()
        self.assertEqual(manager.stats().recorded_calls, 0)
        self.assertGreater(manager.stats().offloads, 0)
        deltad.torch.forget()  # the blocks given no model: nothing to raise

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


class ModelMemoryTest(unittest.TestCase):
    """Parameters are saved as they are, never stored: the block knows
    their storages, found again when they move between blocks."""

    def stored_in_a_step(self, model, x):
        with deltad.torch.managed(model, socket=None, min_bytes=1,
                                  budget_bytes=1 << 30) as manager:
            model(x).sum().backward()
        return manager.stats().saved_tensors

    def test_a_parameter_that_moved_between_blocks_is_still_a_parameter(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 8))
        x = torch.randn(4, 8)
        stored = self.stored_in_a_step(model, x)
        self.assertEqual(self.stored_in_a_step(model, x), stored)
        # What model.to() does by default: the same Parameter, new data.
        first = model[0].weight
        first.data = first.data.clone()
        self.assertEqual(self.stored_in_a_step(model, x), stored)
        # A new Parameter object in its place.
        model[0].weight = torch.nn.Parameter(first.detach().clone())
        self.assertEqual(self.stored_in_a_step(model, x), stored)
        # Another parameter than the first, moved: found by the walk that
        # a moved first one starts (model.to() moves them all).
        for p in model.parameters():
            p.data = p.data.clone()
        self.assertEqual(self.stored_in_a_step(model, x), stored)


class ErrorsTest(unittest.TestCase):

    def test_out_of_memory_in_a_block_says_what_deltad_held(self):
        model = small_mlp()
        with self.assertRaises(torch.cuda.OutOfMemoryError) as e:
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=8 << 20):
                # Kept: a graph dropped now would free what it saved.
                self.output = model(torch.randn(128, 256))
                # What PyTorch's allocator raises when it has no room.
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB")
        self.assertIsInstance(e.exception, deltad.torch.OutOfMemoryError)
        self.assertRegex(
            str(e.exception),
            r"Tried to allocate 2\.00 GiB\ndeltad: a budget of 8\.0 MiB, "
            r"8\.0 MiB of it for saved activations; they hold [\d.]+ "
            r"[KM]iB in \d+ storages, [\d.]+ [KM]?i?B of it releasable")

    def test_deltads_allocator_running_short_is_an_out_of_memory_error(self):
        # Under the global swap PyTorch raises deltad's message as a
        # RuntimeError; the block makes it an OutOfMemoryError as PyTorch's.
        model = small_mlp()
        with self.assertRaises(torch.cuda.OutOfMemoryError) as e:
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=8 << 20):
                raise RuntimeError("deltad: no room for 4096 bytes within "
                                   "the budget of 8192 bytes")
        self.assertIsInstance(e.exception, deltad.torch.OutOfMemoryError)
        self.assertIn("deltad: a budget of 8.0 MiB", str(e.exception))
        with self.assertRaisesRegex(RuntimeError, "^another$"):
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=8 << 20):
                raise RuntimeError("another")

    def test_on_cuda_out_of_memory_with_room_to_release_names_the_reserve(
            self):
        # The message of a CUDA engine whose saved activations could still
        # have been released: the temporaries outgrew the reserve.
        store = types.SimpleNamespace(
            budget=96 << 20, counters=types.SimpleNamespace(host_bytes=0),
            holding=lambda: (80 << 20, 60 << 20, 12))
        engine = types.SimpleNamespace(
            requested_budget=128 << 20, store=store, cuda=True,
            reserve=40 << 20)
        text = deltad.torch._Engine.describe_memory(engine)
        self.assertIn("60.0 MiB of it releasable", text)
        self.assertIn("more than the 40.0 MiB reserved for them", text)
        self.assertIn("reserve_bytes", text)
        store.holding = lambda: (80 << 20, 0, 12)  # nothing to release
        self.assertNotIn("reserve_bytes",
                         deltad.torch._Engine.describe_memory(engine))

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
        model = small_mlp()
        os.environ["DELTAD_DISABLE"] = "1"
        try:
            with deltad.torch.managed(model, socket=None) as manager:
                self.assertIsNone(manager)
        finally:
            del os.environ["DELTAD_DISABLE"]
        # Read anew at every block: unset, the next block is managed.
        with deltad.torch.managed(model, socket=None) as manager:
            self.assertIsNotNone(manager)

    def test_an_error_in_a_block_passes_through_and_pops_its_hooks(self):
        model = small_mlp()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: packed.append(t) or t, lambda t: t):
            with self.assertRaisesRegex(KeyError, "from the step"):
                with deltad.torch.managed(model, socket=None, min_bytes=1):
                    model(torch.randn(4, 256)).sum().backward()
                    raise KeyError("from the step")
            # The block's hooks are gone: the outer ones save this.
            y = torch.randn(3, requires_grad=True)
            (y * y).sum().backward()
        self.assertEqual(len(packed), 2)

    def test_a_block_in_use_cannot_be_entered_again_until_it_ends(self):
        model = small_mlp()
        block = deltad.torch.managed(model, socket=None, min_bytes=1)
        with block:
            with self.assertRaisesRegex(RuntimeError, "not reentrant"):
                block.__enter__()
        with block as manager:  # ended: it may serve again
            model(torch.randn(4, 256)).sum().backward()
        self.assertEqual(manager.stats().iterations, 1)

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

    def test_without_its_extension_deltad_torch_says_where_it_looked(self):
        import subprocess
        env = dict(os.environ,
                   DELTAD_CLIENT_LIBRARY="/nonexistent/libdeltad_client.so")
        r = subprocess.run([sys.executable, "-c", "import deltad.torch"],
                           env=env, capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0:
            self.skipTest("an installed _savedcore.abi3.so was found")
        self.assertIn("deltad.torch needs its extension deltad._savedcore",
                      r.stderr)
        self.assertIn("/nonexistent/_savedcore.abi3.so: no such file",
                      r.stderr)
        self.assertIn("pip install ./client/python", r.stderr)


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
        run._gpu_memory = lambda index: 80 << 30
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
