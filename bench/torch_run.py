"""torch_run: one run of torch_bench (a model trained in one mode at one
batch for some steps, timed, under the memory limit) and the search for a
mode's largest batch built on it, with what a run needs around it: telling
running out of memory from other failures, and freeing what a run left.

It also holds what torch_bench's modules share: the tag of their messages
and of the report, and byte units. It checks for PyTorch before it imports
it (benchlib.require_torch), so torch_bench.py imports it before the
modules that import torch.

Imported by torch_bench.py and torch_report.py from their own folder, so it
goes wherever torch_bench.py goes (scripts/gpu-pack).
"""

import contextlib
import functools
import gc
import json
import os
import re
import subprocess
import sys
import time
import types

import benchlib

TAG = "torch_bench"
GIB = 1 << 30
MIB = 1 << 20
# Why a search stopped when its share of --time_budget_s was spent: its
# largest batch is then only a lower bound.
OUT_OF_TIME = "the time budget (--time_budget_s) ran out"
# deltad.DeltadError's code for RESOURCE_EXHAUSTED (the budget and the host
# memory are both short).
RESOURCE_EXHAUSTED = 8


note = functools.partial(benchlib.note, TAG)

benchlib.require_torch(TAG)
import torch  # noqa: E402


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


# The figures of PyTorch's out-of-memory message (a GPU's total and free
# memory first, which say little under a memory fraction).
_OOM_FIGURES = re.compile(
    r"Tried to allocate (?P<asked>[\d.]+ \w+)|this process has "
    r"(?P<process>[\d.]+ \w+) memory in use|(?P<allocated>[\d.]+ \w+) "
    r"is allocated by PyTorch|(?P<cached>[\d.]+ \w+) is reserved by "
    r"PyTorch but unallocated")

_DELTAD_HELD = re.compile(r"deltad: a budget of .*? offloaded to host memory")


def short(exc, limit=160):
    # One line, and no '|' to break a Markdown table.
    text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace("|", "/")
    if len(text) > limit and "Tried to allocate" in text:
        found = {k: v for m in _OOM_FIGURES.finditer(text)
                 for k, v in m.groupdict().items() if v}
        held = _DELTAD_HELD.search(text)  # deltad.torch's account
        text = (f"{type(exc).__name__}: asked {found.get('asked', '?')}; "
                f"the process holds {found.get('process', '?')}, PyTorch "
                f"{found.get('allocated', '?')} allocated and "
                f"{found.get('cached', '?')} cached"
                + (f"; {held.group(0)}" if held else ""))
        limit = max(limit, len(text))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def deltad_did(stats):
    """What a run's managed block did, for its log line."""
    if stats is None:
        return ""
    return (f" [deltad: saved activations peaked at "
            f"{size(stats.peak_device_bytes)} of {size(stats.budget_bytes)}"
            f"; {stats.offloads} offloads, {stats.evictions} evictions, "
            f"{stats.prefetches} prefetches, {stats.overshoots} overshoots, "
            f"{stats.host_waits} host waits, "
            f"{stats.stall_ns / 1e6:.0f} ms stalled]")


_warmed_up = set()


def warm_up_libraries(device):
    """Has cuBLAS take its per-thread workspaces, which it keeps, before
    any run, as deltad.budget.warm_up_libraries does: the first run of the
    process would read them as memory it left allocated. With plain
    PyTorch, so that every other mode still runs where deltad does not
    import. (free_memory, which follows, waits for the device.)"""
    if device in _warmed_up:
        return
    _warmed_up.add(device)
    a = torch.ones(16, 16, device=device, requires_grad=True)
    with torch.enable_grad():
        # cuBLASLt (a bias), then cuBLAS on this thread and autograd's.
        torch.mm(torch.nn.functional.linear(a, a, a[0]), a).sum().backward()


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
    def __init__(self, args, deltad_module, deltad_reason,
                 allocator_child=False):
        self.args = args
        # In torch_child.py: deltad's allocator caps the process's memory.
        self.allocator_child = allocator_child
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
        if not self.cuda or self.allocator_child:
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

    def _global_swap(self):
        """Whether deltad's allocator serves every allocation of this
        process itself (its global swap: PyTorch 2.0-2.7, or
        DELTAD_ALLOCATOR_ROUTING=global), where PyTorch keeps no memory
        statistics and asking for them raises."""
        return (self.allocator_child and self.deltad is not None and
                self.deltad.allocator.mode() == "global")

    def allocated(self):
        if not self.cuda:
            return 0
        if self._global_swap():
            return self.deltad.allocator.stats().allocated_bytes
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self):
        if not self.cuda:
            return
        if self._global_swap():
            self.deltad.allocator.reset_peak()
        else:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_held(self):
        """The most the run's allocator held: PyTorch's reserved memory, or
        deltad's device memory under its global swap."""
        if self._global_swap():
            return self.deltad.allocator.stats().peak_device_bytes
        return torch.cuda.max_memory_reserved(self.device)

    def run_in_child(self, work, batch, warmup, steps):
        """deltad's mode in a process of its own under deltad's allocator
        (--deltad_allocator; see torch_child.py)."""
        spec = {"args": {k: v for k, v in vars(self.args).items()
                         if isinstance(v, (str, int, float, bool, list,
                                           dict, type(None)))},
                "model": work.name, "batch": batch, "warmup": warmup,
                "steps": steps}
        child = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "torch_child.py")
        result = RunResult()
        start = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, child], input=json.dumps(spec),
                               capture_output=True, text=True, timeout=900)
            lines = p.stdout.strip().splitlines()
            out = json.loads(lines[-1]) if p.returncode == 0 and lines \
                else None
        except (subprocess.TimeoutExpired, ValueError) as e:
            p, out = None, None
            result.error = short(e)
        if out is None:
            result.error = result.error or (
                f"the child process failed (exit {p.returncode}): "
                + " ".join(p.stderr.strip().splitlines()[-3:])[-300:])
            result.oom = "out of memory" in result.error.lower()
        else:
            for k in ("ok", "oom", "error", "seconds", "samples_per_s",
                      "torch_peak"):
                setattr(result, k, out[k])
            if out["deltad"] is not None:
                result.deltad = types.SimpleNamespace(**out["deltad"])
                self.connected = result.deltad.connected
            self.errors += out["errors"]
        result.wall = time.perf_counter() - start
        return result

    def run(self, work, mode, batch, warmup, steps):
        """`warmup` then `steps` timed training steps at `batch`."""
        if mode == "deltad" and getattr(self.args, "deltad_allocator",
                                        False) and not self.allocator_child:
            return self.run_in_child(work, batch, warmup, steps)
        result = RunResult()
        start = time.perf_counter()
        model = work.model
        for p in model.parameters():
            p.grad = None
        if self.cuda:
            warm_up_libraries(self.device)
        if mode == "deltad" and self.deltad is not None:
            # Each run starts as a process of its own would: a search's
            # runs under pressure must not make a later run record module
            # calls from its first iteration.
            self.deltad.torch.forget(model)
        free_memory(self.cuda)
        before = self.allocated()
        self.set_limit(mode)
        self.reset_peak()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        checkpointed = mode == "checkpoint"
        manager = None
        out = loss = None
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
            if manager is not None:
                result.deltad = manager.stats()  # up to the failure
        finally:
            if self.cuda:
                result.torch_peak = self.peak_held()
            for p in model.parameters():
                p.grad = None
            # Drop the batch and whatever a failed step left: a loss whose
            # backward failed still holds its graph (the exception's frames
            # are gone once we leave the handler).
            inputs = targets = optimizer = out = loss = None
            free_memory(self.cuda)
        if self.cuda:
            # The modes share the process: memory a run leaves behind
            # would make every later run fail (it once did).
            left = self.allocated() - before
            if left > 1 << 20:
                self.errors.append(
                    f"{work.name} {mode} at {batch}: left {size(left)} "
                    f"allocated after its run"
                    + ("" if result.ok else f" (it failed: {result.error})"))
                note(self.errors[-1])
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

    def largest_batch(self, work, mode, max_batch, sample_bytes, found=None):
        """Doubling from 1, then bisection between the last batch that fit
        and the first that did not. Returns (largest or 0, why it stopped,
        tries); `found`, a dict, gets the largest so far as "largest" as the
        search goes (a run stopped midway reports it)."""
        tries = []

        def fits(batch):
            if self.out_of_time():
                return None, OUT_OF_TIME
            if (mode == "save_on_cpu" and self.cuda and sample_bytes and
                    sample_bytes * batch > self.host_cap):
                return None, (f"batch {batch} would pin about "
                              f"{gib(sample_bytes * batch)} GiB, over the "
                              f"host memory cap (--host_gib)")
            r = self.run(work, mode, batch, 2, 0)
            tries.append((batch, r))
            if r.ok and found is not None:
                found["largest"] = max(found.get("largest", 0), batch)
            what = ("fits" if r.ok else
                    "out of memory" if r.oom else "ERROR")
            note(f"{work.name} {mode} batch {batch}: {what} "
                 f"({r.wall:.1f} s)" + ("" if r.ok else f": {r.error}")
                 + deltad_did(r.deltad))
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
