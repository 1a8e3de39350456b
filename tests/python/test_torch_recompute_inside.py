"""Recompute of tensors saved inside a module's forward that no module
returns (attention probabilities in an attention module, a residual sum
in a block): under policy="recompute" they are evicted and rebuilt by
rerunning the module up to where it saved them, not copied to the host;
gradients equal an unmanaged run bit for bit. A module whose rerun saves
other tensors than its call did is found by the check of its first rerun
and its tensors are copied instead."""

import math
import unittest

import correctness  # noqa: F401 (before torch: cuBLAS's workspace)

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3


class _Attention(nn.Module):
    """Self-attention written out in the forward: the scores, the
    probabilities and the heads' output are saved by ops of this module,
    returned by none."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(shape[-1])
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))  # the sum: saved by ln2, inside
        return x + self.out(torch.tanh(self.fc(self.ln2(x))))


class _Transformer(nn.Module):
    def __init__(self, d=32, heads=4, layers=2):
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(d, heads)
                                      for _ in range(layers)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def _self_attention_step(model, x):
    """PyTorch's MultiheadAttention as the model, called on one tensor
    three times: it packs its projections when `query is key is value`,
    so a rerun must pass one copy three times too. (Sequence first: its
    projection then saves the input itself, which a rerun reads back.)"""
    loss = model(x, x, x)[0].square().mean()
    loss.backward()
    return [loss]


class _SavesOtherwiseWhenRerun(nn.Module):
    """Saves by a path that a rerun does not take: called on the output of
    an op (it has a grad_fn), rerun on a copy of it (a leaf)."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        if x.grad_fn is not None:
            h = torch.exp(h.sum(-1, keepdim=True)) * h
        else:
            h = torch.exp(h) * h
        return self.out(torch.tanh(h))


class _Tanhs(nn.Module):
    """Ten tanh's in a row inside one module: each saves its output, so
    the call saves nine tensors inside, and returns the tenth."""

    def __init__(self, d=256):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        for _ in range(10):
            h = torch.tanh(h)
        return h


def _step_on_an_op_output(model, x):
    x = x.detach().requires_grad_()
    loss = model(x * 2.0).square().mean()
    loss.backward()
    return [loss]


class RecomputeInsideModulesTest(unittest.TestCase):

    def train(self, make_model, make_input, step=correctness.simple_step):
        """Unmanaged, then under policy="recompute" with a budget below
        any saved storage: the same gradients, losses and parameters; the
        managed run's stats per step (cumulative)."""
        expected = correctness.run(make_model, make_input, step, None, STEPS)
        per_step = []
        got = correctness.run(make_model, make_input, step,
                              correctness.RECOMPUTE,
                              STEPS, on_step=lambda m: per_step.append(
                                  m.stats()))
        correctness.assert_same_training(self, expected, got)
        return per_step

    def test_tensors_saved_inside_a_module_are_evicted_not_copied(self):
        per_step = self.train(_Transformer, lambda: torch.randn(2, 16, 32))
        last, before = per_step[-1], per_step[-2]
        # The first step records what to rerun and checks each module's
        # rerun once; from then on nothing goes to the host.
        self.assertEqual(last.offloads - before.offloads, 0, last)
        self.assertGreater(last.evictions - before.evictions, 0, last)
        self.assertGreater(last.recomputes - before.recomputes, 0, last)

    def test_self_attention_by_identity_is_rebuilt_on_its_own_path(self):
        per_step = self.train(
            lambda: nn.MultiheadAttention(32, 4),
            lambda: torch.randn(8, 2, 32), _self_attention_step)
        last, before = per_step[-1], per_step[-2]
        self.assertEqual(last.offloads - before.offloads, 0, last)
        self.assertGreater(last.recomputes - before.recomputes, 0, last)

    def test_a_rerun_keeps_first_what_backward_reads_next(self):
        # Storages of 64 KiB; room for the input and two more. A rerun
        # for the k-th tensor brings back the ones before it where there
        # is room: the (k-1)-th first, which backward reads next. Keeping
        # the earliest instead left each one between to a rerun of its
        # own: 7 a step, not 4.
        per_step = []
        expected = correctness.run(_Tanhs, lambda: torch.randn(64, 256),
                                   correctness.simple_step, None, STEPS)
        got = correctness.run(
            _Tanhs, lambda: torch.randn(64, 256), correctness.simple_step,
            dict(budget_bytes=3 << 16, policy="recompute"), STEPS,
            on_step=lambda m: per_step.append(m.stats()))
        correctness.assert_same_training(self, expected, got)
        last, before = per_step[-1], per_step[-2]
        self.assertEqual(last.evictions - before.evictions, 8, last)
        self.assertLessEqual(last.recomputes - before.recomputes, 4, last)

    def test_a_module_whose_rerun_saves_otherwise_is_copied_instead(self):
        per_step = self.train(_SavesOtherwiseWhenRerun,
                              lambda: torch.randn(8, 32),
                              _step_on_an_op_output)
        last, before = per_step[-1], per_step[-2]
        # What it saves inside goes to the host, every step.
        self.assertGreater(last.offloads - before.offloads, 0, last)


if __name__ == "__main__":
    unittest.main()
