"""deltad.allocator where there is no GPU: DELTAD_DISABLE, the refusals
(no CUDA, a PyTorch too old, CUDA memory already held), the choice of
routing per PyTorch version on stand-ins, and the C entry points PyTorch
would call (deltad_torch_malloc / free) through ctypes on the chunk-backed
simulated device."""

import contextlib
import ctypes
import os
import sys
import threading
import time
import types
import unittest
from unittest import mock

import deltad
import deltad.allocator as allocator
from deltad.client import _library

MiB = 1 << 20


def fake_torch(version, pluggable=True, mempool=True, current_thread=True,
               initialized=False, allocated=0):
    """Just what deltad.allocator looks at of a CUDA PyTorch."""
    c = types.SimpleNamespace()
    if mempool:
        c._cuda_beginAllocateToPool = lambda *a: None
        c._cuda_endAllocateToPool = lambda *a: None
        if current_thread:
            c._cuda_beginAllocateCurrentThreadToPool = lambda *a: None
    memory = types.SimpleNamespace()
    if pluggable:
        memory.CUDAPluggableAllocator = object
    cuda = types.SimpleNamespace(
        memory=memory, is_initialized=lambda: initialized,
        memory_allocated=lambda index: allocated)
    if mempool:
        cuda.MemPool = object
    return types.SimpleNamespace(__version__=version, _C=c, cuda=cuda)


class RefusalTest(unittest.TestCase):

    def test_deltad_disable_makes_install_a_no_op(self):
        with mock.patch.dict(os.environ, {"DELTAD_DISABLE": "1"}):
            self.assertIsNone(allocator.install(budget_bytes=MiB))
        self.assertIsNone(allocator.mode())
        self.assertFalse(allocator.stats().attached)

    def test_install_without_cuda_says_what_to_do(self):
        import torch
        if torch.cuda.is_available():
            self.skipTest("a GPU is here: the refusal is for machines "
                          "without one")
        with mock.patch.dict(os.environ, {"DELTAD_DISABLE": "0"}):
            with self.assertRaises(RuntimeError) as e:
                allocator.install(socket=None, budget_bytes=MiB)
        self.assertIn("no usable GPU", str(e.exception))
        self.assertIn("DELTAD_DISABLE=1", str(e.exception))
        self.assertFalse(allocator.stats().attached)
        self.assertIsNone(allocator.mode())

    def test_a_pytorch_without_pluggable_allocators_is_too_old(self):
        with self.assertRaises(RuntimeError) as e:
            allocator._routing(fake_torch("1.13.1", pluggable=False,
                                          mempool=False))
        self.assertIn("PyTorch 2.0 or later", str(e.exception))
        self.assertIn("1.13.1", str(e.exception))

    def test_this_machines_pytorch_is_judged_without_failing_to_import(self):
        import torch
        try:
            self.assertIn(allocator._routing(torch), ("mempool", "global"))
        except RuntimeError as e:
            self.assertIn("PyTorch 2.0 or later", str(e))

    def test_memory_already_held_by_pytorch_is_refused_with_the_amount(self):
        torch = fake_torch("2.9.0", initialized=True, allocated=12345)
        with self.assertRaises(RuntimeError) as e:
            allocator._check_unused(torch, 0, "mempool")
        self.assertIn("12345 bytes on cuda:0", str(e.exception))
        # Initialized with nothing held: fine for a pool.
        allocator._check_unused(fake_torch("2.9.0", initialized=True), 0,
                                "mempool")

    def test_a_global_swap_after_cuda_started_is_refused(self):
        torch = fake_torch("2.4.0", mempool=False, initialized=True)
        with self.assertRaises(RuntimeError) as e:
            allocator._check_unused(torch, 0, "global")
        self.assertIn("before any .cuda()", str(e.exception))

    def test_the_global_swap_finds_its_device_without_starting_cuda(self):
        # PyTorch 2.0-2.7: asking for the current device starts CUDA, after
        # which the allocator can no longer be swapped.
        def current_device():
            raise AssertionError("CUDA started before the swap")
        torch = fake_torch("2.4.0", mempool=False)
        torch.cuda.current_device = current_device
        torch.device = lambda d: types.SimpleNamespace(
            type=d.split(":")[0], index=None)
        self.assertEqual(allocator._device_index(torch, None, "global"), 0)
        self.assertEqual(allocator._device_index(torch, "cuda", "global"), 0)
        self.assertEqual(allocator._device_index(torch, 3, "global"), 3)
        # Once it is up, and for a pool, PyTorch says which it is.
        torch.cuda.current_device = lambda: 1
        self.assertEqual(allocator._device_index(torch, None, "mempool"), 1)


class MemPoolInstallTest(unittest.TestCase):
    """install() on a PyTorch with pools (a stand-in), served by a client
    on the chunk-backed simulated device."""

    def setUp(self):
        self.client = deltad.Client(socket=None, budget_bytes=8 * MiB,
                                    device="sim-chunks",
                                    device_memory_bytes=64 * MiB)
        torch = fake_torch("2.9.0")
        torch.cuda.is_available = lambda: True
        current = [0]
        made_on = []

        @contextlib.contextmanager
        def device(index):
            before, current[0] = current[0], index
            try:
                yield
            finally:
                current[0] = before

        class MemPool:
            def __init__(self, allocator_handle):
                made_on.append(current[0])
                self.id = (1, len(made_on))

        class Pluggable:
            def __init__(self, *args):
                pass

            def allocator(self):
                return None

        class CUDAGraph:
            def capture_begin(self, *args, **kwargs):
                return "captured"

        torch.cuda.CUDAGraph = CUDAGraph
        torch.cuda.device = device
        torch.cuda.MemPool = MemPool
        torch.cuda.memory.CUDAPluggableAllocator = Pluggable
        self.routed = []
        torch._C._cuda_beginAllocateToPool = (
            lambda index, pool: self.routed.append(index))
        self.torch = torch
        self.made_on = made_on

    def tearDown(self):
        with mock.patch.dict(sys.modules, {"torch": self.torch}):
            allocator.uninstall()
        self.client.close()

    def install(self, device, env=None):
        with mock.patch.dict(sys.modules, {"torch": self.torch}), \
                mock.patch.dict(os.environ, env or {}):
            return allocator.install(client=self.client, device=device,
                                     routing="mempool")

    def test_the_pool_is_made_on_the_device_it_serves(self):
        # CUDA's current device is 0: a pool made there and routed for
        # device 1 would leave device 1 to a pool of its own over
        # cudaMalloc, outside the budget.
        self.install(1)
        self.assertEqual(self.made_on, [1])
        self.assertEqual(self.routed, [1])
        self.assertEqual(allocator.mode(), "mempool")

    def test_expandable_segments_are_refused_with_what_to_do(self):
        with self.assertRaises(RuntimeError) as e:
            self.install(0, {"PYTORCH_CUDA_ALLOC_CONF":
                             "max_split_size_mb:128,expandable_segments:True"})
        self.assertIn("expandable_segments", str(e.exception))
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", str(e.exception))
        self.assertIsNone(allocator.mode())
        self.assertFalse(allocator.stats().attached)
        # Turned off, it is no obstacle.
        self.install(0, {"PYTORCH_CUDA_ALLOC_CONF":
                         "expandable_segments:False"})
        self.assertEqual(allocator.mode(), "mempool")

    def test_expandable_segments_under_the_newer_name_are_refused(self):
        with self.assertRaises(RuntimeError) as e:
            self.install(0, {"PYTORCH_ALLOC_CONF":
                             "expandable_segments:True"})
        self.assertIn("PYTORCH_ALLOC_CONF asks for expandable_segments",
                      str(e.exception))
        self.assertIsNone(allocator.mode())

    def test_a_cuda_graph_capture_is_refused_while_installed(self):
        # Its allocations would land in deltad's pool and be reused under
        # its replays.
        self.install(0)
        with self.assertRaises(RuntimeError) as e:
            self.torch.cuda.CUDAGraph().capture_begin()
        self.assertIn("not supported while deltad's allocator",
                      str(e.exception))
        with mock.patch.dict(sys.modules, {"torch": self.torch}):
            allocator.uninstall()
        self.assertEqual(self.torch.cuda.CUDAGraph().capture_begin(),
                         "captured")

    def test_the_routing_ends_when_the_interpreter_exits(self):
        ended = []
        self.torch._C._cuda_endAllocateToPool = (
            lambda index, pool: ended.append(index))
        self.install(0)
        # What atexit calls: some releases' MemPool destructor asserts that
        # nothing routes to the pool any more.
        with mock.patch.dict(sys.modules, {"torch": self.torch}):
            allocator._uninstall_at_exit()
        self.assertEqual(ended, [0])
        self.assertIsNone(allocator.mode())


class RoutingTest(unittest.TestCase):

    def test_a_pool_for_every_thread_from_pytorch_2_8(self):
        self.assertEqual(allocator._routing(fake_torch("2.8.0")), "mempool")

    def test_the_global_swap_before_2_8_even_with_mem_pools(self):
        # 2.5 to 2.7 have MemPool, but the pool's allocator served only
        # the thread that entered it: backward would escape the budget.
        self.assertEqual(
            allocator._routing(fake_torch("2.6.0", current_thread=False)),
            "global")
        self.assertEqual(
            allocator._routing(fake_torch("2.1.0", mempool=False)),
            "global")


class AskedRoutingTest(unittest.TestCase):
    """DELTAD_ALLOCATOR_ROUTING (or install(routing=)) picks the global
    swap where a pool would serve, and is refused where it cannot be."""

    def test_the_global_swap_can_be_asked_for_on_pytorch_2_8(self):
        torch = fake_torch("2.9.0")
        self.assertEqual(allocator._routing(torch, "global"), "global")
        with mock.patch.dict(os.environ,
                             {"DELTAD_ALLOCATOR_ROUTING": "global"}):
            self.assertEqual(allocator._routing(torch), "global")
        with mock.patch.dict(os.environ, {"DELTAD_ALLOCATOR_ROUTING": ""}):
            self.assertEqual(allocator._routing(torch), "mempool")

    def test_a_pool_cannot_be_asked_for_before_2_8_nor_an_unknown_routing(
            self):
        with self.assertRaises(RuntimeError) as e:
            allocator._routing(fake_torch("2.4.0", mempool=False), "mempool")
        self.assertIn("needs PyTorch 2.8", str(e.exception))
        with self.assertRaises(ValueError) as e:
            allocator._routing(fake_torch("2.9.0"), "pool")
        self.assertIn("'mempool' or 'global', not 'pool'", str(e.exception))


class EntryPointsTest(unittest.TestCase):
    """The functions PyTorch calls, on a client whose device memory is
    memfd chunks (the path a GPU's memory takes)."""

    def setUp(self):
        self.lib = _library()
        self.client = deltad.Client(socket=None, budget_bytes=8 * MiB,
                                    device="sim-chunks",
                                    device_memory_bytes=64 * MiB)
        rc = self.lib.deltad_allocator_attach(self.client._handle)
        self.assertEqual(rc, 0, self.lib.deltad_last_error())

    def tearDown(self):
        self.lib.deltad_allocator_detach()
        self.client.close()

    def malloc(self, size, device=0):
        return self.lib.deltad_torch_malloc(size, device, None)

    def free(self, address, size, device=0):
        self.lib.deltad_torch_free(address, size, device, None)

    def test_malloc_serves_writable_memory_counted_in_the_stats(self):
        p = self.malloc(MiB)
        self.assertIsNotNone(p, self.lib.deltad_last_error())
        self.assertEqual(p % 256, 0)
        ctypes.memset(p, 0xab, MiB)
        self.assertEqual(ctypes.string_at(p + MiB - 4, 4), b"\xab" * 4)
        s = allocator.stats()
        self.assertTrue(s.attached)
        self.assertEqual(s.allocated_bytes, MiB)
        self.assertEqual(s.budget_bytes, 8 * MiB)
        self.assertEqual(s.blocks, 1)
        self.free(p, MiB)
        s = allocator.stats()
        self.assertEqual(s.allocated_bytes, 0)
        self.assertEqual(s.blocks, 0)
        self.assertEqual(s.peak_device_bytes, MiB)

    def test_past_the_budget_malloc_returns_null_and_the_error_says_why(self):
        held = [self.malloc(2 * MiB) for _ in range(4)]
        self.assertNotIn(None, held)
        self.assertIsNone(self.malloc(2 * MiB))
        error = self.lib.deltad_last_error().decode()
        self.assertIn("budget of 8388608", error)
        self.assertIn("8388608 held", error)
        self.free(held.pop(), 2 * MiB)
        p = self.malloc(2 * MiB)
        self.assertIsNotNone(p, self.lib.deltad_last_error())
        for q in held + [p]:
            self.free(q, 2 * MiB)
        self.assertEqual(allocator.stats().allocated_bytes, 0)

    def test_under_a_mempool_reclaimers_are_refused_and_never_called(self):
        class Holder:
            calls = 0

            def reclaim(self, nbytes):
                Holder.calls += 1
                return 0

        holder, other = Holder(), Holder()
        allocator.add_reclaimer(holder.reclaim)
        held = [self.malloc(2 * MiB) for _ in range(4)]
        try:
            pool = types.SimpleNamespace(mode="mempool")
            with mock.patch.object(allocator, "_active", pool):
                with self.assertRaises(RuntimeError) as e:
                    allocator.add_reclaimer(other.reclaim)
                self.assertIn("DELTAD_ALLOCATOR_ROUTING=global",
                              str(e.exception))
                with allocator._lock:
                    allocator._arm_reclaim()  # as install() does
                # Python would run under PyTorch's device lock: not asked.
                self.assertIsNone(self.malloc(2 * MiB))
                self.assertEqual(Holder.calls, 0)
            with allocator._lock:
                allocator._arm_reclaim()  # as uninstall() does
            self.assertIsNone(self.malloc(2 * MiB))
            self.assertEqual(Holder.calls, 1)
        finally:
            allocator.remove_reclaimer(holder.reclaim)
            for q in held:
                self.free(q, 2 * MiB)

    def test_the_peak_of_allocated_bytes_restarts_at_reset_peak(self):
        a = self.malloc(2 * MiB)
        b = self.malloc(MiB)
        self.free(b, MiB)
        self.assertGreaterEqual(allocator.stats().peak_allocated_bytes,
                                3 * MiB)
        allocator.reset_peak()
        self.assertEqual(allocator.stats().peak_allocated_bytes, 2 * MiB)
        self.free(a, 2 * MiB)

    def test_size_zero_is_null_without_an_error_and_any_device_index_works(
            self):
        self.assertIsNone(self.malloc(0))
        p = self.malloc(4096, device=3)  # the simulated device is any GPU
        self.assertIsNotNone(p, self.lib.deltad_last_error())
        self.free(p, 4096, device=3)

    def test_malloc_with_nothing_attached_returns_null(self):
        self.lib.deltad_allocator_detach()
        self.assertIsNone(self.malloc(MiB))
        self.assertIn(b"deltad_allocator_attach", self.lib.deltad_last_error())
        self.assertFalse(allocator.stats().attached)

    def test_a_reclaimer_frees_room_for_an_allocation_past_the_budget(self):
        test = self

        class Holder:  # what a store of saved activations does
            def __init__(self):
                self.blocks = [test.malloc(2 * MiB) for _ in range(4)]
                self.asked = []

            def reclaim(self, nbytes):
                self.asked.append(nbytes)
                test.free(self.blocks.pop(), 2 * MiB)
                return 2 * MiB

        holder = Holder()
        self.assertNotIn(None, holder.blocks)
        before = allocator.stats()
        allocator.add_reclaimer(holder.reclaim)
        try:
            # Past the budget, from this thread and from another (ctypes
            # lets the GIL go for the call; the callback takes it back).
            p = self.malloc(2 * MiB)
            self.assertIsNotNone(p, self.lib.deltad_last_error())
            out = []
            t = threading.Thread(target=lambda: out.append(
                self.malloc(3 * MiB)))
            t.start()
            t.join()
            self.assertIsNotNone(out[0], self.lib.deltad_last_error())
        finally:
            allocator.remove_reclaimer(holder.reclaim)
        # What the budget lacked each time: 3 MiB took two blocks freed.
        self.assertEqual(holder.asked, [2 * MiB, 3 * MiB, MiB])
        after = allocator.stats()
        self.assertEqual(after.reclaims - before.reclaims, len(holder.asked))
        self.assertEqual(after.reclaimed_bytes - before.reclaimed_bytes,
                         2 * MiB * len(holder.asked))
        # Removed: the next allocation past the budget fails as before.
        self.assertIsNone(self.malloc(4 * MiB))
        self.assertEqual(allocator.stats().reclaims, after.reclaims)
        for q in holder.blocks + [p, out[0]]:
            self.free(q, 2 * MiB if q != out[0] else 3 * MiB)
        self.assertEqual(allocator.stats().allocated_bytes, 0)

    def test_a_reclaimer_that_raises_or_died_leaves_the_failure(self):
        held = [self.malloc(2 * MiB) for _ in range(4)]

        class Broken:
            def reclaim(self, nbytes):
                raise ValueError("broken reclaimer")

        broken, gone = Broken(), Broken()
        allocator.add_reclaimer(broken.reclaim)
        allocator.add_reclaimer(gone.reclaim)
        del gone  # held weakly: no longer asked
        try:
            with mock.patch("sys.stderr") as stderr:
                self.assertIsNone(self.malloc(2 * MiB))
            printed = "".join(c.args[0] for c in stderr.write.call_args_list)
            self.assertEqual(printed.count("ValueError: broken reclaimer"), 1)
            self.assertIn(b"budget of 8388608", self.lib.deltad_last_error())
        finally:
            allocator.remove_reclaimer(broken.reclaim)
        self.assertEqual(allocator._reclaimers, [])
        for q in held:
            self.free(q, 2 * MiB)

    def test_an_interrupt_in_a_reclaimer_reaches_the_main_thread(self):
        # Raised into C (the callback) it would be printed and lost.
        class Interrupted:
            def reclaim(self, nbytes):
                raise KeyboardInterrupt

        holder = Interrupted()
        allocator.add_reclaimer(holder.reclaim)
        try:
            with self.assertRaises(KeyboardInterrupt):
                self.assertEqual(allocator._reclaim(MiB, None), 0)
                for _ in range(1000):  # it comes at the next check
                    time.sleep(0.001)
        finally:
            allocator.remove_reclaimer(holder.reclaim)

    def test_threads_allocate_and_free_at_once(self):
        errors = []

        def work(seed):
            for i in range(200):
                size = (512, 64 << 10, MiB)[(i + seed) % 3]
                p = self.malloc(size)
                if p is None:
                    errors.append(self.lib.deltad_last_error())
                    continue
                ctypes.memset(p, seed, size)
                if ctypes.string_at(p + size - 1, 1) != bytes([seed]):
                    errors.append(f"bytes of thread {seed} changed")
                self.free(p, size)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(allocator.stats().allocated_bytes, 0)


if __name__ == "__main__":
    unittest.main()
