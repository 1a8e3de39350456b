"""bench/torch_bench.py --smoke on the CPU: tiny models through every mode
(none, checkpoint, save_on_cpu, deltad), the largest-batch search, the
timed runs, and, when $DELTAD_POLICY_BENCH is set, the recorded traces
replayed in the simulator; the Markdown section it writes into a document
between its markers."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import types
import weakref
import unittest

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "bench", "torch_bench.py")
BEGIN = "<!-- torch_bench:begin -->"
END = "<!-- torch_bench:end -->"
MODES = ("none", "checkpoint", "save_on_cpu", "deltad")


def run(*args, timeout=240):
    return subprocess.run([sys.executable, SCRIPT, *args],
                          capture_output=True, text=True, timeout=timeout)


def model_section(text, model):
    """The ### section of one model, up to the next heading."""
    match = re.search(rf"^### {model}\n(.*?)(?=^### |\Z)", text,
                      re.S | re.M)
    return match.group(1) if match else None


class TorchBenchSmokeTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="torch_bench-")
        cls.doc = os.path.join(cls.dir.name, "BENCHMARKS.md")
        with open(cls.doc, "w") as f:
            f.write(f"# Benchmarks\n\nabove\n\n{BEGIN}\nan old run\n{END}\n"
                    f"\nbelow\n")
        cls.policy_bench = os.environ.get("DELTAD_POLICY_BENCH")
        args = ["--device", "cpu", "--smoke", "--update_doc", cls.doc]
        if cls.policy_bench:
            args += ["--policy_bench", cls.policy_bench]
        cls.proc = run(*args)
        with open(cls.doc) as f:
            cls.text = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def test_exits_zero(self):
        self.assertEqual(self.proc.returncode, 0,
                         self.proc.stdout[-3000:] + self.proc.stderr[-3000:])

    def test_the_section_replaces_the_old_one_between_markers(self):
        self.assertEqual(self.text.count(BEGIN), 1)
        self.assertEqual(self.text.count(END), 1)
        self.assertLess(self.text.index(BEGIN), self.text.index(END))
        self.assertNotIn("an old run", self.text)
        self.assertTrue(self.text.startswith("# Benchmarks\n\nabove\n"))
        self.assertTrue(self.text.endswith("\nbelow\n"))
        section = self.text[self.text.index(BEGIN):self.text.index(END)]
        self.assertIn("## torch_bench", section)
        self.assertRegex(section, r"\nCommand: `bench/torch_bench\.py "
                         r"[^`]*--smoke[^`]*`")
        self.assertRegex(section, r"\nMachine: CPU: ")
        self.assertRegex(section, r"\nDate: \d{4}-\d\d-\d\d")
        self.assertIn(f"torch {torch.__version__}", section)
        # What it printed is what it wrote.
        self.assertIn(section[len(BEGIN) + 1:], self.proc.stdout)

    def test_a_row_per_model_and_mode(self):
        for model in ("resnet50", "gpt2"):
            with self.subTest(model):
                part = model_section(self.text, model)
                self.assertIsNotNone(part, f"no ### {model} section")
                if model == "resnet50" and part.lstrip().startswith(
                        "skipped:"):
                    self.assertRegex(part, r"skipped: torchvision")
                    continue
                for mode in MODES:
                    row = re.search(rf"^\| {mode} \| (\d+) \|.*\|$", part,
                                    re.M)
                    self.assertIsNotNone(row, f"{model}: no {mode} row in\n"
                                         f"{part}")
                    self.assertGreaterEqual(int(row.group(1)), 1,
                                            row.group(0))
                # Every mode ran the common batch, beside none.
                for mode in MODES:
                    self.assertRegex(
                        part, rf"\n\| {mode} \| \d+ \| [^|]* \| [\d.]+ \| "
                        rf"[^|]* \| [\d.]+ \| [\d.]+ \|")

    def test_deltad_released_memory(self):
        # The smoke budget (6 MiB of saved activations) is short for the
        # smoke GPT: deltad offloads or evicts. On the CPU nothing caps
        # memory, so deltad, like every mode, reaches --max_batch.
        part = model_section(self.text, "gpt2")
        row = re.search(r"^\| deltad \| (\d+) \| ([^|]*) \|", part, re.M)
        self.assertIsNotNone(row, part)
        self.assertEqual(row.group(2).strip(), "reached --max_batch 16")
        stats = re.search(r"deltad at batch \d+, over \d+ steps: ([\d.]+) "
                          r"\w+ offloaded, [^,]*, (\d+) evictions", part)
        self.assertIsNotNone(stats, part)
        self.assertTrue(float(stats.group(1)) > 0 or int(stats.group(2)) > 0,
                        stats.group(0))

    def test_a_target_table_per_model(self):
        part = model_section(self.text, "gpt2")
        self.assertIn("| target | measured | result |", part)
        # Batch 1 is timed in none and deltad for the quiet-run target.
        row = re.search(r"^\| nothing released \(batch 1\): [^|]* \| "
                        r"([^|]*) \| ([^|]*) \|$", part, re.M)
        self.assertIsNotNone(row, part)
        self.assertRegex(row.group(1).strip(), r"^([\d.]+x|-)$")
        # No memory limit on the CPU: the batch targets are not judged.
        self.assertRegex(part, r"\| largest batch >= 2\.5x none's \| 16 vs "
                         r"16 \| no memory limit here")

    def test_traces_replayed_or_the_table_says_why(self):
        sim = self.text[self.text.index("### Simulator"):]
        row = re.search(r"^\| gpt2 \| (.*)\|$", sim, re.M)
        self.assertIsNotNone(row, sim)
        if not self.policy_bench:
            self.assertIn("no --policy_bench given", row.group(1))
            return
        cells = [c.strip() for c in row.group(1).split("|")]
        # batch, ops, peak, ratio, at the ratio, at 1.0, measured, error.
        self.assertRegex(cells[0], r"^\d+$")
        self.assertGreater(int(cells[1]), 0)
        self.assertRegex(cells[3], r"^(0\.\d\d|1\.00)$")
        self.assertRegex(cells[4], r"^([\d.]+|does not fit .*)$")
        self.assertRegex(cells[5], r"^1\.\d{3}$")
        self.assertRegex(cells[6], r"^[\d.]+$")
        self.assertRegex(cells[7], r"^([+-]\d+% \((met|missed)\)|-)$")
        if not cells[4].startswith("does not fit"):
            self.assertNotEqual(cells[7], "-")


class TorchBenchInAChildProcessTest(unittest.TestCase):
    """--deltad_allocator: deltad's mode runs each try in a process of its
    own (bench/torch_child.py; on a GPU under deltad's allocator, here on
    the CPU without one), and its results come back as the in-process
    mode's do: the search, the releases, the timed runs."""

    def test_deltad_runs_in_a_child_and_reports_as_in_process(self):
        with tempfile.TemporaryDirectory(prefix="torch_bench-") as d:
            doc = os.path.join(d, "BENCHMARKS.md")
            with open(doc, "w") as f:
                f.write(f"{BEGIN}\n{END}\n")
            r = run("--device", "cpu", "--smoke", "--deltad_allocator",
                    "--models", "gpt2", "--modes", "none,deltad",
                    "--update_doc", doc)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            with open(doc) as f:
                text = f.read()
        self.assertIn("bench/torch_child.py", text)
        tries = re.findall(r"gpt2 deltad batch (\d+): fits .*\[deltad: .* "
                           r"(\d+) offloads", r.stderr)
        self.assertTrue(tries, r.stderr[-3000:])
        # The smoke budget holds the smoke GPT's at small batches only.
        self.assertGreater(max(int(n) for _, n in tries), 0)
        self.assertRegex(r.stderr, r"gpt2 deltad batch \d+: [\d.]+ "
                         r"samples/s")


class TorchBenchArgumentsTest(unittest.TestCase):

    def test_bad_arguments_exit_2(self):
        for args in (["--modes", "none,bogus"], ["--models", "vgg"],
                     ["--max_batch", "gpt2=x"]):
            with self.subTest(args):
                r = run("--device", "cpu", "--smoke", *args, timeout=60)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("error:", r.stderr)

    def test_no_gpu_exits_77(self):
        if torch.cuda.is_available():
            raise unittest.SkipTest("a GPU is here: it would run")
        r = run("--device", "cuda", timeout=60)
        self.assertEqual(r.returncode, 77, r.stderr)
        self.assertIn("CUDA is not available", r.stderr)


class FailedStepTest(unittest.TestCase):
    """A step whose backward runs out of memory leaves nothing of its graph
    behind when the bench cleans up after it (the loss kept it alive, and
    the next run of the process read it as memory left allocated)."""

    def test_a_failed_backward_leaves_no_activation_alive(self):
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import torch_run

        class Activation(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                raise RuntimeError("CUDA out of memory (stand-in)")

        alive = []

        class Work:
            name = "stand-in"
            model = torch.nn.Linear(4, 4)

            def make_batch(self, batch, device):
                return torch.randn(batch, 4), None

            def forward(self, model, inputs, checkpointed):
                saved = model(inputs)  # what Activation saves
                alive.append(weakref.ref(saved))
                return Activation.apply(saved)

            def loss(self, out, targets):
                return out.sum()

        args = types.SimpleNamespace(device="cpu", memory_limit_gib=1,
                                     host_gib=1, socket=None)
        bench = torch_run.Bench(args, None, None)
        seen = []
        real = torch_run.free_memory

        def checked(cuda):
            seen.append(sum(ref() is not None for ref in alive))
            real(cuda)

        torch_run.free_memory = checked
        try:
            r = bench.run(Work(), "none", 8, 0, 1)
        finally:
            torch_run.free_memory = real
        self.assertFalse(r.ok)
        self.assertTrue(r.oom, r.error)
        # The first call is before the run; the one after it saw no output
        # of the failed step alive.
        self.assertEqual(seen[-1], 0)


class GlobalSwapStatisticsTest(unittest.TestCase):
    """Under deltad's global swap (PyTorch 2.0-2.7, or
    DELTAD_ALLOCATOR_ROUTING=global) PyTorch keeps no memory statistics
    and asking for them raises: the allocator's child run reads deltad's
    instead."""

    def test_the_child_reads_deltads_statistics_under_the_global_swap(self):
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import torch_run
        calls = []

        class Allocator:
            @staticmethod
            def mode():
                return "global"

            @staticmethod
            def stats():
                return types.SimpleNamespace(allocated_bytes=123,
                                             peak_device_bytes=456)

            @staticmethod
            def reset_peak():
                calls.append("reset_peak")

        deltad = types.SimpleNamespace(allocator=Allocator,
                                       DeltadError=RuntimeError)
        args = types.SimpleNamespace(device="cpu", memory_limit_gib=1,
                                     host_gib=1, socket=None)
        bench = torch_run.Bench(args, deltad, None, allocator_child=True)
        bench.cuda = True  # as on a GPU; nothing here may ask PyTorch
        self.assertEqual(bench.allocated(), 123)
        bench.reset_peak()
        self.assertEqual(calls, ["reset_peak"])
        self.assertEqual(bench.peak_held(), 456)


class StoppedRunTest(unittest.TestCase):
    """SIGTERM, as a stage's time limit sends it, ends torch_bench with
    what had finished written: a run killed before its end once lost
    every figure."""

    def test_a_terminated_run_writes_what_it_had(self):
        with tempfile.TemporaryDirectory(prefix="torch_bench-") as d:
            doc = os.path.join(d, "BENCHMARKS.md")
            with open(doc, "w") as f:
                f.write(f"{BEGIN}\nan old run\n{END}\n")
            p = subprocess.Popen(
                [sys.executable, SCRIPT, "--device", "cpu", "--smoke",
                 "--models", "gpt2", "--update_doc", doc],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
            lines = []
            try:
                # Stopped in deltad's search, the second.
                for line in p.stderr:
                    lines.append(line)
                    if re.search(r"gpt2 deltad batch \d+: fits", line):
                        p.send_signal(signal.SIGTERM)
                        break
                rest = p.communicate(timeout=120)[1]
            finally:
                p.kill()
            with open(doc) as f:
                text = f.read()
        log = "".join(lines) + rest
        self.assertEqual(p.returncode, 1, log[-3000:])
        self.assertRegex(text, r"\*\*Incomplete\*\*: stopped by signal "
                         r"15 \(the stage's time limit\) after \d+ s")
        # What the searches had found, none's whole, deltad's so far.
        self.assertRegex(
            model_section(text, "gpt2"),
            r"stopped during its runs by signal 15 .*: none \d+, "
            r"deltad \d+\.")
        self.assertNotIn("an old run", text)


class SearchOrderTest(unittest.TestCase):
    """deltad's largest batch is searched right after none's, and a search
    the time budget cut does not set the common batch."""

    def setUp(self):
        sys.path.insert(0, os.path.dirname(SCRIPT))

    def test_deltad_is_searched_second(self):
        import torch_bench
        self.assertEqual(
            torch_bench.search_order(
                ["none", "checkpoint", "save_on_cpu", "deltad"]),
            ["none", "deltad", "checkpoint", "save_on_cpu"])
        self.assertEqual(torch_bench.search_order(["save_on_cpu", "deltad"]),
                         ["deltad", "save_on_cpu"])

    def test_a_search_cut_by_time_does_not_set_the_common_batch(self):
        import torch_bench

        def entry(largest, why=None):
            return {"largest": largest, "why": why}

        cut = torch_bench.OUT_OF_TIME
        self.assertEqual(torch_bench.common_batch(
            {"none": entry(193, "out of memory at batch 194"),
             "save_on_cpu": entry(64, cut), "deltad": entry(384)}), 193)
        self.assertEqual(torch_bench.common_batch(
            {"none": entry(16, cut), "deltad": entry(8, cut)}), 8)
        self.assertEqual(torch_bench.common_batch(
            {"none": entry(0), "deltad": entry(0, "skipped: ...")}), 0)


class WarmUpTest(unittest.TestCase):
    """The bench's warm-up of cuBLAS needs no deltad: every other mode
    still runs where deltad does not import (it once raised for all)."""

    def test_the_warm_up_runs_without_deltad(self):
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import benchlib
        import torch_run

        def no_deltad():
            raise ImportError("no deltad here")

        real = benchlib.import_deltad
        benchlib.import_deltad = no_deltad
        try:
            torch_run.warm_up_libraries(torch.device("cpu"))
        finally:
            benchlib.import_deltad = real
        self.assertIn(torch.device("cpu"), torch_run._warmed_up)


if __name__ == "__main__":
    unittest.main()
