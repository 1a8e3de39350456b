"""Recompute of the patterns torchvision's models use: a ReLU(inplace=True)
after a BatchNorm, and a residual block whose output is changed in place
(`out += x`) after its last BatchNorm. Gradients and buffers must equal an
unmanaged run exactly."""

import unittest

import correctness  # noqa: F401 (before torch: cuBLAS's workspace)

import torch

import deltad.torch


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


class RecomputeTest(unittest.TestCase):

    def check_exact(self, make_model, x):
        """Two steps unmanaged, then two under policy="recompute" with a
        budget that releases nearly everything: gradients and buffers
        equal; the managed second step's stats."""
        model = make_model()
        for _ in range(2):
            model.zero_grad()
            model(x).square().mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        expected += [b.clone() for b in model.buffers()]
        model = make_model()
        for _ in range(2):
            model.zero_grad()
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=20000,
                                      policy="recompute") as manager:
                model(x).square().mean().backward()
        got = [p.grad for p in model.parameters()] + list(model.buffers())
        for a, b in zip(expected, got):
            self.assertTrue(torch.equal(a, b))
        return manager.stats()

    def test_relu_outputs_are_evicted_and_rebuilt_exactly(self):
        # The in-place ReLU changes the BatchNorm's output: the storage is
        # rebuilt by rerunning the BatchNorm, then the ReLU on it.
        def make_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Sequential(
                torch.nn.Conv2d(8, 8, 3, padding=1),
                torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True))
                for _ in range(4)])

        stats = self.check_exact(make_model, torch.randn(4, 8, 16, 16))
        # Conv outputs and the ReLUs' (the BatchNorms') are evicted; the
        # input and what no module returned are offloaded.
        self.assertGreater(stats.evictions, stats.offloads, stats)
        self.assertEqual(stats.evictions, stats.recomputes)

    def test_block_outputs_are_evicted_and_rebuilt_exactly(self):
        # The block's output, its last BatchNorm's bytes changed by
        # `out += x` and an in-place ReLU, is rebuilt by rerunning the
        # block.
        def make_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1),
                *[_ResidualBlock(8) for _ in range(4)])

        stats = self.check_exact(make_model, torch.randn(4, 3, 16, 16))
        # 23 evictions and 25 offloads before blocks rebuilt their
        # outputs; 50 and 16 since.
        self.assertGreater(stats.evictions, 2 * stats.offloads, stats)


class _Event:
    """A CUDA event's stand-in: done or not, 2 ms after its start."""

    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return 2.0


class RecomputeCostTest(unittest.TestCase):
    """On CUDA the CPU runs ahead of the GPU: when the store picks its
    victims in a forward, most recorded calls have not run yet, and a cost
    read as 0 made every release an eviction. A call not measured yet is
    priced at its module's last measured run, and without one it is not
    priced at all: the Director offloads."""

    def call(self, module, done):
        from deltad.recompute import Call
        c = Call()
        c.module, c.args, c.kwargs = module, (), {}
        c.events = (_Event(True), _Event(done))
        c.own_ns = 0
        return c

    def test_an_unmeasured_call_has_no_cost_then_its_modules_last(self):
        module = torch.nn.ReLU()
        self.assertIsNone(self.call(module, done=False).cost_ns())
        self.assertEqual(self.call(module, done=True).cost_ns(), 2000000)
        self.assertEqual(self.call(module, done=False).cost_ns(), 2000000)

    def test_a_call_rerunning_an_unmeasured_one_has_no_cost(self):
        module = torch.nn.Tanh()
        first = self.call(module, done=False)
        second = self.call(torch.nn.ReLU(), done=True)
        second.args = (("call", first, None),)
        self.assertIsNone(second.cost_ns())

    def test_the_director_offloads_what_it_cannot_price(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        with deltad.torch.managed(model, socket=None, min_bytes=1,
                                  budget_bytes=1 << 20) as manager:
            engine = manager._engine
            group = type("Group", (), {})()
            group.nbytes = 1 << 20
            group.call = self.call(torch.nn.GELU(), done=False)
            engine.recorder.can_rebuild = lambda g: True
            engine.policy = "auto"
            self.assertEqual(engine._director(group), "offload")


class RebuildCostTest(unittest.TestCase):
    """A group's price for the choice of victims: its call's time, plus
    the rebuilds of the evicted groups that call reads (DTR's evicted
    neighbourhood), each counted once per choice; a resident source adds
    nothing."""

    def group(self, ns, *sources):
        from deltad.recompute import Call
        from deltad.saved import _Group as Group
        c = Call()
        c.module, c.kwargs, c.events, c.own_ns = torch.nn.ReLU(), {}, None, ns
        c.args = tuple(("group", g) for g in sources)
        return Group(store=None, key=ns, nbytes=4, position=0, call=c)

    def test_evicted_sources_add_their_rebuilds_and_resident_ones_nothing(
            self):
        from deltad.recompute import Recorder
        from deltad.saved import EVICTED
        recorder = Recorder(torch.device("cpu"), 1, 8)
        first = self.group(1000)
        second = self.group(200, first)
        third = self.group(30, second)
        self.assertEqual(recorder.rebuild_cost(third, {}), 30)
        second.state = EVICTED
        self.assertEqual(recorder.rebuild_cost(third, {}), 230)
        first.state = EVICTED
        self.assertEqual(recorder.rebuild_cost(third, {}), 1230)
        memo = {}
        self.assertEqual(recorder.rebuild_cost(second, memo), 1200)
        self.assertEqual(memo[id(first)], 1000)


class _Table(torch.nn.Module):
    """Returns a view of its own buffer, as a position table does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.randn(64, 32))

    def forward(self, x):
        return self.pe[:x.shape[0]]


class _WithTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(32, 32)
        self.table = _Table()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = torch.relu(self.first(x))  # saved: the table's argument is
        return self.lin(h * self.table(h))  # one deltad can rebuild


class RecomputeOfBuffersTest(unittest.TestCase):
    """A module that returns (a view of) its own buffer made no activation:
    nothing of it is recorded, and no iteration's call is kept alive by the
    buffer, which lives as long as the model."""

    def test_a_view_of_a_buffer_is_not_recorded(self):
        import weakref
        model = _WithTable()
        for _ in range(3):
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      budget_bytes=1 << 12,
                                      policy="recompute"):
                model(torch.randn(48, 32)).sum().backward()
        on_buffer = [f for f in list(weakref.finalize._registry)
                     if f.peek() is not None and
                     f.peek()[0] is model.table.pe]
        self.assertEqual(on_buffer, [])


class RecomputeAutocastTest(unittest.TestCase):
    """A call recorded with CUDA autocast off is rebuilt with it disabled
    explicitly: autograd's threads run backward (where rebuilds happen)
    with the autocast state of the thread that called backward()."""

    def test_autocast_off_is_entered_disabled_where_cuda_exists(self):
        import deltad.recompute as recompute
        entered = []

        class FakeTorch:
            class cuda:  # noqa: N801 (torch's name)
                @staticmethod
                def is_available():
                    return True

            @staticmethod
            def autocast(device, dtype=None, enabled=True):
                entered.append((device, dtype, enabled))
                return recompute._NullContext()

        before = recompute._torch
        recompute._torch = FakeTorch
        try:
            with recompute._autocast_cuda(torch.float16, False):
                pass
        finally:
            recompute._torch = before
        self.assertEqual(entered, [("cuda", torch.float16, False)])


class _AddOne(torch.nn.Module):
    """Its output leaves the call at version 1."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        y.add_(1.0)
        return y


class _ChangedAfterItsCall(torch.nn.Module):
    """h is changed in place after the call that made it, so it can only
    be offloaded; reloaded as the argument of another rebuild, it comes
    back with new version counters."""

    def __init__(self):
        super().__init__()
        self.m = _AddOne()
        self.lin2 = torch.nn.Linear(16, 16)
        self.q1 = torch.nn.Linear(16, 16)
        self.q2 = torch.nn.Linear(16, 16)
        self.lin3 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.m(x)
        h.mul_(2.0)
        a = self.lin2(h)
        p = a * self.q1(x)
        p = p * self.q2(x)
        return self.lin3(p)


class _StridedSlice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 16, 3, padding=1)
        self.act = torch.nn.GELU()
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):  # (B, C, T) -> a permuted slice with gaps
        return self.out(self.act(self.conv(x).transpose(1, 2)[:, ::2]))


class _State:
    """A plain object holding a tensor, as some models pass state around."""

    def __init__(self, h):
        self.h = h


class _FromState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, state):
        return torch.tanh(self.lin(state.h))


class _StateReusedAfterItsCall(torch.nn.Module):
    """The state object given to a call is changed after it: a rebuild of
    that call would read what it holds then."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.from_state = _FromState()
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        state = _State(self.inp(x))
        y = self.from_state(state)
        state.h = torch.zeros_like(state.h)
        return self.out(torch.tanh(self.mid(y)))


class RecomputeFaithfulnessTest(unittest.TestCase):
    """Cases found by reading recompute.py against torch.utils.checkpoint:
    each trains two steps unmanaged and under policy="recompute" with a
    budget that releases nearly everything, and must give the same
    gradients, losses and parameters, bit for bit."""

    def assert_same_training(self, make_model, make_input):
        expected = correctness.run(make_model, make_input,
                                   correctness.simple_step, None, 2)
        got = correctness.run(make_model, make_input,
                              correctness.simple_step,
                              correctness.RECOMPUTE, 2)
        correctness.assert_same_training(self, expected, got)
        self.assertGreater(got[2].recomputes, 0, got[2])
        return got[2]

    def test_a_forward_pre_hook_is_not_applied_twice(self):
        def make_model():
            m = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.Tanh(),
                torch.nn.Linear(32, 32), torch.nn.Tanh(),
                torch.nn.Linear(32, 4))
            m[2].register_forward_pre_hook(lambda mod, inp: (inp[0] * 2.0,))
            return m
        self.assert_same_training(make_model, lambda: torch.randn(8, 16))

    def test_a_forward_hook_that_replaces_the_output_is_not_rebuilt(self):
        def make_model():
            m = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                torch.nn.Tanh(), torch.nn.Linear(32, 4))
            # out * out saves `out`, the forward's own output.
            m[0].register_forward_hook(lambda mod, inp, out: out * out)
            return m
        self.assert_same_training(make_model, lambda: torch.randn(8, 16))

    def test_a_restored_group_changed_after_its_call_is_not_evicted(self):
        self.assert_same_training(_ChangedAfterItsCall,
                                  lambda: torch.randn(8, 16))

    def test_an_argument_with_gaps_is_rebuilt_with_its_strides(self):
        self.assert_same_training(_StridedSlice,
                                  lambda: torch.randn(2, 4, 16))

    def test_a_call_given_an_object_changed_afterwards_is_not_rebuilt(self):
        self.assert_same_training(_StateReusedAfterItsCall,
                                  lambda: torch.randn(8, 16))

    def test_a_module_with_a_path_without_grad_is_rebuilt_on_its_own(self):
        # In eval() with grad on, PyTorch's TransformerEncoderLayer takes
        # its fast path only where grad is off: a rebuild without grad ran
        # other kernels.
        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = torch.nn.Linear(16, 32)
                self.layers = torch.nn.Sequential(*[
                    torch.nn.TransformerEncoderLayer(
                        32, 4, 64, batch_first=True, norm_first=True)
                    for _ in range(2)])
                self.out = torch.nn.Linear(32, 4)

            def forward(self, x):
                return self.out(self.layers(self.inp(x)))

        def make_model():
            return Encoder().eval()  # dropout off, grads still computed

        self.assert_same_training(make_model, lambda: torch.randn(4, 8, 16))


class CopiesOfAWrappedModelTest(unittest.TestCase):
    """A model copied (an EMA copy, AveragedModel) or saved inside a block
    that records its calls runs its own forward, not the original's."""

    def test_a_copy_runs_its_own_forward_and_a_saved_model_loads(self):
        import copy
        import io

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4))
        x = torch.randn(8, 16)
        saved = io.BytesIO()
        with deltad.torch.managed(model, socket=None, budget_bytes=1000,
                                  min_bytes=1, policy="recompute") as m:
            model(x).square().mean().backward()
            self.assertGreater(m.stats().recorded_calls, 0)
            clone = copy.deepcopy(model)
            torch.save(model, saved)
            expected = torch.nn.Sequential.forward(clone, x)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            # The copy's weights, not the changed original's.
            self.assertTrue(torch.equal(clone(x), expected))
            self.assertFalse(torch.equal(clone(x), model(x)))
        saved.seek(0)
        loaded = torch.load(saved)
        self.assertEqual(tuple(loaded(x).shape), (8, 4))
        # The copy can be managed, and recorded, in turn.
        with deltad.torch.managed(clone, socket=None, budget_bytes=1000,
                                  min_bytes=1, policy="recompute") as m:
            clone(x).square().mean().backward()
            self.assertGreater(m.stats().recorded_calls, 0)


class ABlockWhoseExitFailsTest(unittest.TestCase):
    """A block whose exit fails half-way (here a MemoryError at each of
    its allocations in turn) must not leave the model's modules with
    forwards that record into its closed store, where every later block
    would fail (ReferenceError) for good: the next step runs as before."""

    def test_every_failed_allocation_at_exit_leaves_the_model_usable(self):
        try:
            import _testcapi
            _testcapi.set_nomemory
        except (ImportError, AttributeError):
            self.skipTest("this Python has no _testcapi to fail allocations")
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        x = torch.randn(8, 16)

        def step(fail_at=None):
            for p in model.parameters():
                p.grad = None
            try:
                with deltad.torch.managed(model, socket=None, min_bytes=1,
                                          policy="recompute",
                                          budget_bytes=1 << 10):
                    model(x).sum().backward()
                    if fail_at is not None:
                        _testcapi.set_nomemory(fail_at, fail_at + 1)
            finally:
                _testcapi.remove_mem_hooks()
            return [p.grad.clone() for p in model.parameters()]

        expected = step()
        failures = 0
        for n in range(1000):
            try:
                step(fail_at=n)
            except MemoryError:
                failures += 1
            else:
                if n > 50:
                    break
            # (A failure in calling the block's __exit__ itself skips all
            # of it: the next block must cope.)
            grads = step()
            self.assertTrue(all(torch.equal(a, b)
                                for a, b in zip(grads, expected)), n)
            for module in model.modules():
                self.assertNotIn("forward", module.__dict__, n)
        self.assertGreater(failures, 0)

    def test_a_failure_before_the_stores_close_still_closes_it(self):
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh())
        with self.assertRaises(MemoryError):
            with deltad.torch.managed(model, socket=None, min_bytes=1,
                                      policy="recompute",
                                      budget_bytes=1 << 10) as manager:
                model(torch.randn(8, 16)).sum().backward()
                recorder = manager.recorder

                class Failing(type(recorder)):
                    @property
                    def recorded(self):  # read as the block closes
                        raise MemoryError()

                recorder.__class__ = Failing
        recorder.__class__ = Failing.__mro__[1]
        self.assertTrue(manager.store.closed)
        for module in model.modules():
            self.assertNotIn("forward", module.__dict__)


if __name__ == "__main__":
    unittest.main()
