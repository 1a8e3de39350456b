"""A managed block entered every step reuses what its model's last block
built (store, recorder, hooks) once nothing of that block is saved any
more: each block still reports its own stats, a block whose graph outlives
it is never reused under it, other settings get their own, and the model
is not kept alive by what waits for its next block."""

import gc
import unittest
import weakref

import torch

import deltad.torch
from models import small_mlp


def step(model, x):
    model(x).square().mean().backward()


class BlockReuseTest(unittest.TestCase):

    def setUp(self):
        torch.manual_seed(0)
        self.model = small_mlp()
        self.x = torch.randn(8, 256)

    def managed(self, **options):
        options.setdefault("budget_bytes", 1 << 30)
        return deltad.torch.managed(self.model, socket=None, min_bytes=1,
                                    **options)

    def test_a_block_per_step_reuses_the_last_blocks_engine(self):
        with self.managed() as first:
            step(self.model, self.x)
        with self.managed() as second:
            step(self.model, self.x)
        self.assertIs(second._engine, first._engine)
        self.assertIs(second.store, first.store)

    def test_each_reused_block_reports_its_own_work(self):
        with self.managed() as first:
            step(self.model, self.x)
        saved = first.stats().saved_tensors
        self.assertGreater(saved, 0)
        with self.managed() as second:
            step(self.model, self.x)
            step(self.model, self.x)
        self.assertIs(second._engine, first._engine)
        self.assertEqual(first.stats().saved_tensors, saved)
        self.assertEqual(first.stats().iterations, 1)
        self.assertEqual(second.stats().saved_tensors, 2 * saved)
        self.assertEqual(second.stats().iterations, 2)
        self.assertEqual(second.stats().device_bytes, 0)

    def test_a_graph_that_outlives_its_block_keeps_its_engine_to_itself(self):
        with self.managed() as first:
            loss = self.model(self.x).square().mean()
        with self.managed() as second:
            step(self.model, self.x)
        self.assertIsNot(second._engine, first._engine)
        # The first block's graph still unpacks through its own store.
        loss.backward()
        self.assertEqual(first.stats().saved_tensors,
                         second.stats().saved_tensors)

    def test_other_settings_get_an_engine_of_their_own(self):
        with self.managed() as first:
            step(self.model, self.x)
        with self.managed(budget_bytes=1 << 29) as second:
            step(self.model, self.x)
        self.assertIsNot(second._engine, first._engine)
        self.assertEqual(second.stats().budget_bytes, 1 << 29)

    def test_a_reused_engine_releases_under_its_budget_again(self):
        with self.managed() as first:
            step(self.model, self.x)
        peak = first.stats().peak_device_bytes
        small = deltad.torch.managed(self.model, socket=None, min_bytes=1,
                                     budget_bytes=peak // 2,
                                     policy="offload")
        for _ in range(3):
            with small as m:
                step(self.model, self.x)
            small = deltad.torch.managed(self.model, socket=None,
                                         min_bytes=1,
                                         budget_bytes=peak // 2,
                                         policy="offload")
            self.assertGreater(m.stats().offloads, 0)
            self.assertLessEqual(m.stats().peak_device_bytes, peak)

    def test_the_waiting_engine_does_not_keep_the_model_alive(self):
        model = small_mlp()
        with deltad.torch.managed(model, socket=None, min_bytes=1) as m:
            step(model, self.x)
        engine = weakref.ref(m._engine)
        alive = weakref.ref(model)
        del model, m
        gc.collect()
        self.assertIsNone(alive())
        self.assertIsNone(engine())


if __name__ == "__main__":
    unittest.main()
