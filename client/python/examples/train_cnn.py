"""A small CNN trained on random data with its saved activations under a
deltad budget: the two lines are the import and the `with` block.

    scripts/torch-example        # builds the library, runs this

Set DELTAD_SOCKET to a running deltad's socket to use the daemon; without
it (or with no daemon there) the client decides in-process.
"""

import os
import time

import torch

import deltad.torch

BUDGET = 8 << 20  # bytes of saved activations on the device at once


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64 * 16 * 16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    socket = os.environ.get("DELTAD_SOCKET")
    for step in range(5):
        x = torch.randn(32, 3, 32, 32)
        y = torch.randint(0, 10, (32,))
        start = time.perf_counter()
        optimizer.zero_grad()
        with deltad.torch.managed(model, budget_bytes=BUDGET,
                                  socket=socket) as m:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
        s = m.stats()
        print(f"step {step}: loss {loss.item():.4f}  "
              f"{time.perf_counter() - start:.2f} s  "
              f"{m.managed_tensors} activations managed, device peak "
              f"{s.peak_device_bytes / 2**20:.1f} MiB of "
              f"{s.budget_bytes / 2**20:.1f} MiB, offloaded "
              f"{s.offloaded_bytes / 2**20:.1f} MiB, "
              f"{'daemon' if s.connected else 'in-process policy'}")


if __name__ == "__main__":
    main()
