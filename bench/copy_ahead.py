"""copy_ahead: deltad-trainer's iterations with the client's copies ahead of
need (ClientOptions::copy_ahead: the forward pass's tensors copied to host
memory while the link idles, so that offloading one later frees its device
memory at once) against the same runs without them.

Each run: a sim daemon with one GPU whose budget is the trainer's, one
deltad-trainer replaying a model's iterations with real bytes at scale 1/64
through a link slowed to match (bench/prefetch_replay.py's setup). The two
settings alternate, run after run, so that the machine's drift falls on
both. Reported per model and setting: the mean time of the iterations after
the first, the training thread's waits for releases (its synchronous
release calls, copies included) and for tensors not resident, and how many
offloads took a copy made ahead.

  python3 bench/copy_ahead.py [--repeats=3] [--update_doc=docs/BENCHMARKS.md]
"""

import re
import statistics
import sys

import benchlib
from prefetch_replay import (MODELS, ITERATION, budget_bytes, run_trainer,
                             trainer_bench_parser)

TAG = "copy_ahead"
WAITS = re.compile(r"waited ([0-9.]+) s for (\d+) releases, ([0-9.]+) s for "
                   r"tensors")
FROM_COPIES = re.compile(r"\((\d+) of (\d+) offloads from (\d+) copies")


def run(deltad, trainer, model_args, budget, gpu_bytes, ahead, iterations):
    """Iteration times (s), release and tensor waits (s), and offloads from
    copies / offloads of one run."""
    out, _ = run_trainer(deltad, trainer, model_args, budget, gpu_bytes,
                         iterations, trainer_args=[f"--copy_ahead={ahead}"],
                         tag=TAG)
    times = [float(t) for _, t in ITERATION.findall(out)]
    waits = WAITS.search(out)
    if len(times) != iterations or waits is None:
        benchlib.fail(TAG, f"unexpected trainer output: {out}")
    copies = FROM_COPIES.search(out)
    from_copies = (int(copies.group(1)), int(copies.group(2))) if copies \
        else (0, 0)
    return (times, float(waits.group(1)), float(waits.group(3)),
            from_copies)


def main():
    a = trainer_bench_parser(__doc__, iterations=6).parse_args()
    if a.iterations < 2:
        benchlib.fail(TAG, "--iterations must be at least 2")
    rows = []
    for name in a.models.split(","):
        model_args = MODELS[name]
        budget = budget_bytes(a.trainer, model_args, a.budget)
        gpu_bytes = 2 * budget  # the sim daemon hands out half its GPU
        runs = {False: [], True: []}
        for r in range(a.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for ahead in order:
                times, released, stalled, copies = run(
                    a.deltad, a.trainer, model_args, a.budget, gpu_bytes,
                    "true" if ahead else "false", a.iterations)
                runs[ahead].append((statistics.mean(times[1:]), released,
                                    stalled, copies))
                benchlib.note(TAG, f"{name} copy_ahead {ahead} run {r + 1}: "
                              f"{' '.join(f'{t:.3f}' for t in times)} s; "
                              f"waited {released:.3f} s for releases, "
                              f"{stalled:.3f} s for tensors; "
                              f"{copies[0]} of {copies[1]} offloads from "
                              "copies")
        rows.append((name, budget, runs))

    def mean(runs, i):
        return statistics.mean(r[i] for r in runs)

    lines = [
        "## copy_ahead: copies to the host ahead of need",
        "",
        f"Command: `{benchlib.command_line('python3 bench/copy_ahead.py')}`  ",
        f"Machine: {benchlib.cpu_description()}  ",
        f"Date: {benchlib.today()}",
        "",
        f"One deltad-trainer at a budget of {a.budget:.0%} of its peak on a "
        "sim GPU of that budget, scale 1/64, "
        f"{a.iterations} iterations, {a.repeats} runs per setting "
        "alternating. `off`: `--copy_ahead=false`; `on`: the default, the "
        "forward pass's tensors copied to host memory while the executor "
        "idles. Per setting, means over the runs: the time of iterations 2 "
        "on, and the training thread's waits over the whole run for the "
        "releases it asked for (copies included) and for tensors not "
        "resident (reloads, recomputes).",
        "",
        "| model | budget (MiB) | off (s/iteration) | on (s/iteration) "
        "| on / off | releases waited off / on (s) | tensors waited off / on "
        "(s) | offloads from copies (on) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, budget, runs in rows:
        off, on = runs[False], runs[True]
        taken = sum(r[3][0] for r in on)
        offloads = sum(r[3][1] for r in on)
        lines.append(
            f"| {name} | {budget / (1 << 20):.1f} | {mean(off, 0):.3f} | "
            f"{mean(on, 0):.3f} | {mean(on, 0) / mean(off, 0):.3f} | "
            f"{mean(off, 1):.3f} / {mean(on, 1):.3f} | "
            f"{mean(off, 2):.3f} / {mean(on, 2):.3f} | "
            f"{taken} of {offloads} |")
    benchlib.print_report(TAG, lines, a.update_doc or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
