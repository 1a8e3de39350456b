"""prefetch_replay: deltad-trainer's iterations with the daemon's prefetches
always in DELTA's queue order (prefetch_replay_window: 0) against the
default, where each session tries the order of its last iteration and the
queue on two of its own iterations and keeps the faster
(daemon/prefetch_order.h).

Each run: a sim daemon with one GPU whose budget is the trainer's (nothing
to lend beyond it), one deltad-trainer replaying a model's iterations with
real bytes at scale 1/64 through a link slowed to match (as bench/soak's
trainers do). The two settings alternate, run after run, so that the
machine's drift falls on both. Reported: the mean time of the iterations
after the trial (the fourth on), per model and setting, their ratio, and
which order the daemon kept.

  python3 bench/prefetch_replay.py [--repeats=3] [--update_doc=docs/BENCHMARKS.md]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

import benchlib
from sim_daemon import SimDaemon

TAG = "prefetch_replay"
MODELS = {
    # The soak's trainers (bench/soak_trainers.cc), at one budget.
    "gpt": ["--model=gpt", "--batch=2", "--gpt_layers=6", "--gpt_seq=256"],
    "resnet50": ["--model=resnet50", "--batch=16"],
    "unet": ["--model=unet", "--batch=4"],
    "densenet121": ["--model=densenet121", "--batch=8"],
}
SCALE = "--scale=0.015625"
ITERATION = re.compile(r"iteration (\d+)/\d+\s+([0-9.]+) s")
CHOICE = re.compile(r"prefetches follow (.*?) \(")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def budget_bytes(trainer, model_args, budget):
    """The budget the trainer asks for, from a run of no iteration."""
    out = subprocess.run(
        [trainer, "--socket=/nonexistent/deltad.sock", SCALE,
         f"--budget={budget}", "--iterations=0"] + model_args,
        capture_output=True, text=True, timeout=120).stdout
    m = re.search(r"budget ([0-9.]+) (B|KiB|MiB|GiB)", out)
    if m is None:
        benchlib.fail(TAG, f"no budget in the trainer's output: {out!r}")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def run_trainer(deltad, trainer, model_args, budget, gpu_bytes, iterations,
                extra_config="", trainer_args=(), tag=TAG):
    """One deltad-trainer run on a sim daemon of its own: the trainer's
    output and the daemon's log."""
    # Host slabs as small as the soak's: a trainer at scale 1/64 asks for
    # less host memory than one default slab, and a quota is whole slabs.
    with SimDaemon(deltad, gpu_bytes=gpu_bytes, prefix="deltad-bench-",
                   host_slab="2MiB", extra_config=extra_config) as sock:
        out = subprocess.run(
            [trainer, f"--socket={sock}", SCALE, "--chunk_kib=64",
             f"--budget={budget}", f"--iterations={iterations}"] + model_args
            + list(trainer_args),
            capture_output=True, text=True, timeout=1800)
        with open(os.path.join(os.path.dirname(sock), "stderr.txt"),
                  errors="replace") as f:
            log = f.read()
    if out.returncode != 0:
        benchlib.fail(tag, f"trainer failed: {out.stdout}{out.stderr}", 1)
    return out.stdout, log


def run(deltad, trainer, model_args, budget, gpu_bytes, window, iterations):
    """Iteration times (s) of one trainer run, and the daemon's choice."""
    out, log = run_trainer(deltad, trainer, model_args, budget, gpu_bytes,
                           iterations,
                           extra_config=f"prefetch_replay_window: {window}\n")
    times = [float(t) for _, t in ITERATION.findall(out)]
    choice = CHOICE.search(log)
    return times, choice.group(1) if choice else "-"


def trainer_bench_parser(doc, iterations):
    """The options of a bench of deltad-trainer runs (this one's and
    copy_ahead.py's), `iterations` the default."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--deltad", default=os.path.join(
        benchlib.REPO, "build/daemon/deltad"))
    p.add_argument("--trainer", default=os.path.join(
        benchlib.REPO, "build/tools/trainer/deltad-trainer"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget", type=float, default=0.6)
    p.add_argument("--iterations", type=int, default=iterations)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--update_doc", default="")
    return p


def main():
    a = trainer_bench_parser(__doc__, iterations=8).parse_args()
    if a.iterations < 4:
        benchlib.fail(TAG, "--iterations must be at least 4 (3 are the trial)")
    rows = []
    for name in a.models.split(","):
        model_args = MODELS[name]
        budget = budget_bytes(a.trainer, model_args, a.budget)
        # The sim daemon hands out half its GPU (sim_daemon.CONFIG).
        gpu_bytes = 2 * budget
        after = {0: [], 0.25: []}
        choices = []
        for r in range(a.repeats):
            order = (0, 0.25) if r % 2 == 0 else (0.25, 0)
            for window in order:
                times, choice = run(a.deltad, a.trainer, model_args,
                                    a.budget, gpu_bytes, window, a.iterations)
                after[window].append(statistics.mean(times[3:]))
                if window:
                    choices.append(choice)
                benchlib.note(TAG, f"{name} window {window} run {r + 1}: "
                              f"{' '.join(f'{t:.2f}' for t in times)} s; "
                              f"{choice}")
        queue = statistics.mean(after[0])
        auto = statistics.mean(after[0.25])
        rows.append((name, budget, queue, auto, choices))
    lines = [
        "## prefetch_replay: the daemon's prefetch order, per session",
        "",
        f"Command: `{benchlib.command_line('python3 bench/prefetch_replay.py')}`  ",
        f"Machine: {benchlib.cpu_description()}  ",
        f"Date: {benchlib.today()}",
        "",
        f"One deltad-trainer at a budget of {a.budget:.0%} of its peak on a "
        "sim GPU of that budget, scale 1/64, "
        f"{a.iterations} iterations, {a.repeats} runs per setting "
        "alternating; each cell the mean time of iterations 4 on (after "
        "the trial) over the runs. `queue`: prefetch_replay_window 0; "
        "`tried`: the default 0.25, each session keeping the order its "
        "iterations 2 (replayed) and 3 (queue) showed faster.",
        "",
        "| model | budget (MiB) | queue (s/iteration) | tried (s/iteration) "
        "| tried / queue | order kept, per run |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, budget, queue, auto, choices in rows:
        lines.append(f"| {name} | {budget / (1 << 20):.1f} | {queue:.3f} | "
                     f"{auto:.3f} | {auto / queue:.3f} | "
                     f"{', '.join(choices)} |")
    benchlib.print_report(TAG, lines, a.update_doc or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
