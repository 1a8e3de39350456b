"""The store of saved activations (deltad.saved), case by case: versions
kept across a release, members collected while the store works, restored
groups that make way, copies still running when a block ends."""

import gc
import unittest
import weakref

import torch

import deltad.torch


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
        from test_saved_store_streams import patch_torch
        self.undo = patch_torch(_CollectingTorch(torch))
        gc.collect()
        gc.disable()  # only the store's allocations collect

    def tearDown(self):
        gc.enable()
        self.undo()

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

            def claim_pending(self):
                pass

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


class PendingCopiesAtCloseTest(unittest.TestCase):
    """Nothing polls the copies still running when the block ends, and the
    store may die any time after: their device memory must not go back to
    the compute stream's pool before the copy (a reload writes into it).
    The compute stream waits for the last copy instead (no host wait).
    Checked with test_saved_store_streams' stand-in torch.cuda."""

    def test_close_orders_the_compute_stream_after_pending_copies(self):
        import deltad.saved as saved
        from test_saved_store_streams import (FakeCuda, FakeTorch,
                                              NoRecompute, Plan, patch_torch)
        cuda = FakeCuda()
        undo = patch_torch(FakeTorch(cuda))
        try:
            store = saved.SavedStore(
                torch.device("cpu"), 1 << 30, lambda group: "offload",
                NoRecompute(), host_bytes=1 << 30, prefetch_bytes=1 << 30,
                plan=Plan(), on_iteration=lambda: None)
            store.cuda = True
            store.copy_stream = cuda.Stream(None)
            store.pytorch_allocator = False  # deltad's: copies held

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
            # On the whole copy stream: its list is not in queue order (a
            # dropped prefetch's copy, older, is listed late).
            self.assertIn(("wait_stream", "compute", "copy"), cuda.log)
            del sa, sb
        finally:
            undo()


class MisusedCoreTest(unittest.TestCase):
    """The C part of the store refuses what it cannot work with, with an
    error, never a crash: a store not set up, a foreign object to unpack."""

    def test_a_core_not_set_up_raises(self):
        from deltad import saved
        core = saved._core.Core()
        t = torch.randn(4)
        self.assertIs(core.hook_pack(t), t)  # not configured: keeps nothing
        storage = saved._storage(t)
        with self.assertRaisesRegex(RuntimeError, "no lock"):
            core.pack(t, storage.data_ptr(), storage)
        with self.assertRaises(TypeError):
            core.unpack(t)
        self.assertIs(core.hook_unpack(t), t)  # not a SavedTensor: as it is

    def test_a_core_without_its_python_half_raises(self):
        from deltad import saved
        core = saved._core.Core()
        core.lock = __import__("threading").RLock()
        t = torch.randn(4)
        storage = saved._storage(t)
        with self.assertRaisesRegex(AttributeError, "_new_iteration"):
            core.pack(t, storage.data_ptr(), storage)


class DroppedGraphTest(unittest.TestCase):
    """A graph dropped without backward (a step that raised, a forward
    whose result nobody differentiates) frees what it saved at once, as
    without deltad: what the store keeps of a saved tensor must not hold
    the tensor's own autograd node, which holds the store's SavedTensor
    (a cycle through C++ that Python's collector cannot break). On a GPU
    such a leak made every later step of the process run out of memory."""

    def forward_keeping_refs(self, model, x):
        """The model's output, and weak references to every activation."""
        refs = []
        hooks = [m.register_forward_hook(
            lambda m, i, out: refs.append(weakref.ref(out)))
            for m in model]
        try:
            return model(x), refs
        finally:
            for h in hooks:
                h.remove()

    def test_a_dropped_forward_frees_its_saved_tensors_without_gc(self):
        for policy, min_bytes in (("offload", 1), ("recompute", 1),
                                  ("auto", 1 << 40)):  # all left as they are
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(),
                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                torch.nn.Linear(256, 8))
            with deltad.torch.managed(model, socket=None, policy=policy,
                                      min_bytes=min_bytes,
                                      budget_bytes=1 << 30) as manager:
                out, refs = self.forward_keeping_refs(
                    model, torch.randn(32, 64))
                self.assertGreater(manager.store.counters.resident_bytes
                                   if min_bytes == 1 else 1, 0)
                del out
                # Plain reference counting: no collector run.
                self.assertEqual([r() is None for r in refs],
                                 [True] * len(refs), policy)
                self.assertEqual(manager.store.counters.resident_bytes, 0)
                self.assertEqual(manager.store.groups, {})

    def test_a_step_that_raises_frees_what_it_saved(self):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 8))
        stores = []
        for budget in (1 << 30, 1 << 12):  # nothing released; offloads
            with self.assertRaisesRegex(RuntimeError, "a failed step"):
                with deltad.torch.managed(model, socket=None, min_bytes=1,
                                          budget_bytes=budget) as manager:
                    stores.append(weakref.ref(manager.store))
                    out, refs = self.forward_keeping_refs(
                        model, torch.randn(32, 64))
                    raise RuntimeError("a failed step")
            del out, manager
            gc.collect()
            self.assertEqual([r() is None for r in refs], [True] * 3)
        # The store laid aside for the model's next block is idle.
        for ref in stores:
            store = ref()
            if store is not None:
                self.assertEqual(store.counters.resident_bytes, 0)
                self.assertEqual(store.counters.host_bytes, 0)
                self.assertEqual(store.groups, {})


class LearnedBudgetTest(unittest.TestCase):
    """A budget learned from the last iteration's peak (deltad.budget)
    that is larger than the first guess holds only for an iteration like
    the last: checked when the store first passes the first guess, by the
    size of the iteration's first storage."""

    def setUp(self):
        import deltad.saved as saved
        from test_saved_store_streams import NoRecompute, Plan
        self.saved = saved
        self.learned = None
        self.store = saved.SavedStore(
            torch.device("cpu"), 3 * 4096, lambda group: "offload",
            NoRecompute(), host_bytes=1 << 30, prefetch_bytes=0,
            plan=Plan(), on_iteration=self.on_iteration)

    def on_iteration(self):
        # What deltad.torch's engine does as an iteration begins.
        self.store.budget = 3 * 4096
        self.store.budget_if_same = self.learned

    def iteration(self, n, floats):
        """Saves n storages of `floats` floats; what keeps them."""
        storage = self.saved._storage
        return [self.store.pack(t, storage(t).data_ptr(), storage(t))
                for t in (torch.full((floats,), float(i)) for i in range(n))]

    def test_an_iteration_like_the_last_gets_the_learned_budget(self):
        del self.iteration(1, 1024)[:]  # the last: storages of 4096 bytes
        self.learned = 8 * 4096
        kept = self.iteration(6, 1024)
        self.assertEqual(self.store.counters.offloads, 0)
        self.assertEqual(self.store.budget, 8 * 4096)
        self.assertEqual(self.store.budget_used, 8 * 4096)
        del kept

    def test_another_batch_keeps_the_first_guess(self):
        del self.iteration(1, 2048)[:]  # the last had twice the batch
        self.learned = 8 * 4096
        kept = self.iteration(6, 1024)
        self.assertGreater(self.store.counters.offloads, 0)
        self.assertEqual(self.store.budget, 3 * 4096)
        self.assertIsNone(self.store.budget_if_same)
        del kept


class PackOutOfMemoryTest(unittest.TestCase):
    """A pack that fails on an allocation in the C store (MemoryError)
    leaves the store as it was: the failed storage is not counted alive,
    so once the earlier saved tensors die a new forward begins a new
    iteration. Every allocation of the pack is failed in turn."""

    def setUp(self):
        try:
            import _testcapi
        except ImportError:
            self.skipTest("this Python has no _testcapi to fail allocations")
        self.capi = _testcapi
        if not hasattr(_testcapi, "set_nomemory"):
            self.skipTest("this Python's _testcapi cannot fail allocations")

    def store(self, iterations):
        import deltad.saved as saved
        from test_saved_store_streams import NoRecompute, Plan
        return saved.SavedStore(
            torch.device("cpu"), 1 << 30, lambda group: "offload",
            NoRecompute(), host_bytes=1 << 30, prefetch_bytes=0,
            plan=Plan(), on_iteration=lambda: iterations.append(1))

    def test_every_failed_allocation_in_pack_leaves_the_counts_as_they_were(
            self):
        from deltad.saved import _storage
        failures = 0
        for n in range(1000):
            iterations = []
            store = self.store(iterations)
            first = torch.randn(1000)
            kept = store.pack(first, _storage(first).data_ptr(),
                              _storage(first))
            t = torch.randn(1000)
            key, storage = _storage(t).data_ptr(), _storage(t)
            gc.collect()
            failed = False
            self.capi.set_nomemory(n, n + 1)  # the n-th allocation fails
            try:
                store.pack(t, key, storage)
            except MemoryError:
                failed = True
            finally:
                self.capi.remove_mem_hooks()
            if not failed:
                break  # past the pack's last allocation
            failures += 1
            self.assertEqual(store.alive, 1, n)
            self.assertEqual(store.counters.resident_bytes, 4000, n)
            self.assertEqual(list(store.groups), [_storage(first).data_ptr()])
            del kept
            self.assertEqual(store.alive, 0, n)
            again = store.pack(t, key, storage)  # a new forward
            self.assertEqual(len(iterations), 2, n)
            self.assertEqual(store.counters.resident_bytes, 4000, n)
            del again
        self.assertGreater(failures, 3)

    def test_a_failed_pack_of_another_view_leaves_the_group_as_it_was(self):
        from deltad.saved import _storage
        failures = 0
        for n in range(1000):
            store = self.store([])
            first = torch.randn(1000)
            key, storage = _storage(first).data_ptr(), _storage(first)
            kept = store.pack(first, key, storage)
            view = first[10:20]
            gc.collect()
            failed = False
            self.capi.set_nomemory(n, n + 1)
            try:
                joined = store.pack(view, key, storage)
            except MemoryError:
                failed = True
            finally:
                self.capi.remove_mem_hooks()
            if not failed:
                del joined
                break
            failures += 1
            self.assertEqual(store.alive, 1, n)
            self.assertTrue(torch.equal(store.unpack(kept), first))
            del kept
            self.assertEqual(store.alive, 0, n)
            self.assertEqual(store.counters.resident_bytes, 0, n)
        self.assertGreater(failures, 0)


class VictimChoiceTest(unittest.TestCase):
    """Where the owner prices the groups (the time bringing each back
    would take), the store releases first the one whose price per byte
    and per step of staleness is least: an expensive group stays while
    cheaper ones, even newer, go; with prices alike, the oldest goes
    first, as without prices."""

    def store(self, prices, budget=3 * 4096):
        import deltad.saved as saved
        from test_saved_store_streams import NoRecompute, Plan
        store = saved.SavedStore(
            torch.device("cpu"), budget, lambda group: "offload",
            NoRecompute(), host_bytes=1 << 30, prefetch_bytes=0,
            plan=Plan(), on_iteration=lambda: None)
        store.price = lambda group, memo: prices[group.position]
        return store

    def pack_four(self, store, n=4):
        """Four storages of 4096 bytes (or n), the last past the budget
        (the store makes room down to 15/16 of it: two go); what is
        released."""
        from deltad.saved import RESIDENT, _storage as storage
        kept = [store.pack(t, storage(t).data_ptr(), storage(t))
                for t in (torch.full((1024,), float(i)) for i in range(n))]
        released = [g.position for g in store.by_position
                    if g.state != RESIDENT]
        del kept
        return released

    def test_an_expensive_group_stays_and_cheaper_newer_ones_go(self):
        store = self.store([1e9, 1.0, 2.0, 1e9])
        self.assertEqual(self.pack_four(store), [1, 2])

    def test_with_prices_alike_the_oldest_go_first(self):
        store = self.store([5.0] * 4)
        self.assertEqual(self.pack_four(store), [0, 1])

    def test_cheap_groups_behind_many_expensive_ones_are_still_seen(self):
        # 70 groups kept for their price, then 3 cheap ones (the last
        # the one packed); six go. The oldest alone would leave only
        # expensive candidates: 0-5 went.
        store = self.store([1e9] * 70 + [1.0] * 3, budget=72 * 4096)
        released = self.pack_four(store, n=73)
        self.assertEqual(len(released), 6, released)
        self.assertIn(71, released)

    def test_a_price_that_raises_leaves_every_victim_in_line(self):
        store = self.store([1.0, None, 1.0, 1.0])  # None / bytes raises
        with self.assertRaises(TypeError):
            self.pack_four(store)
        self.assertEqual([g.position for g in store.order][:3], [0, 1, 2])


if __name__ == "__main__":
    unittest.main()
