"""What deltad.torch's budgets and prices are made of: the link bandwidth
the Director prices offloads at, the memory CUDA libraries take before the
first budget, the reserve's floor, the rule that gives saved activations
their bytes from one iteration to the next, and the default host memory
for offloads."""

import os
import time

import torch as _torch

# Measured link bandwidth per device (bytes/s), once per process.
_bandwidths = {}


def _measure_bandwidth(device, budget_bytes):
    """Host-to-device bytes/s (CUDA: one pinned copy of 64 MiB, or of an
    eighth of the budget if less, at least 1 MiB: under deltad's allocator
    a small budget has no room for 64 MiB; CPU: one memcpy of 16 MiB),
    measured once per device and process."""
    key = device  # hashable: no str() per block
    if key not in _bandwidths:
        if device.type == "cuda":
            nbytes = max(1 << 20, min(64 << 20, budget_bytes // 8))
            host = _torch.empty(nbytes, dtype=_torch.uint8, pin_memory=True)
            dev = _torch.empty(nbytes, dtype=_torch.uint8, device=device)
            dev.copy_(host, non_blocking=True)  # warm-up
            start = _torch.cuda.Event(enable_timing=True)
            end = _torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            nbytes = 16 << 20
            a = _torch.empty(nbytes, dtype=_torch.uint8)
            b = _torch.empty_like(a)
            b.copy_(a)
            begin = time.perf_counter()
            b.copy_(a)
            seconds = time.perf_counter() - begin
        _bandwidths[key] = nbytes / max(seconds, 1e-9)
    return _bandwidths[key]


# PyTorch's caching allocator takes device memory in segments: 2 MiB for
# requests of up to 1 MiB, 20 MiB for those of up to 10 MiB (kSmallBuffer
# and kLargeBuffer in CUDACachingAllocator.cpp). What it holds exceeds what
# it allocated by up to a partly used segment of each kind, and a new one is
# taken whole: a reserve under two large segments cannot absorb one (seen
# on a GPU with a 150 MiB budget under deltad's allocator).
_SEGMENT_SLACK = 2 * (20 << 20)

_warmed_up = set()  # devices whose libraries took their workspaces


def warm_up_libraries(device):
    """cuBLAS and cuBLASLt take their workspaces (through PyTorch's
    allocator: 32 MiB with CUBLAS_WORKSPACE_CONFIG=:4096:8) at their first
    use, inside the first forward, after the first budget for saved
    activations was set from what PyTorch held: that step could overshoot
    the budget by as much. One small product of each kind takes them
    before, so the budget counts them; and a small backward, since
    PyTorch keeps handles per thread and backward runs on autograd's."""
    if device in _warmed_up:
        return
    _warmed_up.add(device)
    a = _torch.ones(16, 16, device=device, requires_grad=True)
    with _torch.enable_grad():
        out = _torch.nn.functional.linear(a, a, a[0])  # cuBLASLt (bias)
        _torch.mm(out, a).sum().backward()  # cuBLAS, on both threads


def _next_saved_budget(budget, others, reserve, last, peak, released,
                       unseen=0):
    """The bytes saved activations may hold in the next iteration (CUDA),
    if it is like the last one (the caller checks that before it gives
    more than the first guess, budget - others - reserve).

    budget: what the process may use in all; others: what it holds with no
    activation saved (parameters, gradients, optimizer state, inputs);
    reserve: the first guess at what temporaries need beside them. last:
    the last iteration's bytes for saved activations and peak: the most
    PyTorch held in it (None: not measured); released: whether the store
    released in it (then those bytes bound it). unseen: memory the peak
    cannot show, kept out of the next iteration's reach: under PyTorch's
    allocator a block freed under a copy still running (record_stream)
    leaves its count at once but is no room until the copy has run, up to
    the store's cap on such bytes.

    Temporaries are what they are: what an iteration left of the budget
    (less a margin of 1/16 for the allocator's fragmentation) goes to
    saved activations in the next, and what it lacked comes out of them.
    Where the store released, the peak follows its bytes, so the next
    peak lands at about the budget less the margin."""
    default = budget - others - reserve
    if last is None or peak is None:
        return max(default, 0)
    margin = budget // 16 + unseen
    if released and peak < others + last - margin:
        # Its saved activations reached `last` beside the others: this
        # peak is not the whole iteration's (something restarted PyTorch's
        # peak statistics meanwhile, as torch_bench does before a run).
        return max(default, 0)
    headroom = budget - margin - peak
    if released:
        saved = last + headroom
    elif headroom >= 0:
        saved = max(default, last)  # held less than its bytes: enough
    else:
        saved = min(default, last + headroom)
    return max(0, min(saved, budget - others - margin))


def _half_the_memory():
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 16 << 30


# Host memory for offloads when the block is given none.
_HOST_DEFAULT = _half_the_memory()
