"""torch_report: torch_bench's Markdown report but for its head lines: the
intro that says how the modes ran and what was measured, a section per
model (each mode's largest batch and samples/s, then the table of the
PyTorch targets, for which it times the further batches torch_targets
names), and the simulator's table, for which it records each model's
trace and replays it in policy_bench.

Imported by torch_bench.py from its own folder, so it goes wherever
torch_bench.py goes (scripts/gpu-pack).
"""

import csv
import os
import subprocess

import torch

import torch_targets
from torch_models import CHECKPOINT_KW
from torch_run import MIB, free_memory, note, short, size

SIM_ERROR = 0.20  # the simulator's step time vs the measured one


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
                 f"a reserve of an eighth for temporaries leave, and from a "
                 f"block's second iteration within what the last one's "
                 f"peak left (docs/PYTORCH.md); it restarts PyTorch's peak "
                 f"statistics at each iteration, so its peak memory below "
                 f"is its last iteration's. ")
        if args.tf32:
            limit += "fp32 with TF32 matmuls and convolutions. "
    else:
        limit = (f"On the CPU no memory limit is enforced but deltad's: it "
                 f"gets a budget of {size(bench.budget)} "
                 f"(--memory_limit_gib) for saved activations. ")
    if getattr(args, "deltad_allocator", False):
        limit += ("deltad's mode runs each try in a process of its own "
                  "(bench/torch_child.py), deltad's allocator serving all "
                  "of its CUDA memory with the limit as its budget, as "
                  "`python -m deltad.run` does, instead of under PyTorch's "
                  "allocator and the memory fraction"
                  + (". " if cuda else " (on the CPU: no allocator). "))
    return (
        limit +
        f"deltad: {where}, policy `{args.deltad_policy}`, tensors of "
        f"{args.deltad_min_bytes} bytes and more, up to "
        f"{size(bench.host_cap)} of host memory for offloads "
        f"(--host_gib{search_cap}). "
        f"`checkpoint`: `torch.utils.checkpoint` around each residual block "
        f"(Bottleneck) and each transformer Block"
        f"{' (use_reentrant=False)' if CHECKPOINT_KW else ''}. "
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
