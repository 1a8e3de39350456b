"""torch_models: the two models torch_bench trains, each as a Workload (the
model, how to make a batch of it, how to run it and its loss):
torchvision's ResNet-50 and a GPT-2 small-size transformer written as plain
nn.Modules, each runnable as it is or with torch.utils.checkpoint around
every residual block or transformer Block (the `checkpoint` mode).

Imported by torch_bench.py from its own folder, so it goes wherever
torch_bench.py goes (scripts/gpu-pack); torch_bench.py imports torch_run
first, which exits with a note when PyTorch is not importable.
"""

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

MODELS = ("resnet50", "gpt2")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fused = hasattr(F, "scaled_dot_product_attention")
        if not self.fused:
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(shape[-1]))
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def _gelu():
    try:
        return nn.GELU(approximate="tanh")  # GPT-2's
    except TypeError:  # before 1.12
        return nn.GELU()


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = _gelu()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2's architecture (pre-norm blocks, learned positions, the output
    layer tied to the token embedding), without dropout: every mode then
    does the same work."""

    def __init__(self, layers, d_model, heads, seq_len, vocab):
        super().__init__()
        self.seq_len = seq_len
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, seq_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens, checkpointed=False):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x) if checkpointed else block(x)
        return self.lm_head(self.ln_f(x))


CHECKPOINT_KW = (
    {"use_reentrant": False}
    if "use_reentrant" in inspect.signature(
        torch_checkpoint.checkpoint).parameters else {})


def checkpoint(fn, x):
    return torch_checkpoint.checkpoint(fn, x, **CHECKPOINT_KW)


def resnet_checkpointed(model, x):
    """torchvision ResNet's forward with each residual block checkpointed."""
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            x = checkpoint(block, x)
    return model.fc(torch.flatten(model.avgpool(x), 1))


class Workload:
    """A model, how to make a batch of its inputs and targets, and how to
    run it (checkpointed or not) and its loss."""

    def __init__(self, name, title, model, make_batch, forward, loss):
        self.name = name
        self.title = title
        self.model = model
        self.make_batch = make_batch  # (batch, device) -> (inputs, targets)
        self.forward = forward        # (model, inputs, checkpointed) -> out
        self.loss = loss              # (out, targets) -> scalar


def make_resnet50(smoke):
    try:
        import torchvision
    except ImportError as e:
        return None, f"torchvision is not installed ({e})"
    model = torchvision.models.resnet50()
    # 64x64: the last stage's maps are 2x2, so that BatchNorm trains at
    # batch 1 (at 32x32 they are 1x1 and it cannot).
    side = 64 if smoke else 224

    def make_batch(batch, device):
        return (torch.randn(batch, 3, side, side, device=device),
                torch.randint(0, 1000, (batch,), device=device))

    def forward(model, x, checkpointed):
        return resnet_checkpointed(model, x) if checkpointed else model(x)

    title = (f"torchvision {torchvision.__version__} ResNet-50, "
             f"{side}x{side} inputs, 1000 classes")
    return Workload("resnet50", title, model, make_batch, forward,
                    F.cross_entropy), None


def make_gpt2(smoke):
    layers, d_model, heads, seq, vocab = ((2, 64, 2, 64, 1000) if smoke else
                                          (12, 768, 12, 1024, 50257))
    model = GPT(layers, d_model, heads, seq, vocab)

    def make_batch(batch, device):
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def forward(model, tokens, checkpointed):
        return model(tokens, checkpointed=checkpointed)

    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))

    params = sum(p.numel() for p in model.parameters())
    attention = ("F.scaled_dot_product_attention"
                 if hasattr(F, "scaled_dot_product_attention")
                 else "softmax attention")
    title = (f"GPT-2 {'(smoke size) ' if smoke else 'small '}as plain "
             f"nn.Modules: {layers} layers, d={d_model}, {heads} heads, "
             f"sequence {seq}, vocabulary {vocab}, "
             f"{params / 1e6:.1f} M parameters, {attention}, no dropout")
    return Workload("gpt2", title, model, make_batch, forward, loss), None


MAKERS = {"resnet50": make_resnet50, "gpt2": make_gpt2}
