"""One torch_bench run of deltad's mode in a process of its own, deltad's
allocator serving all of its CUDA memory (torch_bench.py
--deltad_allocator): what `python -m deltad.run` gives a script, one budget
per process, where the in-process mode keeps saved activations in the
memory of PyTorch's own allocator under a memory fraction.

Run by torch_run.Bench.run_in_child: reads the run's description (JSON)
on stdin and prints its result as one JSON line. On CUDA the allocator is
installed before anything starts CUDA, with the bench's memory limit as
its budget; on the CPU there is no allocator and the run is the in-process
mode's, in a process of its own.
"""

import argparse
import dataclasses
import json
import sys

import benchlib


def main():
    spec = json.load(sys.stdin)
    args = argparse.Namespace(**spec["args"])
    deltad = benchlib.import_deltad()  # imports torch, does not start CUDA
    if args.device == "cuda":
        deltad.allocator.install(
            budget_bytes=int(args.memory_limit_gib * (1 << 30)),
            socket=args.socket)
    import torch
    from torch_models import MAKERS
    from torch_run import Bench

    if args.device == "cuda" and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    bench = Bench(args, deltad, None, allocator_child=True)
    torch.manual_seed(0)
    work, _ = MAKERS[spec["model"]](args.smoke)
    work.model.to(bench.device).train()
    r = bench.run(work, "deltad", spec["batch"], spec["warmup"],
                  spec["steps"])
    out = {k: getattr(r, k) for k in ("ok", "oom", "error", "seconds",
                                      "samples_per_s", "torch_peak", "wall")}
    out["deltad"] = (dataclasses.asdict(r.deltad) if r.deltad is not None
                     else None)
    out["errors"] = bench.errors
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
