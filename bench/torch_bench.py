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
when FILE has none), as the C++ benchmarks do: after each model but the
last, marked incomplete, and at the end. SIGTERM (a time limit's) stops the
run with what had finished written, marked incomplete, the searches' largest
batches so far among it. deltad's search runs right after none's, so that
searches which overrun their share of --time_budget_s (save_on_cpu's pin
tens of GiB) cannot leave it none. Exit status: 0 when every mode ran
(running out of memory is a result, not an error), 1 when a mode failed
otherwise or the run was stopped, 2 for bad arguments, 77 when --device cuda
finds no GPU.
On a GPU machine scripts/gpu-pack runs it after gpu_bench.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

import benchlib
# torch_run first: it exits 2 with a note when PyTorch is not importable,
# before torch and the modules below import it.
from torch_run import (GIB, OUT_OF_TIME, TAG, Bench, free_memory, gib,
                       meminfo_bytes, note)

import torch

from torch_models import MAKERS, MODELS
from torch_report import (intro, model_section, sim_section, target_section,
                          trace_row)

MODES = ("none", "checkpoint", "save_on_cpu", "deltad")
NO_GPU = 77


def import_deltad():
    """deltad and deltad.torch, from PYTHONPATH or this checkout
    (client/python); (None, reason) when neither has it."""
    try:
        return benchlib.import_deltad(), None
    except ImportError as e:
        return None, f"the deltad package is not importable ({e})"


class Stopped(BaseException):
    """SIGTERM, as a stage's time limit sends it (timeout(1)): what had
    finished is still reported. A BaseException, so that a run's own
    handlers, which classify failures, let it through."""


def _stop(signum, frame):
    raise Stopped(f"signal {signum}")


def search_order(modes):
    """deltad's search right after `none`'s, whose batch it is held to:
    the searches share the time, and the later ones get what the earlier
    ones left (save_on_cpu's tries at large batches pin tens of GiB)."""
    first = [m for m in ("none", "deltad") if m in modes]
    return first + [m for m in modes if m not in first]


def common_batch(results):
    """The smallest of the modes' largest batches, which is `none`'s
    largest whenever the others fit more, so that every mode runs it; a
    search cut by the time budget found only a lower bound, and counts
    only where every search was cut."""
    whole = [e["largest"] for e in results.values()
             if e["largest"] and e["why"] != OUT_OF_TIME]
    cut = [e["largest"] for e in results.values() if e["largest"]]
    return min(whole or cut or [0])


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

    def report(stopped=None):
        command = benchlib.command_line("bench/torch_bench.py")
        smoke = (" (smoke run: tiny models, not a benchmark)" if args.smoke
                 else "")
        md = [f"## torch_bench: PyTorch training under one memory limit"
              f"{smoke}", "",
              f"Command: `{command}`  ",
              f"Machine: {machine}  ",
              f"Date: {benchlib.today()}  ",
              f"Software: {benchlib.software()}",
              "",
              intro(args, bench, cuda), ""]
        if stopped:
            md += [f"**Incomplete**: {stopped}.", ""]
        md += sections
        md.append(sim_section(args, trace_reason, sim_rows, gpu_name, cuda))
        md.append(f"Whole run: {time.monotonic() - started:.0f} s.\n")
        if bench.errors:
            md.append("**Errors** (not out of memory):\n")
            md += [f"- {e}" for e in bench.errors]
            md.append("")
        benchlib.print_report(TAG, md, args.update_doc)

    def run_model(i, name, results):
        """One model: each mode's largest batch, the timed runs, its report
        section and simulator row; `results` (mode -> entry) fills as it
        goes, for a report of a run stopped midway."""
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
            return
        work.model.to(bench.device).train()
        max_batch = args.max_batch[name]
        sample_bytes = bench.per_sample_bytes(work)
        # In the report's order, searched in search_order's.
        for mode in args.modes:
            results[mode] = {"largest": 0, "why": None, "own": None,
                             "common": None}
        order = search_order(args.modes)
        for j, mode in enumerate(order):
            if args.time_budget_s:
                # Each mode's search an equal share of what is left of the
                # searches' time.
                now = time.monotonic()
                bench.deadline = now + max(0.0, search_deadline - now) / (
                    len(order) - j)
            entry = results[mode]
            if mode == "deltad" and deltad_module is None:
                entry["why"] = f"skipped: {deltad_reason}"
                continue
            entry["largest"], entry["why"], _ = bench.largest_batch(
                work, mode, max_batch, sample_bytes, found=entry)
        if args.time_budget_s:
            bench.deadline = model_deadline
        # Timed first: the side-by-side comparison matters most when time is
        # short.
        common = common_batch(results)
        for mode, entry in results.items():
            if entry["largest"] >= common > 0:
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

    # A stage's time limit ends the run with SIGTERM: the report then says
    # what had finished, and is written after each model besides, in case
    # the SIGKILL that follows comes first.
    previous = signal.signal(signal.SIGTERM, _stop)
    name, results = None, {}
    try:
        for i, name in enumerate(args.models):
            results = {}
            run_model(i, name, results)
            name = None
            if i + 1 < len(args.models):
                report(f"written after {i + 1} of {len(args.models)} "
                       f"models; the run went on")
    except Stopped as e:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        found = ", ".join(f"{m} {r['largest']}" for m, r in results.items()
                          if r["largest"])
        if name is not None:
            sections.append(
                f"### {name}\n\nstopped during its runs by {e} (the "
                f"stage's time limit)" + (
                    f"; the largest batches found until then, lower bounds "
                    f"where the search had not ended: {found}"
                    if found else "") + ".\n")
        bench.errors.append(f"stopped by {e}")
        report(f"stopped by {e} (the stage's time limit) after "
               f"{time.monotonic() - started:.0f} s")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.trace_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    report()
    return 1 if bench.errors else 0


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
    p.add_argument("--deltad_allocator", action="store_true",
                   help="run deltad's mode in a process of its own per "
                   "try, deltad's allocator serving all of its CUDA memory "
                   "with the limit as its budget, as `python -m deltad.run` "
                   "does (default: in this process, under PyTorch's "
                   "allocator)")
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
