#!/usr/bin/env python3
"""Where deltad.torch's time goes: ResNet-50 training steps on a CUDA GPU,
unmanaged and then under deltad.torch.managed (in-process, budget large
enough that nothing is released), with the managed steps under cProfile.

Run where python3 has a CUDA PyTorch and torchvision, with the pack of
scripts/gpu-pack:

  LD_LIBRARY_PATH=gpu-pack/lib-python PYTHONPATH=gpu-pack/python \\
  DELTAD_CLIENT_LIBRARY=gpu-pack/lib/libdeltad_client.so \\
    python3 gpu-pack/bench/torch_profile.py [--batch 32] [--steps 5]

Prints ms per step each way and the functions with the most own time.
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
import torchvision

import deltad
import deltad.torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    model = torchvision.models.resnet50().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (args.batch,), device=dev)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def timed(profile=None):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if profile:
            profile.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        if profile:
            profile.disable()
        return (time.perf_counter() - start) / args.steps * 1e3

    print(f"none: {timed():.1f} ms/step")
    client = deltad.Client(socket=None, budget_bytes=8 << 30,
                           host_bytes=4 << 30, fallback_host_bytes=4 << 30,
                           label="torch_profile", device="cuda",
                           cuda_device=0)
    for policy in ("offload", "auto"):
        with deltad.torch.managed(model, budget_bytes=8 << 30, client=client,
                                  policy=policy):
            profile = cProfile.Profile()
            ms = timed(profile)
        print(f"deltad, policy {policy}: {ms:.1f} ms/step")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    client.close()


if __name__ == "__main__":
    main()
