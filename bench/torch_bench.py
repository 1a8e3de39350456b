#!/usr/bin/env python3
"""torch_bench: deltad beside PyTorch's own ways to train in less memory.

Two models, torchvision's ResNet-50 (224x224, 1000 classes) and a GPT-2
small-size transformer (12 layers, d=768, 12 heads, sequence 1024, vocabulary
50257), each trained (forward, cross-entropy loss, backward, SGD step) in
four modes under one GPU memory limit:

  none         plain training;
  checkpoint   torch.utils.checkpoint around each residual block (ResNet's
               Bottleneck) and each transformer Block;
  save_on_cpu  torch.autograd.graph.save_on_cpu(pin_memory=True): every
               saved activation goes to pinned host memory;
  deltad       deltad.torch.managed: saved activations go to the deltad
               client, which offloads or recomputes them within its budget.

For each model and mode it finds the largest batch that trains (doubling,
then bisection between the last batch that fit and the first that did not;
a batch fits when two training steps run without running out of memory),
then measures samples/s over --steps steps at that batch and at one common
batch (the smallest of the modes' largest batches: `none`'s largest when
the others fit more), so that the modes compare side by side. Then it
times deltad (and `none`) at the further batches the PyTorch targets name
(bench/torch_targets.py: a batch where nothing should be released, 1.5x
and 2.5x `none`'s largest, checkpoint's and save_on_cpu's largest) and
prints a table of the targets, met or missed, per model. With
--policy_bench it also records one iteration of each model at the common
batch (deltad.torch.record_trace) and replays it in the simulator at the
budget ratio deltad had, beside the measured deltad slowdown. On CUDA,
TF32 is allowed for matmuls and convolutions unless --no_tf32.

  python3 bench/torch_bench.py --update_doc docs/BENCHMARKS.md \\
      --policy_bench build/bench/policy_bench
  python3 bench/torch_bench.py --device cpu --smoke   # every path, seconds

It prints a Markdown section; --update_doc FILE rewrites the section between
<!-- torch_bench:begin --> and <!-- torch_bench:end --> of FILE (appending it
when FILE has none), as the C++ benchmarks do. Exit status: 0 when every
mode ran (running out of memory is a result, not an error), 1 when a mode
failed otherwise, 2 for bad arguments, 77 when --device cuda finds no GPU.
On a GPU machine scripts/gpu-pack runs it after gpu_bench.
"""

import argparse
import contextlib
import csv
import functools
import gc
import inspect
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import benchlib
import torch_targets

TAG = "torch_bench"
GIB = 1 << 30
MIB = 1 << 20
MODELS = ("resnet50", "gpt2")
MODES = ("none", "checkpoint", "save_on_cpu", "deltad")
# deltad.DeltadError's code for RESOURCE_EXHAUSTED (the budget and the host
# memory are both short).
RESOURCE_EXHAUSTED = 8
NO_GPU = 77
SIM_ERROR = 0.20  # the simulator's step time vs the measured one


note = functools.partial(benchlib.note, TAG)

benchlib.require_torch(TAG)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402


def import_deltad():
    """deltad and deltad.torch, from PYTHONPATH or this checkout
    (client/python); (None, reason) when neither has it."""
    try:
        return benchlib.import_deltad(), None
    except ImportError as e:
        return None, f"the deltad package is not importable ({e})"


# --- models


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


_CHECKPOINT_KW = (
    {"use_reentrant": False}
    if "use_reentrant" in inspect.signature(
        torch_checkpoint.checkpoint).parameters else {})


def checkpoint(fn, x):
    return torch_checkpoint.checkpoint(fn, x, **_CHECKPOINT_KW)


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


# --- memory and errors

OutOfMemoryError = getattr(torch.cuda, "OutOfMemoryError", None)


def is_oom(exc, deltad_error):
    """Whether exc (or what caused it) is running out of memory: PyTorch's
    allocator, a failed pinned allocation, or deltad's RESOURCE_EXHAUSTED."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if OutOfMemoryError is not None and isinstance(exc, OutOfMemoryError):
            return True
        if (deltad_error is not None and isinstance(exc, deltad_error) and
                exc.code == RESOURCE_EXHAUSTED):
            return True
        if isinstance(exc, RuntimeError) and (
                "out of memory" in str(exc) or
                # deltad's error raised in a saved-tensor hook: autograd
                # passes it on as a RuntimeError holding only its message.
                "DeltadError: RESOURCE_EXHAUSTED" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def short(exc, limit=160):
    # One line, and no '|' to break a Markdown table.
    text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def free_memory(cuda):
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # Pinned host memory save_on_cpu left in PyTorch's host cache
        # (torch >= 2.1); older versions keep it until exit.
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def meminfo_bytes(field):
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(nbytes):
    return f"{nbytes / GIB:.2f}"


def size(nbytes):
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


# --- one run: a mode, a batch, some training steps


class RunResult:
    def __init__(self):
        self.ok = False
        self.oom = False
        self.error = None       # message of the failure (OOM or not)
        self.seconds = None     # of the timed steps
        self.samples_per_s = None
        self.torch_peak = None  # max reserved by PyTorch's allocator
        self.deltad = None      # deltad.ClientStats after the run
        self.wall = 0.0


class Bench:
    def __init__(self, args, deltad_module, deltad_reason):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            # PyTorch's memory-fraction call wants an index: "cuda" means
            # the current device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.deltad = deltad_module
        self.deltad_reason = deltad_reason
        self.deltad_error = deltad_module.DeltadError if deltad_module \
            else None
        self.limit = int(args.memory_limit_gib * GIB)
        # deltad's budget is the whole limit: its saved tensors live in the
        # memory PyTorch's allocator holds, within the same cap.
        self.budget = self.limit
        self.host_cap = int(args.host_gib * GIB)
        self.total = (torch.cuda.get_device_properties(self.device)
                      .total_memory if self.cuda else None)
        self.deadline = None  # per model: see run_bench
        self.errors = []  # failures that are not running out of memory
        self.connected = None  # whether deltad's client reached a daemon

    def out_of_time(self):
        return self.deadline is not None and time.monotonic() > self.deadline

    def set_limit(self, mode):
        """Enforces the memory limit for a mode's run (CUDA only): every
        mode, deltad included, gets the same cap on PyTorch's caching
        allocator, which holds all of the run's memory."""
        if not self.cuda:
            return
        fraction = min(1.0, self.limit / self.total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    @contextlib.contextmanager
    def mode_context(self, mode, model):
        """Around every step of a run; yields deltad's Manager or None."""
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=self.cuda):
                yield None
        elif mode == "deltad":
            with self.deltad.torch.managed(
                    model, budget_bytes=self.budget, socket=self.args.socket,
                    host_bytes=self.host_cap, label="torch_bench",
                    policy=self.args.deltad_policy,
                    min_bytes=self.args.deltad_min_bytes) as manager:
                yield manager
        else:
            yield None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, work, mode, batch, warmup, steps):
        """`warmup` then `steps` timed training steps at `batch`."""
        result = RunResult()
        start = time.perf_counter()
        model = work.model
        for p in model.parameters():
            p.grad = None
        free_memory(self.cuda)
        self.set_limit(mode)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        checkpointed = mode == "checkpoint"
        try:
            inputs, targets = work.make_batch(batch, self.device)
            with self.mode_context(mode, model) as manager:
                for i in range(warmup + steps):
                    if i == warmup:
                        self.sync()
                        timed = time.perf_counter()
                    optimizer.zero_grad(set_to_none=True)
                    out = work.forward(model, inputs, checkpointed)
                    loss = work.loss(out, targets)
                    del out
                    loss.backward()
                    del loss
                    optimizer.step()
                self.sync()
                if steps:
                    result.seconds = time.perf_counter() - timed
                    result.samples_per_s = batch * steps / result.seconds
            if manager is not None:
                result.deltad = manager.stats()
                self.connected = result.deltad.connected
            result.ok = True
        except Exception as e:  # noqa: BLE001: classified, then reported
            result.oom = is_oom(e, self.deltad_error)
            result.error = short(e)
        finally:
            if self.cuda:
                result.torch_peak = torch.cuda.max_memory_reserved(
                    self.device)
            for p in model.parameters():
                p.grad = None
            # Drop the batch and whatever a failed step left (the
            # exception's frames are gone once we leave the handler).
            inputs = targets = optimizer = None
            free_memory(self.cuda)
        result.wall = time.perf_counter() - start
        return result

    def timed(self, work, mode, batch):
        """One warm-up and --steps timed steps at `batch`; None when the
        time budget ran out first."""
        if self.out_of_time():
            note(f"{work.name} {mode} batch {batch}: not timed, the time "
                 f"budget ran out")
            return None
        r = self.run(work, mode, batch, 1, self.args.steps)
        note(f"{work.name} {mode} batch {batch}: "
             + (f"{r.samples_per_s:.1f} samples/s" if r.ok
                else f"failed while timed: {r.error}"))
        if not r.ok and not r.oom:
            self.errors.append(f"{work.name} {mode} timed at {batch}: "
                               f"{r.error}")
        return r

    def per_sample_bytes(self, work):
        """PyTorch's peak memory per sample in `none` mode (CUDA): from one
        step at batches 1 and 2. What save_on_cpu would pin per sample, at
        most; None when it cannot be measured."""
        if not self.cuda:
            return None
        peaks = []
        for batch in (1, 2):
            free_memory(True)
            self.set_limit("none")
            torch.cuda.reset_peak_memory_stats(self.device)
            r = self.run(work, "none", batch, 1, 0)
            if not r.ok:
                break
            peaks.append(torch.cuda.max_memory_allocated(self.device))
        if len(peaks) == 2 and peaks[1] > peaks[0]:
            return peaks[1] - peaks[0]
        if peaks:
            return peaks[0]
        return None

    # --- the largest batch

    def largest_batch(self, work, mode, max_batch, sample_bytes):
        """Doubling from 1, then bisection between the last batch that fit
        and the first that did not. Returns (largest or 0, why it stopped,
        tries)."""
        tries = []

        def fits(batch):
            if self.out_of_time():
                return None, "the time budget (--time_budget_s) ran out"
            if (mode == "save_on_cpu" and self.cuda and sample_bytes and
                    sample_bytes * batch > self.host_cap):
                return None, (f"batch {batch} would pin about "
                              f"{gib(sample_bytes * batch)} GiB, over the "
                              f"host memory cap (--host_gib)")
            r = self.run(work, mode, batch, 2, 0)
            tries.append((batch, r))
            what = ("fits" if r.ok else
                    "out of memory" if r.oom else "ERROR")
            note(f"{work.name} {mode} batch {batch}: {what} "
                 f"({r.wall:.1f} s)" + ("" if r.ok else f": {r.error}"))
            if r.ok:
                return True, None
            if not r.oom:
                self.errors.append(f"{work.name} {mode} batch {batch}: "
                                   f"{r.error}")
                return None, f"error at batch {batch}: {r.error}"
            return False, f"out of memory at batch {batch}"

        good, bad, why = 0, None, None
        batch = 1
        while True:
            ok, reason = fits(batch)
            if ok is None:
                return good, reason, tries
            if not ok:
                bad, why = batch, reason
                break
            good = batch
            if batch >= max_batch:
                return good, f"reached --max_batch {max_batch}", tries
            batch = min(batch * 2, max_batch)
        while bad - good > 1:
            mid = (good + bad) // 2
            ok, reason = fits(mid)
            if ok is None:
                return good, reason, tries
            if ok:
                good = mid
            else:
                bad, why = mid, reason
        return good, why, tries


# --- traces in the simulator


def sim_profile(gpu_name):
    """policy_bench's device profile nearest the GPU measured."""
    name = (gpu_name or "").upper()
    for key, profile in (("H100", "h100-80gb"), ("H200", "h100-80gb"),
                         ("A100", "a100-80gb"), ("V100", "v100-16gb"),
                         ("TITAN V", "titan-v")):
        if key in name:
            return profile
    return "a100-80gb"


def replay(policy_bench, trace_path, ratios, profile, workdir):
    """policy_bench on one recorded trace at `ratios` (strings as the CSV
    writes them): {ratio: row of the `delta` policy} or raises."""
    csv_path = os.path.join(workdir,
                            os.path.basename(trace_path) + ".csv")
    command = [policy_bench, f"--trace_files={trace_path}", "--models=",
               "--traces=/nonexistent", f"--ratios={','.join(ratios)}",
               "--policies=delta", f"--model_device={profile}",
               f"--csv={csv_path}"]
    run = subprocess.run(command, capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"policy_bench exited {run.returncode}: "
                           f"{run.stderr.strip()[-300:]}")
    rows = {}
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row["policy"] == "delta":
                rows[row["budget_ratio"]] = row
    return rows


# --- the report


def fmt_rate(r):
    return f"{r:.1f}" if r is not None else "-"


def run_bench(args):
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        note("--device cuda: CUDA is not available here (use --device cpu)")
        sys.exit(NO_GPU)
    if cuda and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    deltad_module, deltad_reason = (import_deltad() if "deltad" in args.modes
                                    or args.policy_bench else (None, None))
    bench = Bench(args, deltad_module, deltad_reason)
    torch.manual_seed(0)
    started = time.monotonic()

    gpu_name = torch.cuda.get_device_name(bench.device) if cuda else None
    if cuda:
        machine = (f"{gpu_name}, {gib(bench.total)} GiB (CUDA "
                   f"{torch.version.cuda}); host "
                   f"{benchlib.cpu_description()}")
    else:
        machine = (f"CPU: {benchlib.cpu_description()} (no GPU: memory "
                   f"limits not enforced)")

    policy_bench = args.policy_bench
    trace_reason = None
    if not policy_bench:
        trace_reason = "not recorded: no --policy_bench given"
    elif not (os.path.isfile(policy_bench) and
              os.access(policy_bench, os.X_OK)):
        trace_reason = f"not recorded: {policy_bench} is not an executable"
    elif deltad_module is None:
        trace_reason = f"not recorded: {deltad_reason}"
    elif cuda and int(torch.__version__.split(".")[0]) < 2:
        trace_reason = ("not recorded: torch < 2 records no CUDA backward "
                        "pass (deltad.trace)")
    workdir = args.trace_dir or tempfile.mkdtemp(prefix="torch_bench-")
    os.makedirs(workdir, exist_ok=True)

    sections = []
    sim_rows = []
    for i, name in enumerate(args.models):
        if args.time_budget_s:
            # Each model gets an equal share of the time that is left, the
            # searches at most 60% of it, so that the timed runs get some.
            now = time.monotonic()
            share = (max(0.0, started + args.time_budget_s - now) /
                     (len(args.models) - i))
            search_deadline = now + 0.6 * share
            model_deadline = now + share
        work, skipped = MAKERS[name](args.smoke)
        if work is None:
            note(f"{name}: skipped: {skipped}")
            sections.append(f"### {name}\n\nskipped: {skipped}\n")
            sim_rows.append(f"| {name} | skipped: {skipped} ||||||||")
            continue
        work.model.to(bench.device).train()
        max_batch = args.max_batch[name]
        sample_bytes = bench.per_sample_bytes(work)
        results = {}
        for j, mode in enumerate(args.modes):
            if args.time_budget_s:
                # Each mode's search an equal share of what is left of the
                # searches' time (deltad's is not spent by save_on_cpu's).
                now = time.monotonic()
                bench.deadline = now + max(0.0, search_deadline - now) / (
                    len(args.modes) - j)
            entry = {"largest": 0, "why": None, "own": None, "common": None}
            results[mode] = entry
            if mode == "deltad" and deltad_module is None:
                entry["why"] = f"skipped: {deltad_reason}"
                continue
            entry["largest"], entry["why"], _ = bench.largest_batch(
                work, mode, max_batch, sample_bytes)
        if args.time_budget_s:
            bench.deadline = model_deadline
        # The common batch: the smallest of the modes' largest batches
        # (those that fit one at all), which is `none`'s largest whenever
        # the others fit more, so that every mode runs it. Timed first: the
        # side-by-side comparison matters most when time is short.
        fitted = [e["largest"] for e in results.values() if e["largest"]]
        common = min(fitted) if fitted else 0
        for mode, entry in results.items():
            if entry["largest"] and common:
                entry["common"] = bench.timed(work, mode, common)
        for mode, entry in results.items():
            if entry["largest"] == common:
                entry["own"] = entry["common"]
            elif entry["largest"]:
                entry["own"] = bench.timed(work, mode, entry["largest"])
        targets = target_section(work, results, common, bench, args)
        sections.append(model_section(work, results, common, bench,
                                      sample_bytes) + targets)
        sim_rows.append(trace_row(work, results, common, bench, args,
                                  trace_reason, workdir, gpu_name))
        work.model.to("cpu")
        del work
        free_memory(cuda)
    if not args.trace_dir:
        shutil.rmtree(workdir, ignore_errors=True)

    command = benchlib.command_line("bench/torch_bench.py")
    smoke = " (smoke run: tiny models, not a benchmark)" if args.smoke else ""
    md = [f"## torch_bench: PyTorch training under one memory limit{smoke}",
          "",
          f"Command: `{command}`  ",
          f"Machine: {machine}  ",
          f"Date: {benchlib.today()}  ",
          f"Software: {benchlib.software()}",
          "",
          intro(args, bench, cuda), ""]
    md += sections
    md.append(sim_section(args, trace_reason, sim_rows, gpu_name, cuda))
    md.append(f"Whole run: {time.monotonic() - started:.0f} s.\n")
    if bench.errors:
        md.append("**Errors** (not out of memory):\n")
        md += [f"- {e}" for e in bench.errors]
        md.append("")
    benchlib.print_report(TAG, md, args.update_doc)
    return 1 if bench.errors else 0


def intro(args, bench, cuda):
    search_cap = ("; `save_on_cpu` stops its search at the same cap, "
                  "estimated from `none`'s peak memory per sample"
                  if cuda else "")
    where = (f"the daemon at `{args.socket}`" +
             (" (connected)" if bench.connected else
              " (not reached: the in-process policy ran)"
              if bench.connected is False else "")
             if args.socket else "the in-process policy (no daemon)")
    if cuda:
        limit = (f"Every mode trains within {args.memory_limit_gib:g} GiB of "
                 f"GPU memory: PyTorch's caching allocator is capped with "
                 f"`torch.cuda.set_per_process_memory_fraction` (the CUDA "
                 f"context and libraries' own memory are outside it). "
                 f"deltad's budget is the same limit: it keeps saved "
                 f"activations, held by reference in PyTorch's memory, "
                 f"within what parameters, gradients, optimizer state and "
                 f"a reserve of an eighth for temporaries leave. ")
        if args.tf32:
            limit += "fp32 with TF32 matmuls and convolutions. "
    else:
        limit = (f"On the CPU no memory limit is enforced but deltad's: it "
                 f"gets a budget of {size(bench.budget)} "
                 f"(--memory_limit_gib) for saved activations. ")
    return (
        limit +
        f"deltad: {where}, policy `{args.deltad_policy}`, tensors of "
        f"{args.deltad_min_bytes} bytes and more, up to "
        f"{size(bench.host_cap)} of host memory for offloads "
        f"(--host_gib{search_cap}). "
        f"`checkpoint`: `torch.utils.checkpoint` around each residual block "
        f"(Bottleneck) and each transformer Block"
        f"{' (use_reentrant=False)' if _CHECKPOINT_KW else ''}. "
        f"`save_on_cpu`: `torch.autograd.graph.save_on_cpu"
        f"(pin_memory={cuda})`.\n\n"
        f"Largest batch: doubling from 1 up to --max_batch, then bisection; "
        f"a batch fits when 2 training steps (forward, cross-entropy, "
        f"backward, SGD step) run without running out of memory (PyTorch's "
        f"out-of-memory error, or deltad's RESOURCE_EXHAUSTED). Throughput: "
        f"samples/s over {args.steps} steps after 1 warm-up step, at each "
        f"mode's largest batch and at the common batch, the smallest of the "
        f"modes' largest batches (`none`'s largest when the others fit "
        f"more), which every mode runs; `vs none` is the ratio of samples/s "
        f"there. "
        f"`-`: not measured (the reason is beside it).")


def model_section(work, results, common, bench, sample_bytes):
    lines = [f"### {work.name}", "", f"{work.title}."]
    if sample_bytes:
        lines[-1] += (f" `none` peaks at about {sample_bytes / MIB:.0f} MiB "
                      f"more per sample.")
    lines += ["",
              f"| mode | largest batch | search stopped | samples/s at it "
              f"| peak memory (of it deltad's saved activations) | "
              f"samples/s at "
              f"{f'batch {common}' if common else 'the common batch'} "
              f"| vs none |",
              "|---|---:|---|---:|---:|---:|---:|"]
    none_common = results.get("none", {}).get("common")
    base = (none_common.samples_per_s
            if none_common is not None and none_common.ok else None)
    for mode, e in results.items():
        own, at = e["own"], e["common"]
        largest = str(e["largest"]) if e["largest"] else "-"
        why = e["why"] or ""
        if own is None:
            # Fitted but not timed: the time budget ran out.
            rate = "- (out of time)" if e["largest"] else "-"
        elif own.ok:
            rate = fmt_rate(own.samples_per_s)
        else:
            rate = f"- ({'out of memory' if own.oom else 'error'} when timed)"
        peak = "-"
        if own is not None and own.ok:
            parts = []
            if own.torch_peak is not None:
                parts.append(size(own.torch_peak))
            if own.deltad is not None:
                # Held by reference in PyTorch's memory: part of its peak.
                parts.append(f"({size(own.deltad.peak_device_bytes)})")
            peak = " ".join(parts) or "-"
        if at is not None and at.ok:
            common_rate = fmt_rate(at.samples_per_s)
            ratio = (f"{at.samples_per_s / base:.2f}" if base else "-")
        else:
            common_rate = "- (out of time)" if e["largest"] else "-"
            if at is not None and not at.ok:
                common_rate = (f"- ({'out of memory' if at.oom else 'error'}"
                               f" when timed)")
            ratio = "-"
        lines.append(f"| {mode} | {largest} | {why} | {rate} | {peak} | "
                     f"{common_rate} | {ratio} |")
    d = results.get("deltad", {})
    stats_run = d.get("common") if d.get("common") is not None and \
        d["common"].ok else d.get("own")
    if stats_run is not None and stats_run.ok and stats_run.deltad:
        s = stats_run.deltad
        batch = common if stats_run is d.get("common") else d["largest"]
        lines += ["", f"deltad at batch {batch}, over {1 + bench.args.steps} "
                  f"steps: {size(s.offloaded_bytes)} offloaded, "
                  f"{size(s.reloaded_bytes)} reloaded, {s.evictions} "
                  f"evictions, {s.recomputes} recomputes "
                  f"({s.recompute_ns / 1e6:.1f} ms), {s.prefetches} "
                  f"prefetches, {s.stall_ns / 1e6:.1f} ms stalled, "
                  f"{s.host_waits} host waits, {s.overshoots} saves over "
                  f"the budget with nothing to release; saved activations' "
                  f"peak {size(s.peak_device_bytes)} of a "
                  f"{size(s.budget_bytes)} budget for them."]
    lines.append("")
    return "\n".join(lines)


def target_section(work, results, common, bench, args):
    """Times the further batches the targets need (torch_targets) and
    returns the model's target table."""
    largest = {mode: e["largest"] for mode, e in results.items()}
    timed = {}
    for mode, e in results.items():
        if e["common"] is not None:
            timed[(mode, common)] = e["common"]
        if e["own"] is not None:
            timed[(mode, e["largest"])] = e["own"]
    quiet = torch_targets.quiet_batch(work.name, args.smoke)
    for mode, batch in torch_targets.extra_runs(largest, quiet):
        if (mode, batch) not in timed:
            r = bench.timed(work, mode, batch)
            if r is not None:
                timed[(mode, batch)] = r
    cap = bench.cuda
    lines = ["", f"Targets ({'' if cap else 'CPU: '}the batches above and "
             f"deltad timed at the further batches the targets name; "
             f"`vs` is the ratio of samples/s):", ""]
    lines += torch_targets.table(largest, timed, quiet, cap)
    lines.append("")
    return "\n".join(lines)


def trace_row(work, results, common, bench, args, trace_reason, workdir,
              gpu_name):
    """One row of the simulator table: the model recorded at the common
    batch, replayed at deltad's budget ratio and at 1.0."""
    cells = [work.name, str(common) if common else "-"]
    none_r = results.get("none", {}).get("common")
    deltad_r = results.get("deltad", {}).get("common")
    slowdown = None
    if (none_r is not None and none_r.ok and deltad_r is not None and
            deltad_r.ok):
        slowdown = none_r.samples_per_s / deltad_r.samples_per_s
        measured = f"{slowdown:.2f}"
    else:
        measured = "- (needs none and deltad at the common batch)"

    def row(*rest, simulated=None):
        # The target: the simulator predicts the measured step time within
        # +-20%.
        if simulated is None or slowdown is None:
            error = "-"
        else:
            e = simulated / slowdown - 1
            verdict = "met" if abs(e) <= SIM_ERROR else "missed"
            error = f"{e:+.0%} ({verdict})"
        return "| " + " | ".join(cells + list(rest) + [measured, error]) \
            + " |"

    if trace_reason:
        return row("-", "-", "-", trace_reason, "-")
    if not common:
        return row("-", "-", "-", "not recorded: no mode fits batch 1", "-")
    if bench.out_of_time():
        return row("-", "-", "-", "not recorded: the time budget ran out",
                   "-")
    path = os.path.join(workdir, f"{work.name}-b{common}.trace")
    free_memory(bench.cuda)
    if bench.cuda:
        # Recording is not a measurement under the limit: its op times are
        # taken with the GPU synchronized around each op.
        torch.cuda.set_per_process_memory_fraction(1.0, bench.device)
    inputs, targets = work.make_batch(common, bench.device)
    try:
        summary = bench.deltad.torch.record_trace(
            work.model, (inputs,), path,
            name=f"torch_bench-{work.name}-b{common}",
            loss_fn=lambda out: work.loss(out, targets))
    except Exception as e:  # noqa: BLE001: reported in the table
        note(f"{work.name}: recording failed: {short(e)}")
        return row("-", "-", "-", f"not recorded: {short(e)}", "-")
    finally:
        inputs = targets = None
        for p in work.model.parameters():
            p.grad = None
        free_memory(bench.cuda)
    note(f"{work.name}: recorded {summary.ops} ops at batch {common}, peak "
         f"{size(summary.peak_bytes)}")
    ratio = min(1.0, max(0.01, bench.budget / summary.peak_bytes))
    ratio_text = f"{ratio:.2f}"
    ratios = [ratio_text] + (["1.00"] if ratio_text != "1.00" else [])
    try:
        rows = replay(args.policy_bench, path, ratios, sim_profile(gpu_name),
                      workdir)
    except Exception as e:  # noqa: BLE001: reported in the table
        note(f"{work.name}: replay failed: {short(e)}")
        return row(str(summary.ops), size(summary.peak_bytes), ratio_text,
                   f"replay failed: {short(e)}", "-")

    def cell(r):
        got = rows.get(r)
        if got is None:
            return "- (no row)"
        if got["fits"] != "1":
            return f"does not fit ({got['failure'] or 'over budget'})"
        return f"{float(got['slowdown']):.3f}"

    got = rows.get(ratio_text)
    simulated = (float(got["slowdown"]) if got is not None and
                 got["fits"] == "1" else None)
    return row(str(summary.ops), size(summary.peak_bytes), ratio_text,
               cell(ratio_text), cell("1.00"), simulated=simulated)


def sim_section(args, trace_reason, rows, gpu_name, cuda):
    recorded_on = ("GPU (op times: wall times with the GPU synchronized "
                   "around each op)" if cuda else "CPU (op times: wall times)")
    lines = ["### Simulator: recorded traces replayed", ""]
    if trace_reason and all(trace_reason in r or "skipped" in r
                            for r in rows):
        lines.append(f"Traces {trace_reason}.")
        lines.append("")
    lines.append(
        f"Each model recorded for one training iteration at the common batch "
        f"with `deltad.torch.record_trace` on the {recorded_on}, replayed "
        f"by `policy_bench "
        f"--trace_files` on its `{sim_profile(gpu_name)}` profile under the "
        f"`delta` policy at the budget ratio deltad had (its budget / the "
        f"trace's peak; the simulator's budget holds every tensor, deltad's "
        f"only the saved activations, with PyTorch's share beside it) and "
        f"at 1.0. Slowdown: simulated makespan / ideal compute time; "
        f"measured: `none`'s samples/s / `deltad`'s at the common batch; "
        f"error: simulated / measured - 1, against the target of "
        f"{SIM_ERROR:.0%} either way.")
    lines += ["",
              "| model | batch | trace ops | trace peak | budget ratio | "
              "simulated delta slowdown | simulated at 1.0 | measured deltad "
              "slowdown | error |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += rows
    lines.append("")
    return "\n".join(lines)


# --- arguments


def parse_max_batch(text, models, smoke):
    """"N" for every model or "model=N,..." (the others keep the default)."""
    defaults = ({"resnet50": 2, "gpt2": 16} if smoke else
                {"resnet50": 512, "gpt2": 64})
    if text is None:
        return defaults
    out = dict(defaults)
    try:
        if "=" not in text:
            return {m: int(text) for m in MODELS}
        for item in text.split(","):
            key, value = item.split("=")
            if key not in MODELS:
                raise ValueError(f"unknown model {key!r}")
            out[key] = int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--max_batch {text!r}: {e}") from None
    return out


def names(text, allowed, flag):
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{flag}: {', '.join(bad) or 'empty'}: expected some of "
            f"{', '.join(allowed)}")
    return items


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--memory_limit_gib", type=float, default=None,
                   help="GPU memory every mode gets (default 16; --smoke: "
                   "1 on CUDA, 6 MiB on the CPU, where it only sets "
                   "deltad's budget)")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated: resnet50, gpt2")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated: none, checkpoint, save_on_cpu, "
                   "deltad")
    p.add_argument("--max_batch", default=None,
                   help="largest batch tried: N, or model=N,... (default "
                   "resnet50=512,gpt2=64; --smoke: resnet50=2,gpt2=16)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps after one warm-up step (default 10; "
                   "--smoke: 2)")
    p.add_argument("--socket", default=None,
                   help="a running deltad's socket (default: none, the "
                   "in-process policy)")
    p.add_argument("--deltad_policy", default="auto",
                   choices=("auto", "offload", "recompute"))
    p.add_argument("--deltad_min_bytes", type=int, default=None,
                   help="smallest tensor handed to deltad (default 64 KiB; "
                   "--smoke: 1 KiB)")
    p.add_argument("--host_gib", type=float, default=None,
                   help="host memory for offloads: deltad's host memory "
                   "and the cap of save_on_cpu's search (default: half of "
                   "MemAvailable; --smoke: 64 MiB)")
    p.add_argument("--policy_bench", default=None,
                   help="build/bench/policy_bench: record traces and replay "
                   "them")
    p.add_argument("--trace_dir", default=None,
                   help="keep the recorded traces here (default: a "
                   "temporary folder, removed)")
    p.add_argument("--update_doc", default=None,
                   help="rewrite the torch_bench section of this Markdown "
                   "file")
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="start no new try, timed run or recording after "
                   "this many seconds, each model getting an equal share "
                   "of what is left, its searches 60%% of it, shared by the "
                   "modes); what was not run says so")
    p.add_argument("--no_tf32", dest="tf32", action="store_false",
                   help="CUDA: plain fp32 matmuls and convolutions (default: "
                   "TF32 allowed)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models and batches: every code path on a CPU "
                   "in seconds")
    args = p.parse_args(argv)
    try:
        args.models = names(args.models, MODELS, "--models")
        args.modes = names(args.modes, MODES, "--modes")
        args.max_batch = parse_max_batch(args.max_batch, args.models,
                                         args.smoke)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.memory_limit_gib is None:
        # --smoke on the CPU: deltad's budget (6 MiB of saved activations)
        # then holds the smoke GPT's at small batches only, so that it
        # releases some.
        args.memory_limit_gib = ((1.0 if args.device == "cuda" else 6 / 1024)
                                 if args.smoke else 16.0)
    if args.steps is None:
        args.steps = 2 if args.smoke else 10
    if args.deltad_min_bytes is None:
        args.deltad_min_bytes = 1024 if args.smoke else 64 << 10
    if args.host_gib is None:
        if args.smoke:
            # deltad's host memory comes in regions of 64 MiB: less is none.
            args.host_gib = 64 / 1024
        else:
            available = meminfo_bytes("MemAvailable")
            args.host_gib = available / 2 / GIB if available else 16.0
    if args.memory_limit_gib <= 0:
        p.error("--memory_limit_gib must be positive")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if any(v < 1 for v in args.max_batch.values()):
        p.error("--max_batch must be at least 1")
    if args.host_gib <= 0:
        p.error("--host_gib must be positive")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
