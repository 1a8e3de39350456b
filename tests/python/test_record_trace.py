"""deltad.trace.record_trace on the CPU: one training iteration of a small
CNN and of a transformer encoder layer becomes a trace file in the
project's text format, which policy_bench ($DELTAD_POLICY_BENCH) reads and
replays under every policy."""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import torch

import deltad.torch
from deltad.trace import TraceSummary, record_trace
from models import small_cnn, small_transformer


def ops_of(text):
    """(operator, phase) of every op line."""
    return [tuple(line.split()[1:3]) for line in text.splitlines()
            if line.startswith("op ")]


def constants_of(text):
    """{name: bytes} of the const lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith("const "):
            _, name, nbytes = line.split()
            out[name] = int(nbytes)
    return out


class RecordTraceTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="deltad-trace-")
        torch.manual_seed(0)
        cls.cnn = small_cnn()
        cls.cnn_path = os.path.join(cls.dir, "cnn.trace")
        cls.cnn_summary = record_trace(cls.cnn, torch.randn(4, 3, 32, 32),
                                       cls.cnn_path, name="recorded-cnn")
        with open(cls.cnn_path) as f:
            cls.cnn_text = f.read()
        cls.transformer = small_transformer()
        cls.transformer_path = os.path.join(cls.dir, "transformer.trace")
        cls.transformer_summary = record_trace(
            cls.transformer, (torch.randn(4, 64, 64),), cls.transformer_path,
            name="recorded-transformer")
        with open(cls.transformer_path) as f:
            cls.transformer_text = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def check_trace(self, text, summary, name):
        self.assertTrue(text.startswith("deltad-trace 1\n"), text[:40])
        self.assertIn(f"\nname {name}\n", text)
        ops = ops_of(text)
        phases = [phase for _, phase in ops]
        self.assertIn("fwd", phases)
        self.assertIn("bwd", phases)
        # The forward pass, then the backward pass.
        self.assertEqual(phases, sorted(phases, key=lambda p: p == "bwd"))
        self.assertEqual(summary.ops, len(ops))
        self.assertEqual(summary.forward_ops, phases.count("fwd"))
        self.assertGreater(summary.peak_bytes, 0)
        self.assertGreater(summary.compute_ns, 0)
        # Value names hold no whitespace, ',', ':' or '='.
        for line in text.splitlines():
            for key, items in re.findall(r" (in|out|alias|mut)=(\S+)", line):
                for item in items.split(","):
                    self.assertRegex(item.split(":")[0], r"^[^\s,:=]+$")
        return ops

    def test_the_cnn_has_forward_and_backward_convolutions(self):
        ops = self.check_trace(self.cnn_text, self.cnn_summary,
                               "recorded-cnn")
        self.assertIsInstance(self.cnn_summary, TraceSummary)
        self.assertEqual(self.cnn_summary.path, self.cnn_path)
        forward = [op for op, phase in ops if phase == "fwd"]
        backward = [op for op, phase in ops if phase == "bwd"]
        self.assertEqual(
            sum(1 for op in forward if "convolution" in op), 3, forward)
        self.assertEqual(
            sum(1 for op in backward if "convolution_backward" in op), 3,
            backward)
        self.assertTrue(any("max_pool2d" in op for op in forward), forward)

    def test_the_transformer_has_forward_and_backward_ops(self):
        ops = self.check_trace(self.transformer_text,
                               self.transformer_summary,
                               "recorded-transformer")
        names = " ".join(op for op, _ in ops)
        self.assertIn("softmax", names)
        self.assertIn("layer_norm", names)

    def test_parameters_and_inputs_are_constants(self):
        for model, text in ((self.cnn, self.cnn_text),
                            (self.transformer, self.transformer_text)):
            constants = constants_of(text)
            for name, p in model.named_parameters():
                self.assertEqual(constants.get(f"p.{name}"),
                                 p.numel() * p.element_size(), name)
            self.assertIn("in0", constants)
            # Constants come before the first op.
            first_op = text.index("\nop ")
            self.assertLess(text.rindex("\nconst "), first_op)

    def test_the_model_gradients_are_left_as_they_were(self):
        for p in self.cnn.parameters():
            self.assertIsNone(p.grad)
        model = small_cnn()
        grads = [torch.full_like(p, 3.0) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        record_trace(model, torch.randn(2, 3, 32, 32),
                     os.path.join(self.dir, "grads.trace"))
        for p, g in zip(model.parameters(), grads):
            self.assertIs(p.grad, g)

    def test_in_place_updates_and_views(self):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
            torch.nn.Linear(8, 2))
        path = os.path.join(self.dir, "inplace.trace")
        summary = record_trace(model, torch.randn(4, 8), path,
                               loss_fn=lambda out: out.square().mean())
        with open(path) as f:
            text = f.read()
        self.assertRegex(text, r"\nop aten\.relu_ fwd \d+ in=(\S+) mut=\1\n")
        self.assertRegex(text, r" alias=\S+:p\.2\.weight")  # its transpose
        self.assertEqual(summary.name, "sequential-b4")

    def test_min_bytes_leaves_small_storages_out(self):
        path = os.path.join(self.dir, "min.trace")
        record_trace(small_cnn(), torch.randn(4, 3, 32, 32), path,
                     min_bytes=4096)
        with open(path) as f:
            constants = constants_of(f.read())
        self.assertIn("p.8.weight", constants)
        self.assertNotIn("p.0.bias", constants)
        self.assertTrue(all(b >= 4096 for b in constants.values()))

    def test_policy_bench_replays_the_recorded_traces(self):
        bench = os.environ.get("DELTAD_POLICY_BENCH")
        if not bench:
            raise unittest.SkipTest("DELTAD_POLICY_BENCH is not set")
        for path, name in ((self.cnn_path, "recorded-cnn"),
                           (self.transformer_path, "recorded-transformer")):
            with self.subTest(name):
                run = subprocess.run(
                    [bench, f"--trace_files={path}", "--models=",
                     "--traces=/nonexistent", "--ratios=0.5,1.0"],
                    capture_output=True, text=True, timeout=60)
                self.assertEqual(run.returncode, 0, run.stderr)
                self.assertIn(f"**{name}** (recorded", run.stdout)
        bad = os.path.join(self.dir, "bad.trace")
        with open(bad, "w") as f:
            f.write("deltad-trace 1\nop aten.relu fwd 10 in=nothing\n")
        run = subprocess.run(
            [bench, f"--trace_files={bad}", "--models=",
             "--traces=/nonexistent", "--ratios=1.0"],
            capture_output=True, text=True, timeout=60)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn(f"{bad}:2: undefined name 'nothing'", run.stderr)

    def test_bad_arguments_are_refused(self):
        path = os.path.join(self.dir, "never.trace")
        with self.assertRaises(TypeError):
            record_trace(object(), torch.randn(2, 3, 32, 32), path)
        with self.assertRaises(TypeError):
            record_trace(small_cnn(), 3, path)
        with self.assertRaises(ValueError):
            record_trace(small_cnn(), torch.randn(2, 3, 32, 32), path,
                         name="two words")
        with self.assertRaises(ValueError):
            record_trace(small_cnn(), torch.randn(2, 3, 32, 32), path,
                         min_bytes=-1)
        self.assertFalse(os.path.exists(path))

    def test_reexported_from_deltad_torch(self):
        if not hasattr(deltad.torch, "record_trace"):
            raise unittest.SkipTest("deltad.torch does not re-export it yet")
        path = os.path.join(self.dir, "reexported.trace")
        summary = deltad.torch.record_trace(
            small_cnn(), torch.randn(2, 3, 32, 32), path, name="again")
        self.assertIsInstance(summary, TraceSummary)
        with open(path) as f:
            self.assertTrue(
                f.read().startswith("deltad-trace 1\nname again\n"))


if __name__ == "__main__":
    unittest.main()
