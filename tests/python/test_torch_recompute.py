"""Recompute of the patterns torchvision's models use: a ReLU(inplace=True)
after a BatchNorm, and a residual block whose output is changed in place
(`out += x`) after its last BatchNorm. Gradients and buffers must equal an
unmanaged run exactly."""

import unittest

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


if __name__ == "__main__":
    unittest.main()
