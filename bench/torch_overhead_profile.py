"""torch_overhead's --profile: the parts of what deltad.torch.managed
costs when it releases nothing, timed one by one (the hooks as autograd
calls them, the same over plain loops, entering and leaving a block, and
cProfile's view of the Python left), as a Markdown section."""

import os
import statistics
import time

import torch


def identity(x):
    return x


def hook_costs(dt, model, make_input, budget, steps):
    """ns per call of the whole manager hooks (pack and unpack as autograd
    calls them, filter included), timed by wrapping them, less the
    wrapper's own cost. A SavedTensor's death (in C, when autograd lets go
    of it) cannot be wrapped: it counts in the step times only."""
    clock = time.perf_counter_ns
    acc = {}

    def timed(name, fn):
        slot = acc.setdefault(name, [0, 0])

        def wrapper(*a):
            t0 = clock()
            out = fn(*a)
            slot[0] += clock() - t0
            slot[1] += 1
            return out
        return wrapper

    # The wrapper's own cost: it wraps an identity function.
    probe = timed("probe", identity)
    for _ in range(20000):
        probe(None)
    wrapper_ns = acc.pop("probe")[0] / 20000

    x = make_input()
    cm = dt.managed(model, budget_bytes=budget, socket=None, min_bytes=1)
    manager = cm.__enter__()
    try:
        # Replace the hooks the block pushed by timed ones (the same
        # functions): popped and pushed through the public context.
        pack = timed("pack (hook)", manager.pack)
        unpack = timed("unpack (hook)", manager.unpack)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            for _ in range(steps):
                for p in model.parameters():
                    p.grad = None
                model(x).square().mean().backward()
    finally:
        cm.__exit__(None, None, None)
    stats = manager.stats()
    return {k: ((v[0] / v[1] - wrapper_ns) if v[1] else 0.0, v[1] / steps)
            for k, v in acc.items()}, stats, wrapper_ns


def loop_costs(dt, model, budget, count=200, rounds=200):
    """ns per tensor of the managed hooks' three parts, each timed over a
    loop of `count` tensors of their own storage (what autograd's calls
    hide): pack into a new group, the first unpack, and a SavedTensor let
    go (in C, when autograd drops it: not wrappable in a step)."""
    clock = time.perf_counter_ns
    xs = [torch.randn(64) for _ in range(count)]
    total = [0, 0, 0]
    with dt.managed(model, budget_bytes=budget, socket=None,
                    min_bytes=1) as manager:
        pack, unpack = manager.pack, manager.unpack
        for r in range(rounds + 10):
            t0 = clock()
            saved = [pack(x) for x in xs]
            t1 = clock()
            for s in saved:
                unpack(s)
            t2 = clock()
            del s, saved
            t3 = clock()
            if r >= 10:  # warm-up
                total[0] += t1 - t0
                total[1] += t2 - t1
                total[2] += t3 - t2
    n = count * rounds
    return [("pack into a new group (loop)", total[0] / n),
            ("first unpack (loop)", total[1] / n),
            ("SavedTensor let go (loop)", total[2] / n)]


def block_costs(dt, model, make_input, budget, steps):
    """Median us to enter and to leave a managed block (min_bytes=1),
    with a training step inside and with nothing inside: after a step the
    interpreter's code and data are cold."""
    clock = time.perf_counter_ns
    x = make_input()
    out = {}
    for label, work in (("a step inside", True), ("nothing inside", False)):
        enter, leave = [], []
        for i in range(steps + 5):
            for p in model.parameters():
                p.grad = None
            cm = dt.managed(model, budget_bytes=budget, socket=None,
                            min_bytes=1)
            t0 = clock()
            cm.__enter__()
            t1 = clock()
            if work:
                model(x).square().mean().backward()
            t2 = clock()
            cm.__exit__(None, None, None)
            t3 = clock()
            if i >= 5:
                enter.append(t1 - t0)
                leave.append(t3 - t2)
        out[label] = (statistics.median(enter) / 1e3,
                      statistics.median(leave) / 1e3)
    return out


def cprofile_top(dt, model, make_input, budget, steps, limit=12):
    """cProfile over managed steps: tottime per stored tensor of the
    deltad functions and the hooks."""
    import cProfile
    import pstats
    x = make_input()
    prof = cProfile.Profile()
    with dt.managed(model, budget_bytes=budget, socket=None,
                    min_bytes=1) as manager:
        prof.enable()
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            model(x).square().mean().backward()
        prof.disable()
    stored = manager.stats().saved_tensors
    st = pstats.Stats(prof)
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        if "deltad" in path:
            rows.append((tt, ct, nc, f"{os.path.basename(path)}:{line} "
                         f"{func}"))
        elif "deltad" in func:  # the C methods: deltad._savedcore's
            rows.append((tt, ct, nc, func.strip("<>")))
    rows.sort(reverse=True)
    return [(name, tt * 1e9 / stored, ct * 1e9 / stored, nc / steps)
            for tt, ct, nc, name in rows[:limit]], stored / steps


def profile_section(dt, name, model, make_input, title, peak, smoke):
    """The managed hooks' parts per saved tensor, on model `name` (built
    by torch_overhead's MODELS, whose step saves `peak` bytes at most)."""
    budget = max(4 * peak, 1 << 20)
    steps = 5 if smoke else 50
    costs, stats, wrapper_ns = hook_costs(dt, model, make_input, budget,
                                          steps)
    top, stored = cprofile_top(dt, model, make_input, budget, steps)
    lines = [f"### Profile: {name}", "",
             f"The managed hooks timed by wrapping them (the wrapper's own "
             f"{wrapper_ns:.0f} ns subtracted), over {steps} steps of "
             f"{title}, min_bytes=1, nothing released "
             f"({stats.offloads + stats.evictions} releases):", "",
             "| part | calls per step | ns per call | ns per stored "
             "tensor |",
             "|---|---:|---:|---:|"]
    stored_per_step = stats.saved_tensors / steps
    for k, (ns, calls) in costs.items():
        lines.append(f"| {k} | {calls:.0f} | {ns:.0f} | "
                     f"{ns * calls / stored_per_step:.0f} |")
    lines += ["", f"Entering and leaving a block, medians over {steps} "
              f"blocks:", "", "| block | enter (us) | leave (us) |",
              "|---|---:|---:|"]
    for label, (enter, leave) in block_costs(dt, model, make_input, budget,
                                             steps).items():
        lines.append(f"| {label} | {enter:.1f} | {leave:.1f} |")
    rounds = 20 if smoke else 200
    lines += ["", f"The same parts timed over loops of 200 tensors of 64 "
              f"floats, each its own storage ({rounds} rounds; the loop's "
              f"own cost included):", "",
              "| part | ns per tensor |", "|---|---:|"]
    for k, ns in loop_costs(dt, model, budget, rounds=rounds):
        lines.append(f"| {k} | {ns:.0f} |")
    lines += ["", f"cProfile (its own overhead inflates these; "
              f"{stored:.0f} stored tensors per step), deltad's functions "
              f"by own time (the hooks are C methods that autograd calls "
              f"from C++, which cProfile does not see; the Python left is "
              f"what runs once per iteration):", "",
              "| function | own ns per stored tensor | cumulative ns per "
              "stored tensor | calls per step |",
              "|---|---:|---:|---:|"]
    for fname, tt, ct, calls in top:
        lines.append(f"| `{fname}` | {tt:.0f} | {ct:.0f} | {calls:.0f} |")
    lines.append("")
    return "\n".join(lines)
