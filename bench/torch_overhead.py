#!/usr/bin/env python3
"""torch_overhead: what deltad.torch.managed costs when it releases nothing.

Small models whose steps save many small tensors, so that the fixed cost
of each saved tensor dominates, trained (forward, loss, backward; no
optimizer) on the CPU in these modes, interleaved in one run:

  none          no hooks;
  bare          torch.autograd.graph.saved_tensors_hooks whose pack and
                unpack return the tensor: the floor any hook pays;
  managed       deltad.torch.managed(socket=None, policy="auto") with a
                budget of 4x the step's saved peak (nothing released),
                min_bytes=1 (every saved activation goes through the
                store) and the default min_bytes=64 KiB;
  daemon        the same (min_bytes=1) with a deltad daemon
                ($DELTAD_BINARY or build/daemon/deltad, a simulated GPU)
                and socket=...;

each managed mode with the block entered once around a loop of steps (as a
trainer does; the block's entry is not timed) and entered once per step
(timed with the step). Per repetition every mode runs --chunk steps, the
modes' order rotating from one repetition to the next so that drift
spreads over all of them; a mode's figure is the median step time.

The overhead per saved tensor is (median(managed) - median(bare)) / the
tensors autograd saves per step (the pack hook's calls, parameters
included), against the target of 5 us; host waits and daemon round trips
per step are the manager's own counts (ManagerStats), against the target
of 0 and at most 1.

  python3 bench/torch_overhead.py --update_doc docs/BENCHMARKS.md
  python3 bench/torch_overhead.py --smoke        # every path, seconds

It prints a Markdown section; --update_doc FILE rewrites the section between
<!-- torch_overhead:begin --> and <!-- torch_overhead:end --> of FILE
(appending it when FILE has none). --profile also times the managed
hooks' parts (pack, unpack, the saved tensor's release) per saved tensor.
Exit status: 0 when every mode ran, 1 when one failed, 2 for bad arguments.
"""

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import time

import benchlib
from sim_daemon import SimDaemon

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TAG = "torch_overhead"
TARGET_US = 5.0  # per saved tensor, over bare hooks

note = functools.partial(benchlib.note, TAG)

benchlib.require_torch(TAG)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import torch_overhead_profile  # noqa: E402 (after torch)


# --- models


def make_mlp(smoke):
    layers, width, batch = (4, 32, 4) if smoke else (32, 64, 8)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU(), nn.LayerNorm(width)]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    return (model, lambda: torch.randn(batch, width),
            f"{layers} x (Linear({width}, {width}), ReLU, LayerNorm), "
            f"batch {batch}")


def make_cnn(smoke):
    layers, channels, side, batch = (2, 8, 8, 2) if smoke else (8, 16, 16, 4)
    blocks, c_in = [], 3
    for _ in range(layers):
        blocks += [nn.Conv2d(c_in, channels, 3, padding=1),
                   nn.BatchNorm2d(channels), nn.ReLU()]
        c_in = channels
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(channels, 10))
    return (model, lambda: torch.randn(batch, 3, side, side),
            f"{layers} x (Conv2d 3x3 {channels} channels, BatchNorm2d, "
            f"ReLU), {side}x{side} inputs, batch {batch}")


def make_transformer(smoke):
    layers, d, seq, batch = (1, 32, 8, 2) if smoke else (4, 64, 16, 4)
    model = nn.Sequential(*[
        nn.TransformerEncoderLayer(d_model=d, nhead=4, dim_feedforward=2 * d,
                                   dropout=0.0, batch_first=True)
        for _ in range(layers)])
    return (model, lambda: torch.randn(batch, seq, d),
            f"{layers} x TransformerEncoderLayer(d_model={d}, nhead=4, "
            f"dim_feedforward={2 * d}, dropout 0), sequence {seq}, "
            f"batch {batch}")


def make_resnet18(smoke):
    try:
        import torchvision
    except ImportError:
        return None
    side, batch = (32, 1) if smoke else (64, 2)
    model = torchvision.models.resnet18(num_classes=10)
    return (model, lambda: torch.randn(batch, 3, side, side),
            f"torchvision {torchvision.__version__} ResNet-18, "
            f"{side}x{side} inputs, batch {batch}")


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer,
          "resnet18": make_resnet18}


# --- modes


class Mode:
    """One way to run steps. `loop`: the block is entered once around a
    chunk of steps, each step timed alone; else once per step, timed with
    it. `min_bytes`/`socket`: managed()'s (min_bytes None: no deltad)."""

    def __init__(self, name, title, hooks=None, min_bytes=None,
                 socket=None, loop=True):
        self.name = name
        self.title = title
        self.hooks = hooks  # "bare" or None
        self.min_bytes = min_bytes
        self.socket = socket
        self.loop = loop
        self.times = []
        self.stats = []  # ManagerStats of each block
        self.steps = 0   # steps the stats cover

    @property
    def managed(self):
        return self.min_bytes is not None


def identity(x):
    return x


class Runner:
    def __init__(self, dt, model, make_input, budget):
        self.dt = dt
        self.model = model
        self.x = make_input()
        self.budget = budget

    def step(self):
        model = self.model
        for p in model.parameters():
            p.grad = None
        loss = model(self.x).square().mean()
        loss.backward()

    def block(self, mode):
        if mode.managed:
            return self.dt.managed(self.model, budget_bytes=self.budget,
                                   socket=mode.socket,
                                   min_bytes=mode.min_bytes, policy="auto",
                                   label="torch_overhead")
        if mode.hooks == "bare":
            return torch.autograd.graph.saved_tensors_hooks(identity,
                                                            identity)
        return contextlib.nullcontext()

    def run(self, mode, steps, record=True):
        clock = time.perf_counter
        times = []
        # Each block's stats, taken when it ends: a trainer keeps no
        # manager alive past its block, and neither may the benchmark (its
        # objects would slow the garbage collector of later steps).
        stats = []
        if mode.loop:
            with self.block(mode) as manager:
                for _ in range(steps):
                    begin = clock()
                    self.step()
                    times.append(clock() - begin)
            stats.append(manager.stats() if mode.managed else None)
        else:
            for _ in range(steps):
                begin = clock()
                with self.block(mode) as manager:
                    self.step()
                times.append(clock() - begin)
                stats.append(manager.stats() if mode.managed else None)
        manager = None
        if record:
            mode.times += times
            mode.steps += steps
            if mode.managed:
                mode.stats += stats


def count_saved(model, make_input):
    """Tensors autograd saves in one step: the pack hook's calls."""
    calls = [0]

    def pack(t):
        calls[0] += 1
        return t
    x = make_input()
    with torch.autograd.graph.saved_tensors_hooks(pack, identity):
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return calls[0]


def saved_peak(dt, model, make_input):
    """The step's peak of saved activations, as the store counts them."""
    x = make_input()
    with dt.managed(model, budget_bytes=1 << 40, socket=None,
                    min_bytes=1) as manager:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return manager.stats().peak_device_bytes


def total(stats, field):
    return sum(getattr(s, field) for s in stats)


# --- the run


def fmt_ms(seconds):
    return f"{seconds * 1e3:.3f}"


def per_step(stats, field, steps):
    return total(stats, field) / steps if steps else 0.0


def bench_model(args, dt, name, socket, errors):
    made = MODELS[name](args.smoke)
    if made is None:
        note(f"{name}: skipped: torchvision is not importable")
        return (f"### {name}\n\nskipped: torchvision is not importable "
                f"here.\n"), None
    model, make_input, title = made
    torch.manual_seed(0)
    model.train()
    saved = count_saved(model, make_input)
    peak = saved_peak(dt, model, make_input)
    budget = max(4 * peak, 1 << 20)
    runner = Runner(dt, model, make_input, budget)
    modes = [Mode("none", "no hooks"),
             Mode("bare", "bare hooks", hooks="bare"),
             Mode("managed", "managed", min_bytes=1),
             Mode("managed/step", "managed", min_bytes=1, loop=False),
             Mode("managed64", "managed", min_bytes=64 << 10),
             Mode("managed64/step", "managed", min_bytes=64 << 10,
                  loop=False)]
    if socket:
        modes += [Mode("daemon", "managed + daemon", min_bytes=1,
                       socket=socket),
                  Mode("daemon/step", "managed + daemon", min_bytes=1,
                       socket=socket, loop=False)]
    try:
        for mode in modes:  # warm-up: first calls, the bandwidth probe
            runner.run(mode, args.warmup, record=False)
        for rep in range(args.reps):
            k = rep % len(modes)
            for mode in modes[k:] + modes[:k]:
                runner.run(mode, args.chunk)
    except Exception as e:  # noqa: BLE001: reported, the run goes on
        errors.append(f"{name}: {type(e).__name__}: {e}")
        note(errors[-1])
        return f"### {name}\n\nfailed: {errors[-1]}\n", None
    gc.collect()

    med = {m.name: statistics.median(m.times) for m in modes}
    bare = med["bare"]
    rows = []
    verdicts = {}
    for m in modes:
        over = med[m.name] - bare
        us = over * 1e6 / saved if m.name != "none" else None
        cells = [m.name, m.title,
                 "-" if not m.managed else
                 ("once around the loop" if m.loop else "once per step"),
                 "-" if not m.managed else
                 ("1 B" if m.min_bytes == 1 else "64 KiB"),
                 fmt_ms(med[m.name]),
                 f"{over * 1e3:+.3f}" if m.name not in ("none", "bare")
                 else "-",
                 f"{us:+.2f}" if m.managed else "-"]
        if m.managed:
            steps = m.steps
            stored = per_step(m.stats, "saved_tensors", steps)
            groups = per_step(m.stats, "saved_storages", steps)
            waits = per_step(m.stats, "host_waits", steps)
            trips = per_step(m.stats, "daemon_round_trips", steps)
            released = total(m.stats, "offloads") + total(m.stats,
                                                          "evictions")
            iterations = total(m.stats, "iterations")
            cells += [f"{stored:.0f} / {groups:.0f}", f"{waits:g}",
                      f"{trips:.2g}", str(released)]
            if m.socket and not all(x.connected for x in m.stats):
                errors.append(f"{name} {m.name}: not connected to the "
                              f"daemon")
            # A step that stores nothing begins no iteration.
            expected = steps if stored else 0
            if released or iterations != expected:
                errors.append(f"{name} {m.name}: {released} releases, "
                              f"{iterations} iterations in {steps} steps "
                              f"(expected none and {expected})")
            met1 = us <= TARGET_US
            met2 = waits == 0 and trips <= 1
            verdicts[m.name] = (us, met1, waits, trips, met2)
        else:
            cells += ["-", "-", "-", "-"]
        rows.append("| " + " | ".join(cells) + " |")
    steps_per_mode = modes[0].steps
    lines = [f"### {name}", "",
             f"{title}: {saved} tensors saved per step (pack hook calls, "
             f"parameters included); saved peak {peak / 1024:.1f} KiB, "
             f"budget {budget / 1024:.0f} KiB (nothing released). Median of "
             f"{steps_per_mode} steps per mode.", "",
             "| mode | hooks | block entered | min_bytes | ms/step | vs bare "
             "(ms) | per saved tensor (us) | stored / storages per step | "
             "host waits per step | daemon round trips per step | "
             "released |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += rows
    lines.append("")
    return "\n".join(lines), (name, saved, verdicts)


def summary(results):
    lines = ["### Targets", "",
             f"(1) at most {TARGET_US:g} us per saved tensor over bare "
             "hooks with nothing released (`managed`, min_bytes=1, "
             "socket=None); (2) 0 host waits and at most 1 daemon round "
             "trip per step.", "",
             "| model | saved per step | block around the loop (us per "
             "tensor) | block per step (us per tensor) | min_bytes 64 KiB, "
             "around / per step | daemon: around / per step | host waits, "
             "round trips per step (worst) | (1) around the loop | (1) per "
             "step | (2) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for name, saved, v in results:
        def us(key):
            return f"{v[key][0]:.2f}" if key in v else "-"

        def met(key):
            return (f"{'met' if v[key][1] else 'missed'} "
                    f"({v[key][0]:.2f} us)")
        worst_w = max(x[2] for x in v.values())
        worst_t = max(x[3] for x in v.values())
        met2 = all(x[4] for x in v.values())
        lines.append(
            f"| {name} | {saved} | {us('managed')} | {us('managed/step')} | "
            f"{us('managed64')} / {us('managed64/step')} | "
            f"{us('daemon')} / {us('daemon/step')} | "
            f"{worst_w:g}, {worst_t:.2g} | {met('managed')} | "
            f"{met('managed/step')} | {'met' if met2 else 'missed'} |")
    lines.append("")
    return "\n".join(lines)


def run_bench(args):
    dt = benchlib.import_deltad().torch
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    errors = []
    daemon_note = None
    binary = args.daemon or os.environ.get("DELTAD_BINARY") or os.path.join(
        REPO, "build", "daemon", "deltad")
    daemon = None
    socket = None
    if args.no_daemon:
        daemon_note = "the daemon modes were not run (--no_daemon)"
    elif not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        daemon_note = (f"the daemon modes were not run: {binary} is not an "
                       f"executable (--daemon)")
    else:
        daemon = SimDaemon(binary, prefix="torch_overhead-")
        try:
            socket = daemon.__enter__()
        except RuntimeError as e:
            daemon, daemon_note = None, f"the daemon modes were not run: {e}"
    if daemon_note:
        note(daemon_note)
    sections, results = [], []
    try:
        for name in args.models:
            text, result = bench_model(args, dt, name, socket, errors)
            sections.append(text)
            if result is not None:
                results.append(result)
        if args.profile:
            model, make_input, title = MODELS[args.profile](args.smoke)
            torch.manual_seed(0)
            peak = saved_peak(dt, model, make_input)
            sections.append(torch_overhead_profile.profile_section(
                dt, args.profile, model, make_input, title, peak,
                args.smoke))
    finally:
        if daemon is not None:
            # Sessions end first: a daemon stopping waits for them to.
            dt.close_sessions()
            daemon.__exit__()

    command = benchlib.command_line("python3 bench/torch_overhead.py")
    smoke = " (smoke run: tiny models, not a benchmark)" if args.smoke else ""
    threads = (f"torch.set_num_threads({args.threads})" if args.threads
               else f"{torch.get_num_threads()} intra-op threads")
    md = [f"## torch_overhead: deltad.torch.managed's cost when nothing is "
          f"released{smoke}", "",
          f"Command: `{command}`  ",
          f"Machine: CPU {benchlib.cpu_description()}, {threads}  ",
          f"Date: {benchlib.today()}  ",
          f"Software: {benchlib.software()}", "",
          "One step: the gradients set to None, forward, `square().mean()`, "
          "backward (no optimizer). Modes, interleaved: `none` (no hooks), "
          "`bare` (`saved_tensors_hooks` whose pack and unpack return the "
          "tensor), `managed` (`deltad.torch.managed(model, budget, "
          "socket=None, policy=\"auto\")`, min_bytes=1 or the default 64 "
          "KiB, `64` in the name), `daemon` (min_bytes=1 with a deltad "
          "daemon on a simulated GPU, `socket=` its socket: the process's "
          "first block opens the session, the others reuse it); `/step`: "
          "the "
          "block entered once per step and timed with it, else once around "
          f"each run of {args.chunk} steps, its entry not timed. Every "
          f"repetition runs {args.chunk} steps of each mode, in an order "
          f"that rotates; {args.warmup} warm-up steps per mode first. "
          "Per saved tensor: (median ms/step of the mode - `bare`'s) / the "
          "tensors autograd saves per step. Stored / storages: the saved "
          "tensors the manager kept, and the storages they view "
          "(parameters and, with 64 KiB, the smaller tensors are returned "
          "as they are). Host waits and daemon round trips: the manager's "
          "own counts (ManagerStats) over all its blocks, per step.", ""]
    if daemon_note:
        md += [f"Note: {daemon_note}.", ""]
    md += sections
    if results:
        md.append(summary(results))
    md.append(f"Whole run: {time.monotonic() - started:.0f} s.\n")
    if errors:
        md.append("**Errors:**\n")
        md += [f"- {e}" for e in errors]
        md.append("")
    benchlib.print_report(TAG, md, args.update_doc)
    return 1 if errors else 0


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn,transformer,resnet18",
                   help="comma-separated: " + ", ".join(MODELS) +
                   " (resnet18 needs torchvision; skipped without it)")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions (default 25; --smoke: 2)")
    p.add_argument("--chunk", type=int, default=None,
                   help="steps of each mode per repetition (default 4; "
                   "--smoke: 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per mode (default 5; --smoke: 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1, to cut noise; "
                   "0: PyTorch's default)")
    p.add_argument("--daemon", default=None,
                   help="the deltad binary (default $DELTAD_BINARY, else "
                   "build/daemon/deltad)")
    p.add_argument("--no_daemon", action="store_true",
                   help="skip the daemon modes")
    p.add_argument("--profile", default=None, choices=sorted(MODELS),
                   help="also time the managed hooks' parts on this model")
    p.add_argument("--update_doc", default=None,
                   help="rewrite the torch_overhead section of this Markdown "
                   "file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, few steps: every code path in seconds")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    if args.reps is None:
        args.reps = 2 if args.smoke else 25
    if args.chunk is None:
        args.chunk = 2 if args.smoke else 4
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 5
    if args.reps < 1 or args.chunk < 1 or args.warmup < 0:
        p.error("--reps and --chunk must be at least 1, --warmup at least 0")
    if args.threads < 0:
        p.error("--threads must be at least 0")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
