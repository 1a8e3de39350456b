"""python -m deltad.run: a training script run with deltad and no change
to it trains exactly as without it, within the budget, offloading; the
launcher says what it did, and DELTAD_DISABLE=1 runs the script as it is."""

import os
import re
import subprocess
import sys
import tempfile
import unittest

import torch

SCRIPT = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(8)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[1])):
    opt.zero_grad()
    loss = model(torch.randn(512, 256)).square().mean()
    loss.backward()
    opt.step()
print("final", repr(loss.item()),
      repr(sum(p.double().sum().item() for p in model.parameters())))
"""


def run(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, **(env or {})})


class ScriptCase(unittest.TestCase):
    """Writes SOURCE to train.py in a temporary folder and keeps what it
    prints run plainly (3 steps) as `expected`."""

    SOURCE = SCRIPT
    env = {}

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.script = os.path.join(cls.dir.name, "train.py")
        with open(cls.script, "w") as f:
            f.write(cls.SOURCE)
        plain = run(cls.script, "3", env=cls.env)
        assert plain.returncode == 0, plain.stderr
        cls.expected = plain.stdout

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def trains_as_without(self, pattern, *options, env=None):
        """Runs the script (3 steps) under `python -m deltad.run options`,
        checks it printed what it did without deltad, and returns the
        match of `pattern` in deltad's summary on stderr."""
        r = run("-m", "deltad.run", *options, self.script, "3",
                env=env if env is not None else self.env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, self.expected)
        line = re.search(pattern, r.stderr)
        self.assertIsNotNone(line, r.stderr)
        return line


class RunTest(ScriptCase):
    """The script on the CPU: on a machine with a GPU too, which it is made
    not to see (deltad would manage the GPU's memory, which the script
    does not use; CudaRunTest covers that)."""

    env = {"CUDA_VISIBLE_DEVICES": ""}

    def test_a_script_trains_as_without_deltad_within_the_budget(self):
        line = self.trains_as_without(
            r"deltad: (\d+) iterations, (\d+) saved tensors, peak \d+ bytes "
            r"resident of a 1048576-byte budget, (\d+) offloads",
            "--budget", "1MiB", "--socket", "", "--min_bytes", "1")
        self.assertEqual(int(line.group(1)), 3)
        self.assertGreater(int(line.group(2)), 0)
        self.assertGreater(int(line.group(3)), 0)

    def test_deltad_disable_runs_the_script_as_it_is(self):
        r = run("-m", "deltad.run", "--budget", "1MiB", self.script, "3",
                env={**self.env, "DELTAD_DISABLE": "1"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, self.expected)
        self.assertNotIn("deltad:", r.stderr)

    def test_the_scripts_arguments_are_passed_verbatim(self):
        script = os.path.join(self.dir.name, "argv.py")
        with open(script, "w") as f:
            f.write("import sys; print(sys.argv[1:]); "
                    "print(sys.path[0] == %r)\n" % self.dir.name)
        r = run("-m", "deltad.run", "--socket", "", script, "--budget",
                "--", "x", env={"DELTAD_DISABLE": "1"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "['--budget', '--', 'x']\nTrue\n")

    def test_a_bad_budget_is_refused(self):
        r = run("-m", "deltad.run", "--budget", "lots", self.script, "3")
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a size", r.stderr)


def cuda_script(width, layers, batch, loss):
    """A training script on the GPU: `layers` of Linear(width, width) and
    ReLU, a batch of `batch` rows, and the code that sets `loss`."""
    return f"""
import sys, torch
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(
    torch.nn.Linear({width}, {width}), torch.nn.ReLU())
    for _ in range({layers})]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn({batch}, {width}, device="cuda")
for step in range(int(sys.argv[1])):
    opt.zero_grad()
    {loss}
    loss.backward()
    opt.step()
print("final", repr(loss.item()),
      repr(sum(p.double().sum().item() for p in model.parameters())))
"""


CUDA_SCRIPT = cuda_script(256, 32, 4096, "loss = model(x).square().mean()")


@unittest.skipUnless(torch.cuda.is_available(),
                     "no GPU: the CUDA allocator path needs one")
class CudaScriptCase(ScriptCase):
    """A script on the GPU, its cuBLAS deterministic, with workspaces of
    128 KiB: PyTorch keeps one per cuBLAS handle and stream, and backward
    runs on a thread (a handle) of its own, so that the usual 32 MiB would
    count once or twice in the budgets below."""

    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8",
           "CUBLASLT_WORKSPACE_SIZE": "128"}


class CudaRunTest(CudaScriptCase):
    """On a GPU: deltad's allocator serves the script's memory, the budget
    forces offloads, and training is bit-identical to the script run
    without deltad."""

    SOURCE = CUDA_SCRIPT

    def test_the_allocator_serves_a_script_that_trains_as_without(self):
        # Parameters 8 MiB (gradients as much, from backward on), the
        # input 4 MiB, cuBLAS's workspaces under 1 MiB; 33 saved storages
        # of 4 MiB (the input and each ReLU's output): 132 MiB. Of a 150 MiB
        # budget, saved activations get what those leave less a reserve of
        # 40 MiB for temporaries, about 97 MiB: some are offloaded.
        line = self.trains_as_without(
            r"deltad: (\d+) iterations, .* (\d+) offloads .*memory from "
            r"deltad's allocator \((\w+)\): peak (\d+) bytes",
            "--budget", "150MiB", "--socket", "")
        self.assertEqual(int(line.group(1)), 3)
        self.assertGreater(int(line.group(2)), 0)
        self.assertGreater(int(line.group(4)), 0)

    def test_no_allocator_leaves_pytorchs_in_place(self):
        r = run("-m", "deltad.run", "--budget", "1GiB", "--socket", "",
                "--no_allocator", self.script, "2", env=self.env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("memory from PyTorch's allocator", r.stderr)


# An 80 MiB temporary beside the saved activations: twice the reserve.
CUDA_TEMPORARY_SCRIPT = cuda_script(
    1024, 8, 1024, "out = model(x); "
    "loss = out.square().mean() + out.repeat(1, 20).sum() * 0")


class CudaGlobalSwapTest(CudaScriptCase):
    """On a GPU, under the global swap (DELTAD_ALLOCATOR_ROUTING=global,
    any PyTorch 2.x): a first iteration whose temporary outgrows the
    reserve gets its room from saved activations released when the
    allocation fails, and trains as without deltad."""

    SOURCE = CUDA_TEMPORARY_SCRIPT

    def test_an_allocation_short_of_room_releases_saved_activations(self):
        # At the first iteration's start PyTorch holds about 37 MiB
        # (parameters 32, the input 4, cuBLAS's workspaces under 1); the
        # reserve is 40 MiB, so saved activations may take 61 of a 138 MiB
        # budget and keep all of theirs (36 MiB). The 80 MiB temporary then
        # finds about 15 MiB too few, and 21 more than it needs once they
        # are released.
        line = self.trains_as_without(
            r"memory from deltad's allocator \(global\): .* (\d+) "
            r"releases on allocation failure freed (\d+) bytes",
            "--budget", "138MiB", "--socket", "",
            env={**self.env, "DELTAD_ALLOCATOR_ROUTING": "global"})
        self.assertGreater(int(line.group(1)), 0)
        self.assertGreater(int(line.group(2)), 0)

class DeviceTest(unittest.TestCase):
    """The GPU deltad serves, chosen before the script picks it."""

    def test_a_launchers_local_rank_picks_the_gpu(self):
        import types
        from unittest import mock

        from deltad import run as deltad_run
        torch_ = types.SimpleNamespace(cuda=types.SimpleNamespace(
            device_count=lambda: 4))
        for local_rank, index in (("2", 2), (None, 0), ("7", 0), ("x", 0)):
            env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
            with mock.patch.dict(os.environ, env, clear=False):
                if local_rank is None:
                    os.environ.pop("LOCAL_RANK", None)
                self.assertEqual(deltad_run._cuda_device(torch_), index,
                                 local_rank)


class DisabledTest(unittest.TestCase):

    def test_disabled_it_runs_the_script_without_loading_deltads_torch(self):
        # Where deltad's extension cannot load, DELTAD_DISABLE=1 is the way
        # out: deltad.torch is not imported at all then.
        from unittest import mock

        from deltad import run as deltad_run
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "s.py")
            out = os.path.join(d, "ran")
            with open(script, "w") as f:
                f.write(f"open({out!r}, 'w').write('yes')\n")
            saved_argv, saved_path0 = sys.argv[:], sys.path[0]
            try:
                with mock.patch.dict(sys.modules, {"deltad.torch": None}), \
                        mock.patch.dict(os.environ, {"DELTAD_DISABLE": "1"}):
                    self.assertEqual(deltad_run.main([script]), 0)
            finally:
                sys.argv[:], sys.path[0] = saved_argv, saved_path0
            with open(out) as f:
                self.assertEqual(f.read(), "yes")


if __name__ == "__main__":
    unittest.main()
