"""deltad.torch.managed when nothing needs releasing: a training step costs
no host wait and at most one daemon round trip, as the manager counts them
(ManagerStats), with the block entered once around the loop and once per
step, in-process and with a daemon; and bench/torch_overhead.py --smoke
runs and writes its section. (Its timing targets live in the benchmark
only: nothing here is timed.)"""

import os
import subprocess
import sys
import tempfile
import unittest

import torch

import deltad.torch
from models import small_mlp
from test_torch_managed import daemon_or_skip

STEPS = 4
BUDGET = 64 << 20  # far above what a step of small_mlp at batch 32 saves
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "bench", "torch_overhead.py")
BEGIN = "<!-- torch_overhead:begin -->"
END = "<!-- torch_overhead:end -->"


def step(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().mean().backward()


class StepCostTest(unittest.TestCase):

    def setUp(self):
        torch.manual_seed(0)
        self.model = small_mlp()
        self.x = torch.randn(32, 256)

    def managed(self, socket):
        return deltad.torch.managed(self.model, budget_bytes=BUDGET,
                                    socket=socket, min_bytes=1)

    def around_the_loop(self, socket):
        with self.managed(socket) as manager:
            for _ in range(STEPS):
                step(self.model, self.x)
        return [manager.stats()]

    def per_step(self, socket):
        stats = []
        for _ in range(STEPS):
            with self.managed(socket) as manager:
                step(self.model, self.x)
            stats.append(manager.stats())
        return stats

    def check(self, stats, trips, connected):
        """`stats`: the blocks' ManagerStats over STEPS steps, which made
        `trips` round trips to the daemon in all."""
        total = {f: sum(getattr(s, f) for s in stats) for f in
                 ("host_waits", "offloads", "evictions", "recomputes",
                  "reloads", "daemon_round_trips", "iterations",
                  "saved_tensors", "overshoots")}
        self.assertEqual(total["iterations"], STEPS)
        self.assertGreater(total["saved_tensors"], 0)  # through the store
        for s in stats:
            self.assertLessEqual(2 * s.peak_device_bytes, s.budget_bytes)
            self.assertEqual(s.connected, connected)
        self.assertEqual(total["host_waits"], 0)
        self.assertEqual((total["offloads"], total["evictions"],
                          total["recomputes"], total["reloads"],
                          total["overshoots"]), (0, 0, 0, 0, 0))
        self.assertEqual(total["daemon_round_trips"], trips)

    def test_in_process_around_the_loop(self):
        self.check(self.around_the_loop(None), 0, False)

    def test_in_process_per_step(self):
        self.check(self.per_step(None), 0, False)

    def test_daemon_around_the_loop_and_per_step(self):
        # The process's session is opened by its first block and kept.
        with daemon_or_skip(256 << 20) as socket:
            self.check(self.around_the_loop(socket), 1, True)
            self.check(self.per_step(socket), 0, True)
        # A second daemon: its first block opens the session again.
        with daemon_or_skip(256 << 20) as socket:
            stats = self.per_step(socket)
        self.check(stats, 1, True)

    def test_daemon_per_step_with_one_session(self):
        """A trainer that enters the block each step keeps one session
        open (client=): the blocks then make no round trip at all."""
        with daemon_or_skip(256 << 20) as socket:
            with deltad.Client(socket=socket, budget_bytes=BUDGET,
                               device_memory_bytes=BUDGET) as client:
                stats = []
                for _ in range(STEPS):
                    with deltad.torch.managed(
                            self.model, budget_bytes=BUDGET, client=client,
                            min_bytes=1) as manager:
                        step(self.model, self.x)
                    stats.append(manager.stats())
                self.check(stats, 0, True)


class BenchSmokeTest(unittest.TestCase):

    def test_smoke_run_prints_its_table_and_updates_the_doc(self):
        with tempfile.TemporaryDirectory(prefix="torch_overhead-") as d:
            doc = os.path.join(d, "BENCHMARKS.md")
            with open(doc, "w") as f:
                f.write(f"# Benchmarks\n\nabove\n\n{BEGIN}\nan old run\n"
                        f"{END}\n\nbelow\n")
            proc = subprocess.run(
                [sys.executable, SCRIPT, "--smoke", "--profile", "mlp",
                 "--update_doc", doc],
                capture_output=True, text=True, timeout=240)
            with open(doc) as f:
                text = f.read()
        self.assertEqual(proc.returncode, 0,
                         proc.stdout[-3000:] + proc.stderr[-3000:])
        out = proc.stdout
        self.assertIn("## torch_overhead:", out)
        for model in ("mlp", "cnn", "transformer"):
            self.assertIn(f"### {model}\n", out)
        self.assertIn("| managed | managed | once around the loop | 1 B |",
                      out)
        self.assertIn("| managed/step | managed | once per step | 1 B |",
                      out)
        self.assertIn("### Targets", out)
        self.assertIn("### Profile: mlp", out)
        if os.environ.get("DELTAD_BINARY"):
            self.assertIn("| daemon/step |", out)
        self.assertNotIn("**Errors:**", out)
        # The section between the markers, the rest of the file kept.
        self.assertNotIn("an old run", text)
        self.assertTrue(text.startswith("# Benchmarks\n\nabove\n\n" + BEGIN))
        self.assertTrue(text.endswith(f"{END}\n\nbelow\n"))
        self.assertIn(out, text)


if __name__ == "__main__":
    unittest.main()
