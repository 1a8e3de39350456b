"""DistributedDataParallel under deltad.torch.managed, one process per
(CPU) device over gloo: each process opens its own daemon session, and
offloading or recomputing gives the parameters and buffers of an
unmanaged run, bit for bit."""

import contextlib
import os
import socket as _socket
import sys
import tempfile
import unittest

from correctness import SMALL_BUDGET, mlp
import torch

import deltad.torch

# The daemon the benchmarks start too (bench/sim_daemon.py says why it
# lives there).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
from sim_daemon import SimDaemon  # noqa: E402

# --- DistributedDataParallel, one process per (CPU) device

DDP_STEPS = 3


def _free_port():
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, out_dir, daemon_socket):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        results = {}
        for mode in ("unmanaged", "offload", "recompute"):
            torch.manual_seed(0)
            model = DistributedDataParallel(mlp())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)  # each rank its own data
            batches = [torch.randn(16, 32) for _ in range(DDP_STEPS)]
            block = contextlib.nullcontext()
            if mode != "unmanaged":
                block = deltad.torch.managed(
                    model, budget_bytes=SMALL_BUDGET, policy=mode,
                    min_bytes=1, socket=daemon_socket)
            with block as manager:
                for x in batches:
                    optimizer.zero_grad(set_to_none=True)
                    model(x).square().mean().backward()
                    optimizer.step()
            params = [p.detach().clone() for p in model.parameters()]
            params += [b.clone() for b in model.buffers()]
            results[mode] = (params, manager.stats() if manager else None)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _daemon():
    """A SimDaemon on $DELTAD_BINARY for the DDP processes' sessions; a
    context of None when DELTAD_BINARY is not set."""
    binary = os.environ.get("DELTAD_BINARY")
    if not binary:
        return contextlib.nullcontext()
    return SimDaemon(binary, 256 << 20, host_pool="64MiB",
                     prefix="deltad-ddp-")


class DistributedTest(unittest.TestCase):

    def test_ddp_one_managed_session_per_process(self):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("torch.distributed with gloo is not available in "
                          "this PyTorch build")
        import torch.multiprocessing as mp

        world = 2
        with _daemon() as daemon_socket, \
                tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_ddp_worker, args=(world, _free_port(), out_dir,
                                        daemon_socket),
                     nprocs=world, join=True)
            # Not weights_only (PyTorch 2.6's default): ManagerStats.
            results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"),
                                  weights_only=False)
                       for r in range(world)]
        for rank, by_mode in enumerate(results):
            expected, _ = by_mode["unmanaged"]
            # DDP keeps the parameters of the replicas equal (BatchNorm's
            # running statistics are each rank's own since the last
            # broadcast from rank 0).
            n = len(list(mlp().parameters()))
            for a, b in zip(expected[:n], results[0]["unmanaged"][0][:n]):
                self.assertTrue(torch.equal(a, b))
            for mode in ("offload", "recompute"):
                params, stats = by_mode[mode]
                for i, (a, b) in enumerate(zip(expected, params)):
                    self.assertTrue(torch.equal(a, b),
                                    f"rank {rank} {mode}: tensor {i}")
                self.assertGreater(stats.offloads + stats.evictions, 0,
                                   f"rank {rank} {mode}: {stats}")
                if mode == "recompute":
                    self.assertGreater(stats.recomputes, 0, stats)
                # Each process its own session with the daemon, opened by
                # its first block and kept for the next.
                self.assertEqual(stats.connected, daemon_socket is not None)
                self.assertEqual(stats.daemon_round_trips,
                                 1 if daemon_socket and mode == "offload"
                                 else 0)
                self.assertEqual(stats.iterations, DDP_STEPS)


if __name__ == "__main__":
    unittest.main()
