"""sim_daemon: a deltad daemon with one simulated GPU, on a socket of its own
in a temporary folder, for the Python benchmarks (bench/torch_overhead.py)
and tests (tests/python/test_torch_managed.py, test_torch_correctness.py,
test_torch_overhead.py).

It lives in bench/ and the tests put bench/ on sys.path, not the other way
round: the tests already depend on bench/ (they run its scripts), while a
benchmark runs, and ships (scripts/gpu-pack), without tests/.

  with SimDaemon(binary, gpu_bytes=256 << 20) as socket:
      deltad.torch.managed(model, ..., socket=socket)
"""

import os
import shutil
import subprocess
import tempfile
import time

# Chunks small enough that rounding the GPU's budget down to whole ones
# leaves it about as it is.
CONFIG = ("min_session_bytes: 262144\ngpu_share: 0.5\n"
          "sim { chunk_bytes: 65536 }\n")
START_TIMEOUT_S = 30


class SimDaemon:
    """deltad `binary` on the simulated backend: `gpus` GPUs of `gpu_bytes`, a
    host pool of `host_pool` in slabs of `host_slab`, its socket, config and stderr in a temporary
    folder named after `prefix`, `extra_config` (text format) added to its
    config. Entering starts it and returns the socket's
    path once the daemon listens (RuntimeError with its stderr when it
    exits or does not listen within 30 s); leaving stops it and removes
    the folder."""

    def __init__(self, binary, gpu_bytes=1 << 30, host_pool="256MiB",
                 prefix="deltad-sim-", extra_config="", host_slab="16MiB",
                 gpus=1):
        self.binary = binary
        self.gpus = gpus
        self.extra_config = extra_config
        self.gpu_bytes = gpu_bytes
        self.host_pool = host_pool
        self.host_slab = host_slab
        self.prefix = prefix
        self.proc = None
        self.dir = None

    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix=self.prefix)
        self.socket = os.path.join(self.dir, "d.sock")
        config = os.path.join(self.dir, "deltad.conf")
        with open(config, "w") as f:
            f.write(CONFIG + self.extra_config)
        # stderr to a file, not a pipe: a daemon that logs much over a long
        # run never blocks on it.
        stderr_path = os.path.join(self.dir, "stderr.txt")
        with open(stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [self.binary, f"--config={config}", "--backend=sim",
                 f"--sim_gpus={self.gpus}", f"--sim_memory={self.gpu_bytes}",
                 f"--host_pool={self.host_pool}", f"--host_slab={self.host_slab}",
                 f"--socket={self.socket}", "--metrics=127.0.0.1:0"],
                stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.time() + START_TIMEOUT_S
        while not os.path.exists(self.socket + ".fds"):
            if self.proc.poll() is not None or time.time() > deadline:
                with open(stderr_path, errors="replace") as f:
                    err = f.read()
                self.__exit__()
                raise RuntimeError(f"deltad did not start: {err.strip()}")
            time.sleep(0.02)
        return self.socket

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
