"""deltad.torch.managed gives bit-identical results, case by case.

Every case trains (or runs forward and backward on) a small model
unmanaged and then managed four ways, and compares losses, gradients,
buffers and the random number generators' states with torch.equal:

- "fits": a budget far above what the case saves, so nothing is released
  (and, held by reference, nothing is copied: no host wait either);
- "offload": a budget of 1 KiB with policy="offload": almost every saved
  storage goes to host memory and comes back in backward;
- "recompute": the same budget with policy="recompute": what a recorded
  module call produced is dropped and rebuilt by running the call again;
- "partial": half of what "fits" saved at most, policy="auto" and reloads
  ahead of use: released and resident groups side by side.

The small-budget runs also assert that something was actually released
where the case has something releasable, so that a case cannot pass by
never leaving the fast path. min_bytes=1: the test tensors are small.
DELTAD_TEST_VERBOSE=1 prints each mode's stats.

The cases (Cases) run on the CPU (CpuCorrectnessTest) and, where PyTorch
sees a GPU, on it (CudaCorrectnessTest: model and inputs moved to "cuda",
torch.use_deterministic_algorithms(True), cuDNN deterministic and without
benchmarking, CUBLAS_WORKSPACE_CONFIG set before CUDA starts). Without one
the CUDA tests are reported as skipped ("no CUDA device: ..."). A case
with an op that has no deterministic CUDA implementation is skipped on
CUDA, with the op PyTorch names. On CUDA the budget is the whole
process's (docs/PYTORCH.md): the tests add what the process holds when
the block begins (the model, its inputs) and reserve nothing for
temporaries, so that every mode keeps its meaning; results are copied to
pinned host memory without waiting, and compared after one
torch.cuda.synchronize() at the end. The CUDA tests also check what the
CPU cannot show: the manager never waits on the host (host_waits == 0 in
every mode, where the CPU's copies block) while offloading and
prefetching across the iterations of one block.
"""

# First: it sets cuBLAS's workspace before torch starts CUDA.
from correctness import (  # noqa: I100
    CPU, CUDA, FITS, MODES, NO_CUDA, NOT_DETERMINISTIC, OFFLOAD, RECOMPUTE,
    _managed, mlp, run, simple_step)

import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import unittest  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Cases:
    """The cases, on `device`: a mixin of the TestCases below (not one
    itself, so that unittest runs the cases only through them)."""

    device = CPU

    def run_case(self, make_model, make_inputs, step=simple_step,
                 options=None, iterations=1, **kwargs):
        """run() on this class's device."""
        return run(make_model, make_inputs, step, options, iterations,
                   device=self.device, **kwargs)

    def randn(self, *shape):
        return torch.randn(*shape).to(self.device)

    def assert_identical(self, expected, got, what):
        e_steps, e_state, _ = expected
        g_steps, g_state, _ = got
        self.assertEqual(len(e_steps), len(g_steps), what)
        for i, (e, g) in enumerate(zip(e_steps, g_steps)):
            self.assertEqual(len(e), len(g), what)
            for j, (a, b) in enumerate(zip(e, g)):
                if a is None or b is None:
                    self.assertIs(a, b, f"{what}: step {i} tensor {j}")
                    continue
                self.assertTrue(
                    torch.equal(a, b),
                    f"{what}: step {i} tensor {j} differs (max "
                    f"{(a.double() - b.double()).abs().max().item():.3g})")
        self.assertEqual(len(e_state), len(g_state), what)
        for j, (a, b) in enumerate(zip(e_state, g_state)):
            self.assertTrue(torch.equal(a, b),
                            f"{what}: parameter/buffer {j} differs")

    def check(self, make_model, make_inputs, step=simple_step,
              iterations=1, modes=("fits", "offload", "recompute"),
              options=None):
        """Runs the case unmanaged and in `modes` (`options` added to the
        small-budget ones; "partial" follows "fits"); asserts identical
        results, that "fits" released and recorded nothing and that every
        other mode released (offload: only offloaded; recompute: evicted
        and recomputed some). Returns {mode: stats}."""
        expected = self.run_case(make_model, make_inputs, step, None,
                                 iterations)
        out = {}
        partial = ("partial",) if "fits" in modes else ()
        for mode in modes + partial:
            if mode == "partial":
                # Half of what the case saves, the Director choosing, and
                # reloads ahead of use: released groups and resident ones
                # side by side.
                peak = out["fits"].peak_device_bytes
                opts = dict(budget_bytes=peak // 2, policy="auto",
                            prefetch_bytes=peak)
            else:
                opts = dict(MODES[mode], **(options or {}))
            got = self.run_case(make_model, make_inputs, step, opts,
                                iterations)
            self.assert_identical(expected, got, mode)
            stats = got[2]
            out[mode] = stats
            if os.environ.get("DELTAD_TEST_VERBOSE"):
                print(f"\n{self.id()} {mode}: {stats}")
            self.assertGreater(stats.saved_tensors, 0, mode)
            if self.device.type == "cuda":
                # Copies on the copy stream, events polled: the host never
                # waits for the GPU, whatever the mode.
                self.assertEqual(stats.host_waits, 0, f"{mode}: {stats}")
            if mode == "fits":
                self.assertEqual((stats.offloads, stats.evictions,
                                  stats.host_waits, stats.recomputes,
                                  stats.recorded_calls),
                                 (0, 0, 0, 0, 0), stats)
                continue
            self.assertGreater(stats.offloads + stats.evictions, 0,
                               f"{mode}: nothing released: {stats}")
            if mode == "offload":
                self.assertEqual(stats.evictions, 0, stats)
                self.assertGreater(stats.reloads, 0, stats)
            elif mode == "recompute":
                self.assertGreater(stats.evictions, 0, stats)
                self.assertGreater(stats.recomputes, 0, stats)
        return out

    # --- views, strides, shared storages

    def test_saved_slices_and_views(self):
        class Slices(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(32, 96)
                self.out = nn.Linear(16, 8)

            def forward(self, x):
                h = self.lin(x)
                a, b = h[:, :16], h[:, 16:32]      # column slices
                c = h[:, 32::4]                    # a strided slice
                d = h[3:, 64:80]                   # offset rows, columns
                y = a * b.sigmoid() + c.tanh() * 2
                y = y[3:] * d + h.view(-1, 16, 6)[3:, :, 0]
                return self.out(y)

        self.check(Slices, lambda: torch.randn(24, 32))

    def test_permuted_and_transposed_tensors(self):
        class ConvNeXtLike(nn.Module):
            # convnext's block: a depthwise conv, then LayerNorm and the
            # MLP over channels last (a permuted view), then back.
            def __init__(self):
                super().__init__()
                self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
                self.norm = nn.LayerNorm(8)
                self.pw1 = nn.Linear(8, 32)
                self.pw2 = nn.Linear(32, 8)
                self.gamma = nn.Parameter(torch.full((8,), 0.5))

            def forward(self, x):
                y = self.dw(x).permute(0, 2, 3, 1)
                y = self.pw2(F.gelu(self.pw1(self.norm(y))))
                y = (self.gamma * y).permute(0, 3, 1, 2)
                return x + y

        class Transposes(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = ConvNeXtLike()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                y = self.block(x).flatten(2)          # (B, C, HW)
                t = y.transpose(1, 2)                 # non-contiguous
                m = torch.matmul(t, y)                # saves t and y
                p = self.lin(t).permute(2, 0, 1)      # (C, B, HW)
                return m.sum(-1) * 0.01 + (p * p.exp()).sum(0)

        self.check(Transposes, lambda: torch.randn(2, 8, 6, 6))

    def test_two_saved_tensors_sharing_one_storage(self):
        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(16, 48)
                self.proj = nn.Linear(16, 16)

            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, dim=-1)
                w = torch.softmax(q @ k.transpose(-2, -1) / 4, dim=-1)
                a, b = (w @ v).split([6, 10], dim=-1)
                return self.proj(torch.cat([a * b[..., :6], b], -1))

        self.check(Attention, lambda: torch.randn(3, 10, 16))

    # --- in-place updates

    def test_inplace_after_save_raises_as_unmanaged(self):
        lin = nn.Linear(16, 16).to(self.device)

        def output_changed(x):
            s = lin(x).sigmoid()  # saves its output
            s.add_(1)
            return s

        def base_of_a_saved_view_changed(x):
            h = lin(x)
            a = h[:, :8]
            s = a * a  # saves a, a view of h
            h.mul_(2)
            return s

        def changed_through_another_view(x):
            s = lin(x).exp()  # saves its output
            s[:, 0].zero_()
            return s

        def parameter_changed(x):
            # A parameter the store hands back as it is (an optimizer step
            # between two backwards over one graph, as a GAN's may be).
            s = lin(lin(x))  # the second saves the weight, for the first
            with torch.no_grad():
                lin.weight.add_(0)
            return s

        # (Tensors under min_bytes are handed back as they are too.)
        everything_small = dict(FITS, min_bytes=1 << 20)
        for options in (None, FITS, OFFLOAD, RECOMPUTE, everything_small):
            for forward in (output_changed, base_of_a_saved_view_changed,
                            changed_through_another_view, parameter_changed):
                block = (contextlib.nullcontext() if options is None
                         else _managed(lin, **options))
                with self.subTest(options=options, case=forward.__name__):
                    with self.assertRaisesRegex(RuntimeError,
                                                "modified by an inplace"):
                        with block:
                            forward(self.randn(64, 16)).sum().backward()

    def test_legal_inplace_ops_in_models(self):
        def cnn():
            return nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                nn.ReLU(inplace=True),
                nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                nn.LeakyReLU(0.1, inplace=True),
                nn.Flatten(), nn.Linear(8 * 8 * 8, 4))

        self.check(cnn, lambda: torch.randn(4, 3, 8, 8), iterations=2)

        class Residual(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(16, 16)
                self.b = nn.Linear(16, 16)
                self.c = nn.Linear(16, 16)
                self.d = nn.Linear(16, 16)
                self.act = nn.LeakyReLU(0.1, inplace=True)
                self.drop = nn.Dropout(0.5)
                self.gelu = nn.GELU()

            def forward(self, x):
                h = self.act(self.a(x))  # saved after the in-place op
                y = self.b(h)
                y += h  # the call's output changed before anything saves it
                # Dropout saves its mask, not y: recomputing its output
                # would rerun self.b, without the += h.
                z = self.c(self.drop(y))
                return z + self.d(self.gelu(y))

        self.check(Residual, lambda: torch.randn(32, 16), iterations=2)

    # --- graphs

    def test_a_tensor_saved_by_several_nodes(self):
        class Reused(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(16, 16)
                self.w = nn.Parameter(torch.randn(16, 16) / 4)

            def forward(self, x):
                h = self.lin(x)
                return (h * h).sum(1) + (h @ self.w).tanh().sum(1) + \
                    torch.bmm(h[None], h.t()[None]).sum((0, 1))

        self.check(Reused, lambda: torch.randn(32, 16))

    def test_a_released_tensor_needed_twice(self):
        def step(model, x):
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            first = [p.grad.clone() for p in model.parameters()]
            loss.backward()  # the same saved tensors, unpacked again
            return [loss] + first

        self.check(mlp, lambda: torch.randn(16, 32), step)

    def test_a_retained_graph_alive_during_the_next_forward(self):
        # The last step's graph (kept by retain_graph and referenced) still
        # holds its restored saved tensors while the next forward allocates
        # at the addresses they had before they were released: the new
        # tensors must not be taken for them. Equal sizes everywhere, so
        # that the allocator hands those addresses out again.
        kept = []

        def step(model, x):
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
            kept[:] = [loss]
            return [loss]

        def deep():
            layers = []
            for _ in range(6):
                layers += [nn.Linear(32, 32), nn.Tanh()]
            return nn.Sequential(*layers, nn.Linear(32, 4))

        for budget in (256, 2048, 4096):
            for prefetch in (0, 1 << 20):
                self.check(deep, lambda: torch.randn(8, 32), step,
                           iterations=4, modes=("offload", "recompute"),
                           options=dict(budget_bytes=budget,
                                        prefetch_bytes=prefetch))
        kept.clear()

    def test_double_backward(self):
        def step(model, x):
            # A gradient penalty: the gradient with respect to the input,
            # in the graph, then backward through it.
            x = x.clone().requires_grad_()
            out = model(x)
            g, = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.square().mean() + g.square().sum()
            loss.backward()
            return [loss, g]

        def smooth():
            return nn.Sequential(nn.Linear(16, 32), nn.Tanh(),
                                 nn.Linear(32, 32), nn.Softplus(),
                                 nn.Linear(32, 4))

        self.check(smooth, lambda: torch.randn(32, 16), step, iterations=2)

    def test_autocast_bfloat16(self):
        def step(model, x):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                out = model(x)
                loss = out.float().square().mean()
            loss.backward()
            return [loss, out]

        def model():
            return nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                 nn.Linear(64, 64), nn.Tanh(),
                                 nn.Dropout(0.2), nn.Linear(64, 8))

        self.check(model, lambda: torch.randn(16, 32), step, iterations=2)

    def test_no_grad_sections_save_nothing(self):
        model = mlp().to(self.device)
        with _managed(model, **OFFLOAD) as manager:
            with torch.no_grad():
                model(self.randn(8, 32))
        stats = manager.stats()
        self.assertEqual((stats.saved_tensors, stats.offloads,
                          stats.recorded_calls), (0, 0, 0), stats)

        class Frozen(nn.Module):
            def __init__(self):
                super().__init__()
                self.backbone = mlp()
                self.head = nn.Sequential(nn.Linear(8, 32), nn.ReLU(),
                                          nn.Linear(32, 4))

            def forward(self, x):
                with torch.no_grad():
                    f = self.backbone(x)
                return self.head(f * 2)

        self.check(Frozen, lambda: torch.randn(16, 32), iterations=2)

    # --- recompute: randomness and buffers

    def test_dropout_draws_the_same_mask(self):
        def model():
            return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5),
                                 nn.Linear(64, 64), nn.GELU(),
                                 nn.Dropout(0.3), nn.Linear(64, 8))

        self.check(model, lambda: torch.randn(16, 32), iterations=3)

    def test_batchnorm_statistics_after_recompute(self):
        def model():
            return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64),
                                 nn.GELU(), nn.Linear(64, 64),
                                 nn.BatchNorm1d(64), nn.Sigmoid(),
                                 nn.Linear(64, 8))

        stats = self.check(model, lambda: torch.randn(16, 32), iterations=3)
        self.assertGreater(stats["recompute"].recomputes, 0)

    def test_modules_returning_their_input_or_a_view_of_it(self):
        class Narrow(nn.Module):
            def forward(self, x):
                return x[:, 4:]

        class Reshape(nn.Module):
            def forward(self, x):
                return x.view(x.shape[0], 4, -1).transpose(1, 2)

        def model():
            return nn.Sequential(nn.Linear(16, 36), nn.Identity(), Narrow(),
                                 nn.Tanh(), Reshape(), nn.Identity(),
                                 nn.Flatten(), nn.Linear(32, 4))

        self.check(model, lambda: torch.randn(32, 16), iterations=2)

    # --- one block around the training loop

    def test_many_iterations_in_one_block(self):
        for mode in ("offload", "recompute", "auto"):
            options = dict(budget_bytes=12 << 10, policy=mode,
                           prefetch_bytes=1 << 30)
            expected = self.run_case(mlp, lambda: torch.randn(16, 32),
                                     iterations=5)
            per_iteration, managers = [], []

            def on_step(manager):
                managers[:] = [manager]
                per_iteration.append(manager.stats())

            got = self.run_case(mlp, lambda: torch.randn(16, 32),
                                options=options, iterations=5,
                                on_step=on_step)
            self.assert_identical(expected, got, mode)
            stats, manager = got[2], managers[0]
            self.assertEqual(stats.iterations, 5, stats)
            self.assertEqual(
                [s.iterations for s in per_iteration], [1, 2, 3, 4, 5])
            self.assertGreater(stats.offloads + stats.evictions, 0, mode)
            if self.device.type == "cuda":
                self.assertEqual(stats.host_waits, 0, stats)
            if mode == "offload":
                # Iterations after the first reload ahead in the order the
                # one before unpacked.
                later = [b.prefetches - a.prefetches
                         for a, b in zip(per_iteration, per_iteration[1:])]
                self.assertTrue(all(n > 0 for n in later),
                                f"prefetches per iteration: {later}")
                self.assertTrue(manager.plan.unpack_order)
            if mode == "auto":
                # Recording begins in the iteration after one that had to
                # release.
                self.assertEqual(per_iteration[0].recorded_calls, 0)
                self.assertGreater(stats.recorded_calls, 0)

    def test_backward_after_the_block(self):
        def forward_only(options):
            torch.manual_seed(0)
            model = mlp().to(self.device)
            x = self.randn(16, 32)
            torch.manual_seed(1)
            block = (contextlib.nullcontext() if options is None
                     else _managed(model, **options))
            with block as manager:
                loss = model(x).square().mean()
            loss.backward()  # the block has ended
            grads = [p.grad for p in model.parameters()]
            return loss, grads, manager

        loss, grads, _ = forward_only(None)
        for mode, options in MODES.items():
            m_loss, m_grads, manager = forward_only(options)
            self.assertTrue(torch.equal(loss, m_loss), mode)
            for a, b in zip(grads, m_grads):
                self.assertTrue(torch.equal(a, b), mode)
            # Released in the block, restored by the backward after it.
            in_block, c = manager.stats(), manager.store.counters
            self.assertEqual((in_block.reloads, in_block.recomputes), (0, 0))
            if mode == "offload":
                self.assertGreater(in_block.offloads, 0)
                self.assertGreater(c.reloads, 0)
            if mode == "recompute":
                self.assertGreater(in_block.evictions, 0)
                self.assertGreater(c.recomputes, 0)
            del m_loss
            gc.collect()
            # Everything was handed back once autograd let go of it.
            self.assertEqual((c.resident_bytes, c.host_bytes), (0, 0), mode)
            self.assertEqual(manager.store.groups, {}, mode)


class CpuCorrectnessTest(Cases, unittest.TestCase):
    """The cases on the CPU."""


def _skip_cases_without_determinism(cls):
    """Wraps the class's tests: a case that reaches an op without a
    deterministic CUDA implementation is skipped, naming the op, instead
    of failing (managed and unmanaged could not be compared bit for bit)."""

    def wrap(test):
        @functools.wraps(test)
        def deterministic_or_skip(self):
            try:
                return test(self)
            except RuntimeError as e:
                if NOT_DETERMINISTIC not in str(e):
                    raise
                first = str(e).strip().splitlines()[0]
                self.skipTest("cannot be deterministic on CUDA: "
                              f"{first.split(', but you set')[0]}")
        return deterministic_or_skip

    for name in dir(cls):
        if name.startswith("test_"):
            setattr(cls, name, wrap(getattr(cls, name)))
    return cls


@unittest.skipUnless(CUDA, NO_CUDA)
@_skip_cases_without_determinism
class CudaCorrectnessTest(Cases, unittest.TestCase):
    """The cases on the GPU, deterministic (torch.use_deterministic_
    algorithms, cuDNN without benchmarking, cuBLAS's fixed workspace), and
    what only CUDA has: the copy stream and its events."""

    device = torch.device("cuda")

    @classmethod
    def setUpClass(cls):
        cudnn = torch.backends.cudnn
        cls._before = (torch.are_deterministic_algorithms_enabled(),
                       cudnn.benchmark, cudnn.deterministic)
        torch.use_deterministic_algorithms(True)
        cudnn.benchmark = False
        cudnn.deterministic = True

    @classmethod
    def tearDownClass(cls):
        cudnn = torch.backends.cudnn
        enabled, cudnn.benchmark, cudnn.deterministic = cls._before
        torch.use_deterministic_algorithms(enabled)

    def test_offload_never_waits_on_the_host(self):
        # 13 saved storages of 512 KiB a step, a budget of about half of
        # them (above what the process holds when the block begins),
        # several iterations in one block: offloads on the copy stream,
        # reloads ahead of use, and never a host wait; after the
        # synchronize that ends the run, the results of the unmanaged run.
        def wide():
            layers = []
            for _ in range(6):
                layers += [nn.Linear(512, 512), nn.GELU()]
            return nn.Sequential(*layers, nn.Linear(512, 8))

        def inputs():
            return torch.randn(256, 512)

        iterations = 4
        expected = self.run_case(wide, inputs, iterations=iterations)
        per_iteration = []
        got = self.run_case(
            wide, inputs, iterations=iterations,
            options=dict(budget_bytes=3 << 20, policy="offload",
                         prefetch_bytes=1 << 30),
            on_step=lambda manager: per_iteration.append(manager.stats()))
        self.assert_identical(expected, got, "offload")
        stats = got[2]
        if os.environ.get("DELTAD_TEST_VERBOSE"):
            print(f"\n{self.id()}: {stats}")
        self.assertEqual(stats.host_waits, 0, stats)
        self.assertEqual(stats.iterations, iterations, stats)
        self.assertEqual(stats.evictions, 0, stats)
        self.assertGreater(stats.offloads, 0, stats)
        self.assertGreater(stats.reloads, 0, stats)
        self.assertGreater(stats.prefetches, 0, stats)
        later = [b.prefetches - a.prefetches
                 for a, b in zip(per_iteration, per_iteration[1:])]
        self.assertTrue(all(n > 0 for n in later),
                        f"prefetches per iteration: {later}")


if __name__ == "__main__":
    unittest.main()
