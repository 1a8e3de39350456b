"""torch_targets: the targets torch_bench's figures are held to, and the
extra timed runs that measure them.

The PyTorch work promises that a managed run is never slower than a plain
one and goes far bigger (docs/PYTORCH.md): with nothing released, deltad
runs at >= 0.97x `none`; at 1.5x and 2.5x `none`'s largest batch it keeps
>= 0.85x and >= 0.75x of `none`'s samples/s at its largest; its largest
batch is >= 2.5x `none`'s and above checkpoint's; and it is faster than
`checkpoint` and `save_on_cpu` where they run. torch_bench finds each
mode's largest batch and times it; this module names the further
(mode, batch) runs the targets need, then turns the timings into a table
that says, per target, the measured figure and met or missed, or why it
was not measured. Every model gets every row: the ResNet-50 targets read
as well for GPT-2 and the reverse.

Imported by torch_report.py (torch_bench's report) from its own folder;
scripts/gpu-pack ships it beside it. Standard library only.
"""

QUIET_RATIO = 0.97      # nothing released: deltad vs none
BIGGER = 2.5            # deltad's largest batch vs none's
AT_BIGGER = ((1.5, 0.85), (2.5, 0.75))  # (x none's largest, min ratio)


def quiet_batch(name, smoke):
    """The batch at which deltad should release nothing: ResNet-50 at 32,
    GPT-2 at 2 (--smoke: 1, whatever fits)."""
    if smoke:
        return 1
    return {"resnet50": 32, "gpt2": 2}.get(name, 1)


def scaled(largest, factor):
    return max(1, int(round(largest * factor)))


def extra_runs(largest, quiet):
    """The (mode, batch) runs the targets need beyond each mode's largest
    batch and the common one, most important first (a run the time budget
    cut is reported as not measured). `largest`: mode -> largest batch
    (0: none fitted, or skipped)."""
    runs = [("none", quiet), ("deltad", quiet)]
    top = largest.get("deltad", 0)
    base = largest.get("none", 0)
    if base:
        for factor, _ in AT_BIGGER:
            batch = scaled(base, factor)
            if batch <= top:
                runs.append(("deltad", batch))
    for other in ("checkpoint", "save_on_cpu"):
        batch = largest.get(other, 0)
        if batch and batch <= top:
            runs.append(("deltad", batch))
    out = []
    for run in runs:
        # A mode that fitted no batch (skipped, out of time, out of
        # memory at 1) has nothing to time.
        if run not in out and largest.get(run[0], 0):
            out.append(run)
    return out


def _rate(timed, mode, batch):
    """(samples/s or None, why not)."""
    r = timed.get((mode, batch))
    if r is None:
        return None, f"{mode} at batch {batch} not timed (out of time)"
    if not r.ok:
        what = "out of memory" if r.oom else "error"
        return None, f"{mode} at batch {batch}: {what} when timed"
    return r.samples_per_s, None


def _released(r):
    s = r.deltad if r is not None else None
    if s is None:
        return 0
    return s.offloads + s.evictions


def _verdict(value, threshold, fmt="{:.2f}"):
    got = fmt.format(value)
    return got, ("met" if value >= threshold else "missed")


def rows(largest, timed, quiet, cap_enforced):
    """The target table's rows: (target, measured, result). `timed`:
    (mode, batch) -> RunResult; `cap_enforced`: whether a memory limit
    bounds the modes (not on the CPU, where every mode reaches
    --max_batch and the batch targets say nothing)."""
    out = []

    def row(target, measured, result):
        out.append((target, measured, result))

    # Nothing released.
    target = (f"nothing released (batch {quiet}): deltad >= "
              f"{QUIET_RATIO:.2f}x none")
    d, why_d = _rate(timed, "deltad", quiet)
    n, why_n = _rate(timed, "none", quiet)
    if d is None or n is None:
        row(target, "-", why_d or why_n)
    elif _released(timed[("deltad", quiet)]):
        row(target, f"{d / n:.2f}x",
            f"not a quiet run: deltad released "
            f"{_released(timed[('deltad', quiet)])} times at this batch")
    else:
        row(target, *(_verdict(d / n, QUIET_RATIO, "{:.2f}x")))

    top = largest.get("deltad", 0)
    base = largest.get("none", 0)
    why_batch = (None if cap_enforced else
                 "no memory limit here: every mode reaches --max_batch")

    # Far bigger.
    target = f"largest batch >= {BIGGER:g}x none's"
    if why_batch:
        row(target, f"{top} vs {base}", why_batch)
    elif not base or not top:
        row(target, f"{top} vs {base}", "a mode fitted no batch")
    else:
        ratio = top / base
        row(target, f"{top} vs {base} ({ratio:.2f}x)",
            "met" if ratio >= BIGGER else "missed")
    base_rate, why_base = _rate(timed, "none", base) if base else \
        (None, "none fitted no batch")
    for factor, need in AT_BIGGER:
        batch = scaled(base, factor) if base else 0
        target = (f"at {factor:g}x none's largest (batch {batch}): >= "
                  f"{need:.2f}x none's samples/s at its largest")
        if why_batch:
            row(target, "-", why_batch)
        elif not base:
            row(target, "-", why_base)
        elif batch > top:
            row(target, "-", f"missed: deltad's largest is {top}")
        else:
            d, why = _rate(timed, "deltad", batch)
            if d is None or base_rate is None:
                row(target, "-", why or why_base)
            else:
                row(target, *(_verdict(d / base_rate, need, "{:.2f}x")))

    # Above checkpoint, faster than checkpoint and save_on_cpu.
    ckpt = largest.get("checkpoint", 0)
    if "checkpoint" in largest:
        target = "largest batch above checkpoint's"
        if why_batch:
            row(target, f"{top} vs {ckpt}", why_batch)
        else:
            row(target, f"{top} vs {ckpt}",
                "met" if top > ckpt else "missed")
        target = ("samples/s at its largest >= checkpoint's at its "
                  "largest")
        d, why_d = _rate(timed, "deltad", top) if top else \
            (None, "deltad fitted no batch")
        c, why_c = _rate(timed, "checkpoint", ckpt) if ckpt else \
            (None, "checkpoint fitted no batch")
        if d is None or c is None:
            row(target, "-", why_d or why_c)
        else:
            row(target, *(_verdict(d / c, 1.0, "{:.2f}x")))
    for other in ("checkpoint", "save_on_cpu"):
        batch = largest.get(other, 0)
        if other not in largest or not batch:
            continue
        target = (f"faster than {other} at its largest batch ({batch})")
        if batch > top:
            row(target, "-", f"missed: deltad's largest is {top}")
            continue
        d, why_d = _rate(timed, "deltad", batch)
        o, why_o = _rate(timed, other, batch)
        if d is None or o is None:
            row(target, "-", why_d or why_o)
        else:
            row(target, *(_verdict(d / o, 1.0, "{:.2f}x")))
    return out


def table(largest, timed, quiet, cap_enforced):
    """The rows as Markdown lines."""
    lines = ["| target | measured | result |", "|---|---|---|"]
    for target, measured, result in rows(largest, timed, quiet,
                                         cap_enforced):
        lines.append(f"| {target} | {measured} | {result} |")
    return lines
