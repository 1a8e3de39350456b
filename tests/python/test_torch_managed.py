"""deltad.torch.managed on the CPU: training under a budget well below the
unmanaged peak gives the same losses and parameters as without deltad, with
the in-process policy and with a daemon."""

import os
import shutil
import subprocess
import tempfile
import time
import unittest

import torch

import deltad
import deltad.torch

STEPS = 3


def small_cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 16 * 16, 10))


def small_transformer():
    # No dropout, so that every step is deterministic.
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4,
                                         dim_feedforward=256, dropout=0.0,
                                         batch_first=True),
        torch.nn.TransformerEncoderLayer(d_model=64, nhead=4,
                                         dim_feedforward=256, dropout=0.0,
                                         batch_first=True),
        torch.nn.Flatten(), torch.nn.Linear(64 * 64, 10))


CASES = {
    "cnn": (small_cnn, lambda: torch.randn(16, 3, 32, 32)),
    "transformer": (small_transformer, lambda: torch.randn(16, 64, 64)),
}


class _Counted:
    __slots__ = ("tensor", "counter")

    def __init__(self, tensor, counter):
        self.tensor = tensor
        self.counter = counter
        counter.add(tensor.numel() * tensor.element_size())

    def __del__(self):
        self.counter.add(-self.tensor.numel() * self.tensor.element_size())


class _Counter:
    def __init__(self):
        self.live = 0
        self.peak = 0

    def add(self, n):
        self.live += n
        self.peak = max(self.peak, self.live)


def train(case, manage=None):
    """STEPS steps of SGD from a fixed seed: (losses, parameters, peak
    bytes of saved activations held by PyTorch at once)."""
    make_model, make_input = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    inputs = [make_input() for _ in range(STEPS)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = _Counter()
    losses = []
    for x in inputs:
        optimizer.zero_grad()
        if manage is None:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: _Counted(t, counter), lambda c: c.tensor):
                loss = model(x).square().mean()
                loss.backward()
        else:
            with manage(model):
                loss = model(x).square().mean()
                loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], \
        counter.peak


class ManagedTrainingTest(unittest.TestCase):

    def check_case(self, case, socket, connected=False):
        losses, params, peak = train(case)
        budget = int(peak * 0.4)
        stats = []

        def manage(model):
            return _Recording(deltad.torch.managed(
                model, budget_bytes=budget, socket=socket,
                min_bytes=4 << 10), stats)

        m_losses, m_params, _ = train(case, manage)
        self.assertEqual(losses, m_losses)
        for a, b in zip(params, m_params):
            self.assertTrue(torch.equal(a, b))
        managed_peak = max(s.peak_device_bytes for s in stats)
        self.assertLessEqual(managed_peak, peak * 0.5,
                             f"managed peak {managed_peak} of {peak}")
        self.assertGreater(sum(s.offloaded_bytes for s in stats), 0)
        self.assertEqual(all(s.connected for s in stats), connected)

    def test_cnn_in_process(self):
        self.check_case("cnn", socket=None)

    def test_transformer_in_process(self):
        self.check_case("transformer", socket=None)

    def test_cnn_and_transformer_with_the_daemon(self):
        with Daemon() as socket:
            self.check_case("cnn", socket=socket, connected=True)
            self.check_case("transformer", socket=socket, connected=True)

    def test_a_daemon_socket_with_no_daemon_falls_back_in_process(self):
        with tempfile.TemporaryDirectory() as d:
            self.check_case("cnn", socket=os.path.join(d, "none.sock"))

    def test_bad_arguments_are_refused(self):
        with self.assertRaises(TypeError):
            with deltad.torch.managed(object(), socket=None):
                pass
        with self.assertRaises(ValueError):
            with deltad.torch.managed(small_cnn(), budget_bytes=0,
                                      socket=None):
                pass

    def test_a_graph_unpacked_after_the_block_raises(self):
        model = small_cnn()
        with deltad.torch.managed(model, socket=None, min_bytes=1):
            loss = model(torch.randn(2, 3, 32, 32)).sum()
        # Autograd wraps the hook's DeltadError in a RuntimeError.
        with self.assertRaisesRegex(RuntimeError, "client is closed"):
            loss.backward()


class _Recording:
    """managed() that keeps the client's stats of the block."""

    def __init__(self, cm, stats):
        self.cm = cm
        self.stats = stats

    def __enter__(self):
        self.manager = self.cm.__enter__()
        return self.manager

    def __exit__(self, *exc):
        self.stats.append(self.manager.stats())
        return self.cm.__exit__(*exc)


class Daemon:
    """deltad ($DELTAD_BINARY) on simulated GPUs, on a socket of its own."""

    def __enter__(self):
        binary = os.environ.get("DELTAD_BINARY")
        if not binary:
            raise unittest.SkipTest("DELTAD_BINARY is not set")
        self.dir = tempfile.mkdtemp(prefix="deltad-python-")
        self.socket = os.path.join(self.dir, "d.sock")
        config = os.path.join(self.dir, "deltad.conf")
        with open(config, "w") as f:
            # A GPU whose budget (4 MiB) is below half of each model's
            # unmanaged peak: the daemon lends a session room beyond its
            # own budget while the GPU has some, so the GPU must be small.
            f.write("min_session_bytes: 1048576\ngpu_share: 0.5\n")
        self.proc = subprocess.Popen(
            [binary, f"--config={config}", "--backend=sim", "--sim_gpus=1",
             "--sim_memory=8MiB", "--host_pool=256MiB", "--host_slab=16MiB",
             f"--socket={self.socket}", "--metrics=127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 30
        while not os.path.exists(self.socket + ".fds"):
            if self.proc.poll() is not None or time.time() > deadline:
                err = self.proc.stderr.read().decode()
                self.__exit__()
                raise RuntimeError(f"deltad did not start: {err}")
            time.sleep(0.02)
        return self.socket

    def __exit__(self, *exc):
        self.proc.stderr.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
