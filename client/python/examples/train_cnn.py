"""A small CNN trained on random data with its saved activations under a
deltad budget: the two lines are the import and the `with` block.

    scripts/torch-example                      # builds the library, runs this
    scripts/torch-example --policy recompute   # evict and recompute instead
    scripts/torch-example --trace cnn.trace    # also record a trace

Set DELTAD_SOCKET to a running deltad's socket to use the daemon; without
it (or with no daemon there) the client decides in-process.
"""

import argparse
import os
import time

import torch

import deltad.torch

BUDGET = 8 << 20  # bytes of saved activations on the device at once


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="auto",
                        choices=["auto", "offload", "recompute"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", help="also record one iteration here, "
                        "for build/bench/policy_bench --trace_files")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64 * 16 * 16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    socket = os.environ.get("DELTAD_SOCKET")
    for step in range(args.steps):
        x = torch.randn(32, 3, 32, 32)
        y = torch.randint(0, 10, (32,))
        start = time.perf_counter()
        optimizer.zero_grad()
        with deltad.torch.managed(model, budget_bytes=BUDGET, socket=socket,
                                  policy=args.policy) as m:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
        s = m.stats()
        print(f"step {step}: loss {loss.item():.4f}  "
              f"{time.perf_counter() - start:.2f} s  "
              f"{s.saved_tensors} saved tensors in {s.saved_storages} "
              f"storages, peak "
              f"{s.peak_device_bytes / 2**20:.1f} MiB of "
              f"{s.budget_bytes / 2**20:.1f} MiB, offloaded "
              f"{s.offloaded_bytes / 2**20:.1f} MiB "
              f"({s.prefetches} prefetched), evicted {s.evictions} and "
              f"recomputed {s.recomputes}, "
              f"{'daemon' if s.connected else 'in-process policy'}")
    if args.trace:
        summary = deltad.torch.record_trace(
            model, torch.randn(32, 3, 32, 32), args.trace,
            loss_fn=lambda out: out.square().mean())
        print(f"trace {summary.name}: {summary.ops} ops, peak "
              f"{summary.peak_bytes / 2**20:.1f} MiB -> {summary.path}")


if __name__ == "__main__":
    main()
