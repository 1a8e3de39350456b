"""The budget deltad.torch gives saved activations on CUDA, without a GPU:
the rule that follows each iteration's peak (deltad.budget), and
_Engine._on_iteration against stand-ins for torch.cuda's statistics and
deltad's allocator."""

import unittest

import torch

import deltad.budget
import deltad.torch


class CudaBudgetWithDeltadAllocatorTest(unittest.TestCase):
    """On PyTorch 2.0-2.7 deltad's allocator replaces PyTorch's
    (allocator mode "global"), and torch.cuda.memory_allocated then raises
    ("CUDAPluggableAllocator does not yet support getDeviceStats"): the
    budget of an iteration must come from the allocator's own count. (A
    stand-in for CUDA: this checks _Engine._on_iteration alone.)"""

    def test_the_iteration_budget_reads_the_allocators_count(self):
        import deltad.allocator as allocator

        def no_stats(device=None):
            raise RuntimeError("CUDAPluggableAllocator does not yet "
                               "support getDeviceStats.")

        stand_in = engine_stand_in()
        saved = (torch.cuda.memory_allocated, allocator.mode,
                 allocator.stats)
        torch.cuda.memory_allocated = no_stats
        allocator.mode = lambda: "global"
        allocator.stats = lambda: allocator.AllocatorStats(
            attached=True, allocated_bytes=100 << 20,
            device_bytes=100 << 20, peak_device_bytes=100 << 20,
            budget_bytes=1 << 30, blocks=1)
        saved_reset, allocator.reset_peak = allocator.reset_peak, list
        try:
            deltad.torch._Engine._on_iteration(stand_in)
        finally:
            (torch.cuda.memory_allocated, allocator.mode,
             allocator.stats) = saved
            allocator.reset_peak = saved_reset
        self.assertEqual(stand_in.store.budget,
                         (1 << 30) - (100 << 20) - (1 << 20))

    def test_the_budget_follows_the_allocators_peak_per_iteration(self):
        import deltad.allocator as allocator
        stand_in = engine_stand_in()
        stand_in.reserve = 256 << 20
        peak = [0]
        resets = []
        saved = (allocator.mode, allocator.stats, allocator.reset_peak)
        allocator.mode = lambda: "global"
        allocator.stats = lambda: allocator.AllocatorStats(
            attached=True, allocated_bytes=100 << 20,
            device_bytes=100 << 20, peak_device_bytes=1 << 30,
            budget_bytes=1 << 30, blocks=1, peak_allocated_bytes=peak[0])
        allocator.reset_peak = lambda: resets.append(stand_in.iterations)
        store = stand_in.store
        on_iteration = deltad.torch._Engine._on_iteration
        try:
            first = first_iteration(self, stand_in)
            # It released, and its peak (the allocator's, restarted at the
            # iteration's start) came 32 MiB over the budget less 1/16.
            store.released_last_iteration = True
            peak[0] = (1 << 30) - (1 << 26) + (32 << 20)
            on_iteration(stand_in)
            self.assertEqual(store.budget, first - (32 << 20))
            self.assertEqual(resets, [1, 2])
        finally:
            allocator.mode, allocator.stats, allocator.reset_peak = saved


def first_iteration(test, stand_in):
    """Runs the first iteration's start (100 MiB held, a 256 MiB reserve)
    and returns its budget for saved activations: the first guess."""
    deltad.torch._Engine._on_iteration(stand_in)
    test.assertEqual(stand_in.store.budget,
                     (1 << 30) - (100 << 20) - (256 << 20))
    return stand_in.store.budget


def engine_stand_in():
    """What _Engine._on_iteration reads of its engine, on "cuda"."""
    import types
    return types.SimpleNamespace(
        iterations=0, peak_from=None, peak_restart=None,
        requested_budget=1 << 30, client=None, cuda=True,
        device=torch.device("cuda", 0), reserve=1 << 20,
        store=types.SimpleNamespace(
            budget=0, released_last_iteration=False, budget_used=None,
            budget_if_same=None, pytorch_allocator=False, in_flight_cap=0),
        policy="offload", plan=types.SimpleNamespace(pressure=False))


class CudaBudgetFromThePeakTest(unittest.TestCase):
    """Under PyTorch's allocator (its statistics work) each iteration's
    budget for saved activations follows the last one's peak
    (deltad.budget._next_saved_budget), read at the next one's start,
    PyTorch's peak statistics restarting there. A stand-in for CUDA."""

    def test_the_second_iteration_is_given_what_the_first_left(self):
        import deltad.allocator as allocator
        stand_in = engine_stand_in()
        stand_in.reserve = 256 << 20
        calls = []
        peak = [0]
        saved = (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
                 torch.cuda.reset_peak_memory_stats, allocator.mode)
        torch.cuda.memory_allocated = lambda device=None: 100 << 20
        torch.cuda.max_memory_allocated = lambda device=None: peak[0]
        torch.cuda.reset_peak_memory_stats = \
            lambda device=None: calls.append("reset")
        allocator.mode = lambda: None
        store = stand_in.store
        on_iteration = deltad.torch._Engine._on_iteration
        try:
            first = first_iteration(self, stand_in)
            self.assertIsNone(store.budget_if_same)
            # It released, and peaked 64 MiB under the budget less 1/16:
            # 64 MiB more if the next iteration is alike (the store checks
            # at its first storage past the first guess).
            store.released_last_iteration = True
            peak[0] = (1 << 30) - (1 << 26) - (64 << 20)
            on_iteration(stand_in)
            self.assertEqual(store.budget, first)
            self.assertEqual(store.budget_if_same, first + (64 << 20))
            self.assertEqual(calls, ["reset", "reset"])
            # It peaked 32 MiB over: 32 MiB less, at once.
            peak[0] = (1 << 30) - (1 << 26) + (32 << 20)
            on_iteration(stand_in)
            self.assertEqual(store.budget, first - (32 << 20))
            self.assertIsNone(store.budget_if_same)
            # The same peak again, with up to 16 MiB freed under copies
            # still running, which the peak does not count: 32 + 16 MiB
            # less than the last iteration's bytes.
            store.pytorch_allocator = True
            store.in_flight_cap = 16 << 20
            on_iteration(stand_in)
            self.assertEqual(store.budget, first - (32 << 20) - (48 << 20))
        finally:
            (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
             torch.cuda.reset_peak_memory_stats, allocator.mode) = saved


class TwoBlocksOnOneDeviceTest(unittest.TestCase):
    """PyTorch's peak statistics are the device's: where two models train
    in turn, each in its own block, each block restarts them at its
    iteration's start, so the peak a block reads at its next one is the
    other model's. A block then keeps its first guess."""

    def test_a_peak_restarted_by_another_block_is_not_learned_from(self):
        import deltad.allocator as allocator
        a, b = engine_stand_in(), engine_stand_in()
        for e in (a, b):
            e.reserve = 256 << 20
            e.store.released_last_iteration = True
        peak = [0]
        saved = (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
                 torch.cuda.reset_peak_memory_stats, allocator.mode)
        torch.cuda.memory_allocated = lambda device=None: 100 << 20
        torch.cuda.max_memory_allocated = lambda device=None: peak[0]
        torch.cuda.reset_peak_memory_stats = lambda device=None: None
        allocator.mode = lambda: None
        on_iteration = deltad.torch._Engine._on_iteration
        try:
            first = first_iteration(self, a)
            first_iteration(self, b)
            # b's iteration peaked far over: not a's to learn from.
            peak[0] = 2 << 30
            a.store.released_last_iteration = True
            on_iteration(a)
            self.assertEqual(a.store.budget, first)
            # Alone again, a learns from its own iteration's peak.
            peak[0] = (1 << 30) - (1 << 26) + (32 << 20)
            on_iteration(a)
            self.assertEqual(a.store.budget, first - (32 << 20))
        finally:
            (torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
             torch.cuda.reset_peak_memory_stats, allocator.mode) = saved


class SavedBudgetRuleTest(unittest.TestCase):
    """On CUDA the bytes saved activations get follow what the last
    iteration's peak left of the budget (deltad.budget._next_saved_budget):
    a fixed reserve for temporaries was short for GPT-2's logits and
    generous elsewhere."""

    B, OTHERS, RESERVE = 1600, 100, 200  # margin: B // 16 = 100

    def next(self, last, peak, released):
        return deltad.budget._next_saved_budget(
            self.B, self.OTHERS, self.RESERVE, last, peak, released)

    def test_the_first_iteration_gets_the_budget_less_others_and_reserve(self):
        self.assertEqual(self.next(None, None, False), 1300)

    def test_where_the_store_released_the_peak_is_led_to_the_margin(self):
        # It peaked at 1700 with 1100 for saved activations, 200 over the
        # budget less the margin: the next gets 200 less.
        self.assertEqual(self.next(1100, 1700, True), 900)
        # Temporaries smaller than the reserve: the bytes go to the store.
        self.assertEqual(self.next(1300, 1400, True), 1400)
        # At most what the budget leaves beside the others and the margin.
        self.assertEqual(self.next(1350, 1360, True), 1400)

    def test_without_releases_it_keeps_its_bytes_unless_the_peak_was_close(
            self):
        self.assertEqual(self.next(1400, 1200, False), 1400)
        self.assertEqual(self.next(1000, 1200, False), 1300)  # the default
        # Held less than its bytes, but the peak left less than the margin.
        self.assertEqual(self.next(1300, 1600, False), 1200)

    def test_memory_the_peak_cannot_show_is_kept_clear_of(self):
        # As where the store released, with 50 freed under copies still
        # running that PyTorch's peak does not count.
        self.assertEqual(deltad.budget._next_saved_budget(
            self.B, self.OTHERS, self.RESERVE, 1100, 1700, True, unseen=50),
            850)

    def test_never_below_zero(self):
        self.assertEqual(self.next(100, 3000, True), 0)

    def test_a_peak_below_what_the_store_held_is_not_the_iterations(self):
        # It released at 1300 beside 100 of others: a peak of 600 can only
        # be what PyTorch counted since someone restarted its statistics.
        self.assertEqual(self.next(1300, 600, True), 1300)  # the default
        self.assertEqual(self.next(1300, 1300, True), 1400)  # plausible


if __name__ == "__main__":
    unittest.main()
