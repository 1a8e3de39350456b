"""Runs a training script with deltad and no change to the script:

    python -m deltad.run [--budget 20GiB] [--socket PATH] train.py [args...]

On a CUDA machine the client library becomes the process's CUDA allocator
first (deltad.allocator.install: one budget for everything the process
allocates), then the whole script runs inside one deltad.torch.managed
block with no model given: autograd's saved activations are held by
reference and offloaded, only past the budget, and reloaded ahead of
backward. (Recompute needs the model: use deltad.torch.managed(model) in
the script for it.) DELTAD_DISABLE=1 runs the script as it is. At exit a
line on standard error says what deltad did.
"""

import argparse
import os
import re
import runpy
import sys

from deltad.client import DEFAULT_SOCKET

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20, "g": 1 << 30,
          "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
          "tib": 1 << 40}


def parse_bytes(text):
    """'20GiB', '512MiB', '1.5g', '1048576' -> bytes; ValueError else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 20GiB, 512MiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a size must be positive: {text!r}")
    return value


def _size(text):
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _arguments(argv):
    p = argparse.ArgumentParser(
        prog="python -m deltad.run",
        description="Runs a training script with deltad.")
    p.add_argument("--budget", type=_size, default=None,
                   help="the process's memory budget (default: on CUDA the "
                   "GPU's memory, else 1GiB of saved activations)")
    p.add_argument("--socket", default=os.environ.get("DELTAD_SOCKET",
                                                      DEFAULT_SOCKET),
                   help="the daemon's socket ('' for none; default "
                   "$DELTAD_SOCKET or %(default)s)")
    p.add_argument("--min_bytes", type=_size, default=64 << 10,
                   help="smallest saved tensor handed to deltad")
    p.add_argument("--no_allocator", action="store_true",
                   help="leave PyTorch's CUDA allocator in place")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs="*", help="the script's arguments")
    # Everything from the script on is the script's, verbatim ("--"
    # included): only what comes before it is parsed here.
    valued = {"--budget", "--socket", "--min_bytes"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in valued else 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    args = p.parse_args(argv[:i] + argv[i:i + 1])
    args.args = argv[i + 1:]
    return args


def _cuda_device(torch):
    """The GPU this process trains on: LOCAL_RANK's where a launcher
    (torchrun, one process per GPU) set it and that GPU is visible, else
    the first. The script calls torch.cuda.set_device(local_rank) only
    after deltad is in place, and device_count() starts no CUDA."""
    rank = os.environ.get("LOCAL_RANK", "").strip()
    if not rank.isdigit():
        return 0
    index = int(rank)
    return index if index < torch.cuda.device_count() else 0


def _gpu_memory(index):
    """GPU `index`'s memory in bytes, read in a child process so that CUDA
    stays uninitialized in this one (the child inherits
    CUDA_VISIBLE_DEVICES)."""
    import subprocess
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda."
         f"get_device_properties({int(index)}).total_memory)"],
        check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def main(argv=None):
    args = _arguments(sys.argv[1:] if argv is None else argv)
    sys.argv = [args.script] + args.args
    # As `python script.py` has it: the script's folder first, in place of
    # the current one that `-m` put there.
    sys.path[0] = os.path.dirname(os.path.abspath(args.script))
    from deltad import allocator

    # Before deltad.torch, whose import loads deltad's extension: off, the
    # script runs as it is even where that cannot load.
    if allocator.disabled():
        runpy.run_path(args.script, run_name="__main__")
        return 0
    import deltad.torch
    import torch

    socket = args.socket or None
    cuda = torch.cuda.is_available()
    index = _cuda_device(torch) if cuda else None
    budget = args.budget
    if budget is None:
        if cuda and not args.no_allocator:
            # Read by another process: get_device_properties (and
            # current_device) initialize CUDA here, and PyTorch 2.0-2.7
            # can then no longer swap its allocator (install() raises).
            budget = _gpu_memory(index)
        else:
            budget = (torch.cuda.get_device_properties(index).total_memory
                      if cuda else 1 << 30)
    if cuda and not args.no_allocator:
        allocator.install(budget_bytes=budget, socket=socket, device=index)
    with deltad.torch.managed(None, budget_bytes=budget, socket=socket,
                              min_bytes=args.min_bytes,
                              device=f"cuda:{index}" if cuda else None,
                              label=os.path.basename(args.script)) as m:
        try:
            runpy.run_path(args.script, run_name="__main__")
        finally:
            s = m.stats()
            served = "PyTorch's allocator"
            if allocator.mode() is not None:
                a = allocator.stats()
                served = (f"deltad's allocator ({allocator.mode()}): peak "
                          f"{a.peak_device_bytes} bytes of a "
                          f"{a.budget_bytes}-byte budget, {a.reclaims} "
                          f"releases on allocation failure freed "
                          f"{a.reclaimed_bytes} bytes")
            print(f"deltad: {s.iterations} iterations, {s.saved_tensors} "
                  f"saved tensors, peak {s.peak_device_bytes} bytes "
                  f"resident of a {s.budget_bytes}-byte budget, "
                  f"{s.offloads} offloads ({s.offloaded_bytes} bytes), "
                  f"{s.prefetches} prefetches, "
                  f"{'daemon' if s.connected else 'in-process'}"
                  + (f"; memory from {served}" if cuda else ""),
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
