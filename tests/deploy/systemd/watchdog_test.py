#!/usr/bin/env python3
"""systemd_watchdog_test: deltad's notifications, under a fake systemd.

The test plays systemd's part: it listens on a datagram socket named by
NOTIFY_SOCKET (with SO_PASSCRED, to see which process sends) and starts
`deltad --backend=sim` with WATCHDOG_USEC, and WATCHDOG_PID set to the
daemon's own pid (a shell that execs it), as systemd does for WatchdogSec=.

  test_pets_while_serving   READY=1, then WATCHDOG=1 at about half the
                            interval, every one from the daemon's main
                            process (NotifyAccess=main accepts them); on
                            SIGTERM STOPPING=1, no pet after it, exit 0.
  test_no_watchdog_for_another_pid
                            WATCHDOG_PID names another process: READY=1
                            but no WATCHDOG=1 (sd_watchdog_enabled).
  test_no_watchdog_without_usec
                            no WATCHDOG_USEC: READY=1, no WATCHDOG=1.

Usage: watchdog_test.py <deltad binary> [unittest args]
"""
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest

DELTAD = None
# Generous: under a sanitizer on a loaded 2-core machine start-up takes
# seconds.
READY_TIMEOUT_S = 60.0


class FakeSystemd:
    """A NOTIFY_SOCKET listener that records (time, pid, fields)."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.messages = []

    def close(self):
        self.sock.close()

    def receive(self, timeout_s):
        """The next message, or None after timeout_s."""
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            data, ancdata, _, _ = self.sock.recvmsg(
                4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        except socket.timeout:
            return None
        pid = None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _, _ = struct.unpack("3i", payload[:12])
        fields = dict(
            line.split("=", 1)
            for line in data.decode().split("\n") if "=" in line)
        message = (time.monotonic(), pid, fields)
        self.messages.append(message)
        return message

    def wait_for(self, key, timeout_s):
        """The first message with `key` within timeout_s, else None."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            message = self.receive(left)
            if message is not None and key in message[2]:
                return message

    def collect(self, duration_s):
        """Every message within duration_s."""
        got = []
        deadline = time.monotonic() + duration_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None:
                got.append(message)
        return got


class WatchdogTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="deltad-watchdog-")
        self.systemd = FakeSystemd(os.path.join(self.dir.name, "notify"))
        self.daemon = None
        self.log = open(os.path.join(self.dir.name, "deltad.log"), "w+")

    def tearDown(self):
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.kill()
            self.daemon.wait()
        self.systemd.close()
        self.log.close()
        self.dir.cleanup()

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def start(self, watchdog_usec=None, watchdog_pid="self"):
        """deltad on simulated GPUs, in the test's dir, told to notify."""
        config = os.path.join(self.dir.name, "empty.conf")
        open(config, "w").close()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = self.systemd.path
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        args = [DELTAD, "--config=" + config, "--backend=sim",
                "--sim_gpus=1", "--sim_memory=8GiB", "--host_pool=256MiB",
                "--host_slab=64MiB", "--metrics=127.0.0.1:0",
                "--socket=" + os.path.join(self.dir.name, "deltad.sock")]
        if watchdog_pid == "self":
            # systemd sets WATCHDOG_PID to the pid it forked; exec keeps
            # the shell's pid, so $$ is the daemon's.
            command = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh"]
        else:
            env["WATCHDOG_PID"] = str(watchdog_pid)
            command = []
        self.daemon = subprocess.Popen(command + args, env=env,
                                       stdout=self.log,
                                       stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = None
        while ready is None and time.monotonic() < deadline:
            code = self.daemon.poll()
            self.assertIsNone(code, "deltad exited %s at start:\n%s" %
                              (code, self.output()))
            ready = self.systemd.wait_for("READY", 0.5)
        self.assertIsNotNone(
            ready, "no READY=1 in %.0f s; deltad said:\n%s" %
            (READY_TIMEOUT_S, self.output()))
        self.assertEqual(ready[2]["READY"], "1")
        self.assertEqual(ready[1], self.daemon.pid,
                         "READY=1 came from another process")
        return ready

    def stop(self):
        self.daemon.send_signal(signal.SIGTERM)
        code = self.daemon.wait(timeout=60)
        self.assertEqual(code, 0, "deltad exited %d:\n%s" % (code,
                                                             self.output()))

    def test_pets_while_serving(self):
        usec = 3_000_000  # WatchdogSec=3s: a pet every 1.5 s
        ready = self.start(watchdog_usec=usec)
        pets = []
        deadline = time.monotonic() + 30
        while len(pets) < 5 and time.monotonic() < deadline:
            message = self.systemd.receive(deadline - time.monotonic())
            if message is not None and "WATCHDOG" in message[2]:
                pets.append(message)
        self.assertGreaterEqual(
            len(pets), 5, "%d WATCHDOG=1 in 30 s; deltad said:\n%s" %
            (len(pets), self.output()))
        for _, pid, fields in pets:
            self.assertEqual(fields["WATCHDOG"], "1")
            self.assertEqual(pid, self.daemon.pid,
                             "a pet from another process than the main one")
        # The first pet comes at once, then one per half interval: the gaps
        # stay well under the timeout, which is what keeps systemd content.
        # (Bounds loose enough for a loaded machine.)
        times = [ready[0]] + [p[0] for p in pets]
        gaps = [b - a for a, b in zip(times, times[1:])]
        self.assertLess(max(gaps), usec / 1e6,
                        "a gap between pets reached the timeout: %s" % gaps)
        between = sorted(gaps[1:])[len(gaps[1:]) // 2]
        self.assertGreater(between, 0.3 * usec / 1e6,
                           "pets far more often than half the interval: %s" %
                           gaps)
        self.assertIn("systemd watchdog", self.output())

        self.daemon.send_signal(signal.SIGTERM)
        stopping = self.systemd.wait_for("STOPPING", 30)
        self.assertIsNotNone(stopping, "no STOPPING=1 after SIGTERM")
        self.assertEqual(stopping[2]["STOPPING"], "1")
        after = self.systemd.collect(1.5 * usec / 1e6)
        self.assertFalse([m for m in after if "WATCHDOG" in m[2]],
                         "pets after STOPPING=1")
        code = self.daemon.wait(timeout=60)
        self.assertEqual(code, 0, "deltad exited %d:\n%s" % (code,
                                                             self.output()))

    def test_no_watchdog_for_another_pid(self):
        usec = 1_000_000
        # pid 1 is never the daemon: the watchdog is meant for another
        # process.
        self.start(watchdog_usec=usec, watchdog_pid=1)
        got = self.systemd.collect(3 * usec / 1e6)
        self.assertFalse([m for m in got if "WATCHDOG" in m[2]],
                         "pets though WATCHDOG_PID names another process")
        self.assertNotIn("systemd watchdog", self.output())
        self.stop()

    def test_no_watchdog_without_usec(self):
        self.start(watchdog_usec=None)
        got = self.systemd.collect(2.0)
        self.assertFalse([m for m in got if "WATCHDOG" in m[2]],
                         "pets though no watchdog was asked for")
        self.stop()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    DELTAD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
