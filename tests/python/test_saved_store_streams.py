"""The store's CUDA ordering without a GPU: deltad.saved runs its CUDA
branch against a stand-in torch.cuda that logs streams and events, on CPU
tensors. Checked, under deltad's allocator: an offload's device bytes stay
referenced until its copy's event has completed (polled, waited for on the
host only past the cap on bytes in flight); a reload is allocated on the
compute stream, copied on the copy stream after it, and the compute stream
waits for the copy before the tensor is handed out; a prefetched group
that dies unread keeps its bytes until the copy into them has run. Under
PyTorch's own allocator the copy stream is recorded on the bytes instead,
and nothing is kept. A GPU runs the real thing (bench/torch_bench.py)."""

import contextlib
import threading
import unittest

import torch

import deltad.saved as saved
import deltad.saved_release as saved_release
import deltad.saved_restore as saved_restore

# The store's modules: each uses torch through its own _torch.
_STORE_MODULES = (saved, saved_release, saved_restore)


def patch_torch(fake):
    """Gives the store's modules the stand-in `fake`; returns what undoes
    it."""
    before = [m._torch for m in _STORE_MODULES]
    for m in _STORE_MODULES:
        m._torch = fake

    def undo():
        for m, t in zip(_STORE_MODULES, before):
            m._torch = t
    return undo


class FakeEvent:
    def __init__(self, log, log_waits=False):
        self.log = log
        self.log_waits = log_waits  # else a host wait fails the test
        self.done = False
        self.stream = None

    def record(self, stream=None):
        self.stream = stream
        self.log.append(("record", stream.name))

    def query(self):
        self.log.append(("query", self.done))
        return self.done

    def synchronize(self):
        if not self.log_waits:
            raise AssertionError("the store must not wait on the host")
        self.log.append(("synchronize",))
        self.done = True


class FakeStream:
    def __init__(self, name, log, cuda=None):
        self.name = name
        self.log = log
        self.cuda = cuda  # its waits_allowed and events, where it has one

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream.name))

    def synchronize(self):
        if self.cuda is None or not self.cuda.waits_allowed:
            raise AssertionError("the store must never wait on the host")
        self.log.append(("synchronize_stream", self.name))
        for event in self.cuda.events:
            if event.stream is self:
                event.done = True


class FakeCuda:
    """What deltad.saved uses of torch.cuda."""

    def __init__(self):
        self.log = []
        self.events = []
        self.waits_allowed = False
        self.compute = FakeStream("compute", self.log)
        self.current = self.compute

    def Stream(self, device):  # noqa: N802 (torch's name)
        return FakeStream("copy", self.log, self)

    def Event(self):  # noqa: N802
        event = FakeEvent(self.log, self.waits_allowed)
        self.events.append(event)
        return event

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("leave", s.name))


class FakeTorch:
    """torch, with the stand-in cuda and pinned allocations on the CPU."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.log = cuda.log

    def __getattr__(self, name):
        return getattr(torch, name)

    @property
    def Tensor(self):  # noqa: N802 (torch's name)
        log = self.log

        class Tensor:
            @staticmethod
            def record_stream(tensor, stream):
                log.append(("record_stream", tensor.data_ptr(), stream.name))
        return Tensor

    fail_pinned = 0  # pinned allocations still to fail

    def empty(self, *args, pin_memory=False, device=None, **kwargs):
        self.log.append(("empty", "pinned" if pin_memory else "device",
                         self.cuda.current.name))
        if pin_memory and self.fail_pinned:
            self.fail_pinned -= 1
            raise RuntimeError("CUDA error: out of memory (pinned, stand-in)")
        return torch.empty(*args, **kwargs)


class Plan:
    pressure = False
    unpack_order = []
    groups = 0


class NoRecompute:
    calls = {}

    def can_rebuild(self, group):
        return False

    def claim_pending(self):
        pass


class StreamOrderTest(unittest.TestCase):

    def setUp(self):
        self.cuda = FakeCuda()
        self.undo = patch_torch(FakeTorch(self.cuda))
        self.store = saved.SavedStore(
            torch.device("cpu"), 1 << 30,
            lambda group: "offload", NoRecompute(), host_bytes=1 << 30,
            prefetch_bytes=1 << 30, plan=Plan(), on_iteration=lambda: None)
        self.store.cuda = True
        self.store.copy_stream = self.cuda.Stream(None)
        self.store.pytorch_allocator = False  # deltad's: copies held

    def tearDown(self):
        self.undo()

    def save(self, tensor):
        storage = saved._storage(tensor)
        return self.store.pack(tensor, storage.data_ptr(), storage)

    def test_offloaded_bytes_stay_referenced_until_the_copy_ran(self):
        a = torch.arange(1024, dtype=torch.float32)
        address = a.data_ptr()
        sa = self.save(a)
        del a

        def held():
            return [e[1].data_ptr() for e in self.store.in_flight]

        self.store.budget = 1024  # the next save pushes `a` out
        sb = self.save(torch.ones(1024))
        self.assertEqual(self.store.counters.offloads, 1)
        log = self.cuda.log
        self.assertIn(("wait_stream", "copy", "compute"), log)
        self.assertIn(("empty", "pinned", "copy"), log)
        # The store's tensors of `a` are gone; only the copy's hold remains.
        self.assertEqual(held(), [address], "freed under its copy")
        self.store._poll_copies()  # copy still running
        self.assertEqual(held(), [address])
        self.assertNotIn(("query", True), log)
        self.cuda.events[0].done = True
        self.store._poll_copies()
        self.assertEqual(held(), [], "kept after its copy ran")
        del sb
        # Reloading: on the compute stream's memory, copied on the copy
        # stream after it, waited for by the compute stream before use.
        self.store.budget = 1 << 30
        log.clear()
        out = self.store.unpack(sa)
        self.assertEqual(log[0], ("empty", "device", "compute"))
        self.assertLess(log.index(("wait_stream", "copy", "compute")),
                        log.index(("enter", "copy")))
        self.assertIn(("wait_event", "compute", "copy"), log)
        self.assertTrue(torch.equal(out, torch.arange(1024,
                                                      dtype=torch.float32)))

    def prefetch_a(self):
        """Saves a, then b, which pushes a out; backward unpacks b and
        prefetches a. Returns a's SavedTensor and its reload's event."""
        a = torch.arange(1024, dtype=torch.float32)
        sa = self.save(a)
        del a
        self.store.budget = 1024
        sb = self.save(torch.ones(1024))
        self.cuda.events[0].done = True
        self.store._poll_copies()
        self.store.budget = 1 << 30
        self.store.unpack(sb)
        self.assertEqual(self.store.counters.prefetches, 1)
        return sa, self.cuda.events[-1]

    def test_a_prefetched_group_that_dies_unread_keeps_its_bytes(self):
        sa, reload_event = self.prefetch_a()
        del sa  # dies unread
        self.assertEqual(len(self.store.in_flight), 1)
        self.assertIs(self.store.in_flight[0][0], reload_event)
        reload_event.done = True
        self.store._poll_copies()
        self.assertEqual(self.store.in_flight, [])

    def test_a_prefetched_group_dying_after_the_block_is_waited_for(self):
        sa, reload_event = self.prefetch_a()
        self.store.close()
        # The block ended with a's copy in flight; a dies unread later.
        del sa
        # Nothing would poll a list now: the compute stream waits for the
        # copy into a's bytes before they can be reused there.
        self.assertEqual(self.store.in_flight, [])
        self.assertIn(("wait_event", "compute", reload_event.stream.name),
                      self.cuda.log)

    def test_a_failed_pinned_allocation_leaves_the_group_as_it_was(self):
        a = torch.arange(1024, dtype=torch.float32)
        sa = self.save(a)
        (group,) = self.store.groups.values()
        metas, versions = group.metas, group.versions
        saved._torch.fail_pinned = 1
        with self.assertRaises(RuntimeError):
            self.store._release(group)
        self.assertEqual((group.metas, group.versions), (metas, versions))
        self.assertEqual(group.state, saved.RESIDENT)
        del a
        # Released for good later, it comes back as autograd saved it.
        self.assertTrue(self.store._release(group))
        self.cuda.events[-1].done = True
        out = self.store.unpack(sa)
        self.assertTrue(torch.equal(out, torch.arange(1024,
                                                      dtype=torch.float32)))

    def test_past_the_cap_the_oldest_copies_are_waited_for(self):
        self.cuda.waits_allowed = True
        self.store.in_flight_cap = 4096  # one storage of 1024 floats
        saves = [self.save(torch.full((1024,), float(i))) for i in range(3)]
        self.store.budget = 1024  # each save now pushes the oldest out
        saves += [self.save(torch.ones(1024)) for _ in range(2)]
        self.assertGreaterEqual(self.store.counters.offloads, 2)
        # Each copy past the first waited for the one before it.
        self.assertLessEqual(self.store.in_flight_bytes, 4096)
        self.assertEqual(self.store.in_flight_bytes,
                         sum(e[2] for e in self.store.in_flight))
        waits = self.cuda.log.count(("synchronize",))
        self.assertGreaterEqual(waits, 1)
        self.assertEqual(self.store.counters.host_waits, waits)

    def test_under_pytorchs_allocator_the_copy_stream_is_recorded(self):
        self.store.pytorch_allocator = True
        a = torch.arange(1024, dtype=torch.float32)
        address = a.data_ptr()
        sa = self.save(a)
        del a
        self.store.budget = 1024
        sb = self.save(torch.ones(1024))
        self.assertEqual(self.store.counters.offloads, 1)
        # PyTorch's allocator keeps the block from reuse until the copy
        # stream passes the copy: the store keeps no reference, waits for
        # nothing, and counts the bytes until the copy has run.
        self.assertIn(("record_stream", address, "copy"), self.cuda.log)
        self.assertEqual([e[1:] for e in self.store.in_flight],
                         [(None, 4096)])
        self.assertEqual(self.store.in_flight_bytes, 4096)
        self.assertEqual(self.store.counters.host_waits, 0)
        self.cuda.events[0].done = True
        self.store._poll_copies()
        self.assertEqual(self.store.in_flight_bytes, 0)
        del sa, sb

    def test_a_group_read_on_another_stream_is_recorded_on_it(self):
        # A forward pass that ran a part on a stream of its own: backward
        # runs that part's nodes there too, and the group prefetched on
        # the compute stream is read on the side stream. PyTorch's
        # allocator must keep its block from reuse until the side stream
        # has read it.
        self.store.pytorch_allocator = True
        sa, reload_event = self.prefetch_a()
        side = FakeStream("side", self.cuda.log)
        reload_event.done = True
        self.cuda.current = side
        out = self.store.unpack(sa)
        self.cuda.current = self.cuda.compute
        self.assertIn(("wait_event", "side", "copy"), self.cuda.log)
        self.assertIn(("record_stream", out.data_ptr(), "side"),
                      self.cuda.log)
        # Read on the stream it was restored on: nothing to record.
        self.cuda.log.clear()
        sc = self.save(torch.full((1024,), 7.0))
        self.store.budget = 1024
        sd = self.save(torch.ones(1024))
        self.cuda.events[-1].done = True
        self.store._poll_copies()
        self.store.budget = 1 << 30
        self.store.unpack(sd)
        self.cuda.events[-1].done = True
        self.store.unpack(sc)
        self.assertFalse([e for e in self.cuda.log
                          if e[0] == "record_stream" and e[2] != "copy"])

    def test_a_prefetch_that_runs_out_of_memory_leaves_the_group_offloaded(
            self):
        saves = [self.save(torch.full((1024,), float(i))) for i in range(3)]
        self.store.budget = 1024  # the third save pushes the first two out
        saves.append(self.save(torch.ones(1024)))
        for e in self.cuda.events:
            e.done = True
        self.store._poll_copies()
        self.assertEqual(self.store.counters.offloads, 3)
        self.store.budget = 1 << 30
        real_empty = saved._torch.empty
        failed = []

        def empty(*args, pin_memory=False, device=None, **kwargs):
            if not pin_memory:
                failed.append(args)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
            return real_empty(*args, pin_memory=pin_memory, **kwargs)

        saved._torch.empty = empty
        try:
            # Backward reads the last save, then prefetches the others:
            # the first prefetch runs out of memory, and no other is tried.
            self.assertTrue(torch.equal(self.store.unpack(saves[3]),
                                        torch.ones(1024)))
        finally:
            del saved._torch.empty
        self.assertEqual(len(failed), 1)
        self.assertEqual(self.store.counters.prefetches, 0)
        self.assertTrue(self.store.prefetch_paused)
        # What backward needs is still restored, with the room it makes.
        for i in (2, 1, 0):
            self.assertTrue(torch.equal(self.store.unpack(saves[i]),
                                        torch.full((1024,), float(i))))
        self.assertEqual(self.store.counters.reloads, 3)

    def test_a_prefetch_past_deltads_budget_under_the_global_swap_pauses(
            self):
        # deltad's allocator raises a RuntimeError there, not PyTorch's
        # OutOfMemoryError; any other RuntimeError still propagates.
        saves = [self.save(torch.full((1024,), float(i))) for i in range(3)]
        self.store.budget = 1024
        saves.append(self.save(torch.ones(1024)))
        for e in self.cuda.events:
            e.done = True
        self.store._poll_copies()
        self.store.budget = 1 << 30
        real_empty = saved._torch.empty
        error = [RuntimeError("deltad: no room for 4096 bytes within the "
                              "budget of 8192 bytes")]

        def empty(*args, pin_memory=False, device=None, **kwargs):
            if not pin_memory:
                raise error[0]
            return real_empty(*args, pin_memory=pin_memory, **kwargs)

        saved._torch.empty = empty
        try:
            self.store.unpack(saves[3])
            self.assertTrue(self.store.prefetch_paused)
            self.store.prefetch_paused = False
            error[0] = RuntimeError("an error of another kind")
            with self.assertRaisesRegex(RuntimeError, "another kind"):
                self.store.unpack(saves[2])
        finally:
            del saved._torch.empty

    def test_host_memory_is_counted_as_the_pinned_pool_rounds_it(self):
        # 1000 floats: 4000 bytes, which PyTorch's pinned pool rounds up to
        # 4096. Three fit a 12000-byte cap exactly, two as rounded.
        self.store.host_cap = 12000
        saves = [self.save(torch.full((1000,), float(i))) for i in range(4)]
        self.store.budget = 4000  # each save pushed all but itself out
        saves.append(self.save(torch.ones(1000)))
        c = self.store.counters
        self.assertEqual(c.offloads, 2)
        self.assertGreaterEqual(c.host_full, 1)  # no recompute: kept
        self.assertEqual(self.store.host_held, 2 * 4096)
        # A reload gives its rounded size back.
        for e in self.cuda.events:
            e.done = True
        self.store.budget = 1 << 30
        self.store.unpack(saves[0])
        self.assertEqual(self.store.host_held, 4096)
        self.assertEqual(c.host_bytes, 4000)


    def test_reclaim_releases_the_oldest_and_waits_for_their_copies(self):
        self.cuda.waits_allowed = True
        saves = [self.save(torch.full((1024,), float(i))) for i in range(3)]
        self.store.budget = 1 << 20
        self.store.budget_used = 1 << 20
        self.store.budget_if_same = 2 << 20
        # Copies already in flight, listed out of the order they were
        # queued (a dropped prefetch's older copy is appended late).
        older, newer = self.cuda.Event(), self.cuda.Event()
        older.record(self.store.copy_stream)
        newer.record(self.store.copy_stream)
        self.store.in_flight += [(newer, None, 0), (older, None, 0)]
        # An allocation of the step needs 6000 bytes more than the budget
        # left: the two oldest groups (4096 bytes each) go, and their
        # bytes are free on return (the copies ran, the references gone).
        freed = self.store.reclaim(6000)
        c = self.store.counters
        self.assertEqual(freed, 2 * 4096)
        self.assertEqual(c.offloads, 2)
        self.assertEqual(c.resident_bytes, 4096)
        self.assertEqual(self.store.in_flight, [])
        self.assertEqual(self.store.in_flight_bytes, 0)
        self.assertEqual(self.cuda.log.count(("synchronize_stream", "copy")),
                         1)
        self.assertTrue(all(e.done for e in self.cuda.events))
        self.assertEqual(c.host_waits, 1)
        # The rest of the iteration saves no more than is left, and the
        # next learns from that.
        self.assertEqual(self.store.budget, 4096)
        self.assertEqual(self.store.budget_used, 4096)
        self.assertIsNone(self.store.budget_if_same)
        self.assertTrue(self.store.released_this_iteration)
        for i, sv in enumerate(saves):
            self.assertTrue(torch.equal(self.store.unpack(sv),
                                        torch.full((1024,), float(i))))

    def test_reclaim_from_another_thread_waits_for_the_forwards_stream(self):
        # The allocator's reclaimer runs on whichever thread allocates; its
        # current stream is not the one that wrote the tensors.
        self.cuda.waits_allowed = True
        saves = [self.save(torch.full((1024,), float(i))) for i in range(2)]
        self.cuda.current = FakeStream("other", self.cuda.log)
        self.cuda.log.clear()
        self.assertEqual(self.store.reclaim(4096), 4096)
        log = self.cuda.log
        self.assertIn(("wait_stream", "copy", "compute"), log)
        self.assertIn(("wait_stream", "copy", "other"), log)
        self.assertLess(log.index(("wait_stream", "copy", "compute")),
                        log.index(("enter", "copy")))
        self.cuda.current = self.cuda.compute
        for i, sv in enumerate(saves):
            self.assertTrue(torch.equal(self.store.unpack(sv),
                                        torch.full((1024,), float(i))))

    def test_reclaim_inside_the_stores_own_work_frees_nothing(self):
        saves = [self.save(torch.full((1024,), float(i))) for i in range(2)]
        self.store.busy = True  # e.g. a reload's allocation
        self.assertEqual(self.store.reclaim(4096), 0)
        self.store.busy = False
        held = threading.Event()
        done = threading.Event()

        def hold():
            with self.store.lock:
                held.set()
                done.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(10)
        try:
            # Another thread's: the allocation does not wait for it.
            self.assertEqual(self.store.reclaim(4096), 0)
        finally:
            done.set()
            t.join()
        self.assertEqual(self.store.counters.offloads, 0)
        self.assertEqual(self.store.counters.resident_bytes, 2 * 4096)
        del saves

if __name__ == "__main__":
    unittest.main()
