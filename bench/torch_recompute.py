#!/usr/bin/env python3
"""torch_recompute: deltad's recompute beside torch.utils.checkpoint at the
same memory, on the CPU.

torch_bench's GPT-2 target (a larger batch than checkpoint's, at no fewer
samples/s) needs a GPU. Its recompute half does not: this benchmark trains
(forward, cross-entropy loss, backward; no optimizer step, so every mode
keeps the same weights) a small GPT of bench/torch_models.py on the CPU in
these modes, interleaved in one run:

  none         plain training;
  checkpoint   torch.utils.checkpoint around each transformer Block
               (use_reentrant=False where the PyTorch has it);
  deltad F     deltad.torch.managed(policy="recompute", socket=None) with
               a budget of F times the saved activations' peak that deltad
               measures with no limit (on the CPU only recompute frees
               memory: an offload would copy to the same RAM); after
               the fractions of --fractions, one found by bisection
               (--search) whose step peak is at most checkpoint's.

Each mode has its own copy of the model (deltad learns per model what to
record). Per round every mode runs --chunk steps, the modes' order rotating
from round to round; a mode's time is the median step. Its memory is the
peak, over one step under torch.profiler (profile_memory), of the bytes
the step allocated and had not freed (activations, temporaries and
gradients: what torch.cuda.max_memory_allocated would count on a GPU, less
what was held before the step). From those:

  at checkpoint's memory: the fastest deltad mode whose peak is at most
      checkpoint's, its step time over checkpoint's (target: at most 1,
      the samples/s at least checkpoint's);
  least memory: the smallest peak of a deltad mode over checkpoint's, and
      that mode's step time over checkpoint's (below 1: a batch larger
      than checkpoint's fits the same memory).

  python3 bench/torch_recompute.py --update_doc docs/BENCHMARKS.md
  python3 bench/torch_recompute.py --smoke       # every path, seconds

It prints a Markdown section; --update_doc FILE rewrites the section between
<!-- torch_recompute:begin --> and <!-- torch_recompute:end --> of FILE.
Exit status: 0 when every mode ran, 1 when one failed, 2 for bad arguments.
"""

import argparse
import copy
import os
import functools
import statistics
import sys
import time

import benchlib

TAG = "torch_recompute"
note = functools.partial(benchlib.note, TAG)

benchlib.require_torch(TAG)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_models  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--fractions", default="0.75,0.5,0.35,0.25,0.15,0.1,0.05",
                   help="deltad's budgets, as fractions of its saved peak")
    p.add_argument("--search", type=int, default=4,
                   help="bisections of deltad's budget towards checkpoint's "
                   "peak, between the largest fraction at or below it and "
                   "the next (0: the fractions alone)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk", type=int, default=2,
                   help="steps per mode per round")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads (0: one per core)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, one round: every path, seconds")
    p.add_argument("--update_doc", default=None)
    a = p.parse_args()
    if a.smoke:
        a.layers, a.d_model, a.heads, a.seq, a.vocab, a.batch = 2, 32, 2, 16, 64, 2
        a.rounds, a.chunk, a.search = 1, 1, 1
        a.fractions = "0.5,0.1"
    try:
        a.fractions = [float(f) for f in a.fractions.split(",") if f]
    except ValueError:
        benchlib.fail(TAG, f"--fractions: not numbers: {a.fractions!r}")
    if not a.fractions or any(not 0 < f <= 1 for f in a.fractions):
        benchlib.fail(TAG, "--fractions: each in (0, 1]")
    if a.rounds < 1 or a.chunk < 1 or a.search < 0:
        benchlib.fail(TAG, "--rounds and --chunk: at least 1; --search: at "
                      "least 0")
    return a


class Mode:
    """One way to train: a name, its own copy of the model, and a context
    its steps run in (a deltad block, or nothing)."""

    def __init__(self, name, model, checkpointed=False, budget=None):
        self.name = name
        self.model = model
        self.checkpointed = checkpointed
        self.budget = budget  # deltad's, bytes; None: not deltad
        self.min_bytes = 1 << 16  # deltad.torch.managed's default
        self.times = []
        self.peak = None
        self.steps = 0  # counted in the deltad blocks
        self.recomputes = 0
        self.failure = None
        self.searched = False  # its fraction found by search

    def block(self, deltad):
        if self.budget is None:
            return _Nothing()
        return deltad.torch.managed(self.model, budget_bytes=self.budget,
                                    policy="recompute", socket=None,
                                    min_bytes=self.min_bytes)


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

    def stats(self):
        return None


def step(mode, tokens, targets, vocab):
    for p in mode.model.parameters():
        p.grad = None
    logits = mode.model(tokens, checkpointed=mode.checkpointed)
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()


def step_peak(run):
    """The most bytes `run` had allocated and not yet freed at once
    (torch.profiler's memory events, in the order they happened)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU],
                 profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_us())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def run_chunk(mode, deltad, steps, data):
    """`steps` timed steps of `mode` inside one of its blocks."""
    with mode.block(deltad) as manager:
        for _ in range(steps):
            start = time.perf_counter()
            step(mode, *data)
            mode.times.append(time.perf_counter() - start)
    if manager is not None:
        s = manager.stats()
        mode.steps += steps
        mode.recomputes += s.recomputes


def measure_peak(m, deltad, data):
    """Warms `m` up (two steps, untimed), then measures its step peak; a
    failure is the mode's result."""
    try:
        run_chunk(m, deltad, 2, data)
        m.times.clear()
        m.steps = m.recomputes = 0

        def once():
            with m.block(deltad):
                step(m, *data)
        m.peak = step_peak(once)
    except Exception as e:  # noqa: BLE001 (a mode's failure is a result)
        m.failure = f"{type(e).__name__}: {e}"
        note(f"{m.name}: {m.failure}")
    return m.failure is None


def search_checkpoints_peak(a, base, modes, saved_peak, deltad, data,
                            min_bytes):
    """The largest budget found whose step peak is at most checkpoint's:
    bisection between the largest fraction at or below that peak and the
    next fraction up (a peak need not fall with the budget: this finds one
    such budget, not the largest). Its mode, or None where the fractions
    give no such pair or nothing better was found."""
    ck = modes[1]
    if a.search == 0 or ck.failure is not None:
        return None
    ran = sorted((m for m in modes[2:] if m.failure is None),
                 key=lambda m: m.budget)
    below = [m for m in ran if m.peak <= ck.peak]
    if not below:
        return None
    lo = max(below, key=lambda m: m.budget)
    above = [m for m in ran if m.budget > lo.budget]
    if not above:
        return None
    lo_f, hi_f = lo.budget / saved_peak, above[0].budget / saved_peak
    found = None
    for _ in range(a.search):
        f = (lo_f + hi_f) / 2
        m = Mode(f"deltad {f:.3g}", copy.deepcopy(base),
                 budget=max(1, int(f * saved_peak)))
        m.min_bytes = min_bytes
        if not measure_peak(m, deltad, data):
            return found
        note(f"search: {m.name} peaks at {m.peak / 2**20:.2f} MiB")
        if m.peak <= ck.peak:
            m.searched = True
            lo_f, found = f, m
        else:
            hi_f = f
    return found


def main():
    a = parse_args()
    deltad = benchlib.import_deltad()
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    base = torch_models.GPT(a.layers, a.d_model, a.heads, a.seq, a.vocab)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    targets = torch.randint(0, a.vocab, (a.batch, a.seq))
    data = (tokens, targets, a.vocab)

    # deltad's saved peak with no limit: what the budgets are fractions of.
    # The smoke's tensors are tiny: every one goes through deltad's store.
    min_bytes = 1 if a.smoke else 1 << 16
    probe = Mode("probe", copy.deepcopy(base), budget=1 << 50)
    probe.min_bytes = min_bytes
    with probe.block(deltad) as manager:
        step(probe, *data)
    saved_peak = manager.stats().peak_device_bytes
    note(f"saved activations' peak (deltad, no limit): "
         f"{saved_peak / 2**20:.1f} MiB")

    modes = [Mode("none", copy.deepcopy(base)),
             Mode("checkpoint", copy.deepcopy(base), checkpointed=True)]
    for f in a.fractions:
        modes.append(Mode(f"deltad {f:g}", copy.deepcopy(base),
                          budget=max(1, int(f * saved_peak))))
        modes[-1].min_bytes = min_bytes

    # A warm-up step each (deltad's first iteration under pressure learns
    # what to record), then each mode's memory, then the timed rounds.
    for m in modes:
        measure_peak(m, deltad, data)
    searched = search_checkpoints_peak(a, base, modes, saved_peak, deltad,
                                       data, min_bytes)
    if searched is not None:
        modes.append(searched)
        note(f"{searched.name}: {searched.peak / 2**20:.2f} MiB, at or below "
             f"checkpoint's {modes[1].peak / 2**20:.2f}")
    live = [m for m in modes if m.failure is None]
    for r in range(a.rounds):
        k = r % len(live)
        for m in live[k:] + live[:k]:
            try:
                run_chunk(m, deltad, a.chunk, data)
            except Exception as e:  # noqa: BLE001
                m.failure = f"{type(e).__name__}: {e}"
                note(f"{m.name}: {m.failure}")
        live = [m for m in live if m.failure is None]
        note(f"round {r + 1} of {a.rounds}")

    lines = report(a, modes, saved_peak)
    benchlib.print_report(TAG, lines, a.update_doc)
    return 1 if any(m.failure for m in modes) else 0


def report(a, modes, saved_peak):
    none = modes[0]
    ck = modes[1]
    lines = benchlib.head("torch_recompute: deltad's recompute beside "
                          "torch.utils.checkpoint (CPU)", "bench/torch_recompute.py")
    lines += [
        f"A GPT of bench/torch_models.py ({a.layers} layers, d={a.d_model}, "
        f"{a.heads} heads, sequence {a.seq}, vocabulary {a.vocab}), batch "
        f"{a.batch}, fp32, trained (forward, cross-entropy, backward) on the "
        f"CPU ({benchlib.software()}, {torch.get_num_threads()} threads). "
        f"`checkpoint`: torch.utils.checkpoint around each Block. "
        f"`deltad F`: deltad.torch.managed(policy=\"recompute\", "
        f"socket=None) with a budget of F times the saved activations' peak "
        f"deltad measures with no limit ({saved_peak / 2**20:.1f} MiB). "
        f"Each mode's step time is the median of {a.rounds} rounds of "
        f"{a.chunk} steps, the modes interleaved; its memory the peak of "
        f"what one step allocated and had not freed (torch.profiler's "
        f"memory events: activations, temporaries, gradients)."
        + "".join(f" `{m.name}`: its fraction found by {a.search} "
                  f"bisections towards checkpoint's peak (peaks need not "
                  f"fall with the budget)." for m in modes if m.searched),
        "",
        "| mode | step (ms) | vs none | vs checkpoint | step's peak (MiB) "
        "| vs none | recomputes per step |",
        "|---|---:|---:|---:|---:|---:|---:|"]

    def ms(m):
        return statistics.median(m.times) * 1e3 if m.times else None

    def ratio(x, y):
        return f"{x / y:.2f}" if x is not None and y else "-"

    for m in modes:
        t = ms(m)
        if m.failure is not None or t is None:
            why = (m.failure or "no step timed").replace("|", "/")[:120]
            lines.append(f"| {m.name} | failed: {why} | | | | | |")
            continue
        rec = (f"{m.recomputes / m.steps:.1f}" if m.steps else "-")
        lines.append(
            f"| {m.name} | {t:.0f} | {ratio(t, ms(none))} | "
            f"{ratio(t, ms(ck))} | {m.peak / 2**20:.1f} | "
            f"{ratio(m.peak, none.peak)} | {rec} |")
    lines.append("")

    ran = [m for m in modes[2:] if m.failure is None and m.times]
    if ck.failure is None and ck.times and ran:
        within = [m for m in ran if m.peak <= ck.peak]
        if within:
            best = min(within, key=ms)
            r = ms(best) / ms(ck)
            lines.append(
                f"- At checkpoint's memory or less ({ck.peak / 2**20:.1f} "
                f"MiB): the fastest deltad mode is `{best.name}` "
                f"({best.peak / 2**20:.1f} MiB), {r:.2f}x checkpoint's step "
                f"time: **{'met' if r <= 1 else 'missed'}** (target: at "
                f"most 1).")
        else:
            lines.append(
                "- At checkpoint's memory or less: no deltad mode ran "
                "there: **missed** (give smaller --fractions).")
        least = min(ran, key=lambda m: m.peak)
        lines.append(
            f"- Least memory: `{least.name}` at {least.peak / 2**20:.1f} MiB, "
            f"{least.peak / ck.peak:.2f}x checkpoint's peak, at "
            f"{ms(least) / ms(ck):.2f}x its step time.")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
