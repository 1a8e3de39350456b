"""deltad.Client.session_stats: the client's sessions with the daemon as
the library counts them; a daemon that dies is a session lost, ended on the
client's side too, and the client keeps serving its tensors alone while it
tries to attach again."""

import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
from sim_daemon import SimDaemon  # noqa: E402

import deltad  # noqa: E402

BUDGET = 4 << 20
DEADLINE_S = 20


def wait_for(predicate):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


class SessionStatsTest(unittest.TestCase):

    def setUp(self):
        self.binary = os.environ.get("DELTAD_BINARY")
        if not self.binary:
            self.skipTest("DELTAD_BINARY is not set (ctest sets it)")

    def test_an_open_session_is_counted_once(self):
        with SimDaemon(self.binary, 64 << 20,
                       prefix="deltad-sessions-") as socket:
            with deltad.Client(socket=socket, budget_bytes=BUDGET,
                               device_memory_bytes=BUDGET) as client:
                s = client.session_stats()
                self.assertTrue(s.connected)
                self.assertGreater(s.session_id, 0)
                self.assertEqual((s.reconnects, s.sessions_lost), (0, 0))

    def test_a_dead_daemon_is_a_session_lost_and_the_tensors_stay(self):
        daemon = SimDaemon(self.binary, 64 << 20, prefix="deltad-sessions-")
        socket = daemon.__enter__()
        try:
            with deltad.Client(socket=socket, budget_bytes=BUDGET,
                               device_memory_bytes=BUDGET) as client:
                tensor = 1
                client.track(tensor, 1 << 16)
                client.unpin(tensor)
                daemon.proc.kill()
                daemon.proc.wait()
                s = wait_for(lambda: (lambda s: s if s.sessions_lost >= 1
                                      else None)(client.session_stats()))
                self.assertIsNotNone(s, client.session_stats())
                self.assertFalse(s.connected)
                self.assertEqual(s.sessions_lost, 1)
                # Still served on local decisions.
                client.pin(tensor)
                client.unpin(tensor)
                client.free(tensor)
        finally:
            daemon.__exit__()

    def test_require_session_fails_closed_without_a_daemon(self):
        with self.assertRaises(deltad.DeltadError) as e:
            deltad.Client(socket="/nonexistent/deltad.sock",
                          budget_bytes=BUDGET, require_session=True)
        self.assertIn("require_session is set", str(e.exception))
        os.environ["DELTAD_REQUIRE_SESSION"] = "1"
        try:
            with self.assertRaises(deltad.DeltadError):
                deltad.Client(socket="/nonexistent/deltad.sock",
                              budget_bytes=BUDGET)
        finally:
            del os.environ["DELTAD_REQUIRE_SESSION"]
        # Without it the job goes on, on in-process decisions.
        with deltad.Client(socket="/nonexistent/deltad.sock",
                           budget_bytes=BUDGET) as client:
            self.assertFalse(client.session_stats().connected)

    def test_a_newcomer_that_would_cut_a_declared_floor_is_refused(self):
        with SimDaemon(self.binary, 64 << 20,
                       prefix="deltad-sessions-") as socket:
            with deltad.Client(socket=socket, budget_bytes=24 << 20,
                               min_budget_bytes=24 << 20,
                               device_memory_bytes=24 << 20) as client:
                self.assertTrue(client.session_stats().connected)
                client.iteration_done()  # streamed; the session carries on
                # Another process: one session per process and GPU.
                other = subprocess.run(
                    [sys.executable, "-c",
                     "import deltad, sys\n"
                     "try:\n"
                     f"    deltad.Client(socket={socket!r}, "
                     "budget_bytes=16 << 20, min_budget_bytes=16 << 20, "
                     "require_session=True)\n"
                     "except deltad.DeltadError as e:\n"
                     "    print(e); sys.exit(3)\n"],
                    capture_output=True, text=True, timeout=60)
                self.assertEqual(other.returncode, 3, other.stderr)
                self.assertIn("RESOURCE_EXHAUSTED", other.stdout)
                self.assertIn("without cutting a running job below its "
                              "floor", other.stdout)
                self.assertTrue(client.session_stats().connected)

    def test_sessions_of_one_process_do_not_wait_for_each_others_calls(self):
        # One process, one session per GPU: each session's calls travel on
        # a connection of its own, so that its Session stream and Releases
        # never wait for another session's to end, however few calls the
        # daemon lets one connection carry at once.
        gpus = 3
        with SimDaemon(self.binary, 64 << 20, prefix="deltad-sessions-",
                       gpus=gpus,
                       extra_config="limits { max_concurrent_streams: 2 }\n"
                       ) as socket:
            clients = [deltad.Client(socket=socket, budget_bytes=BUDGET,
                                     host_bytes=4 * BUDGET,
                                     device_memory_bytes=4 * BUDGET, gpu=g)
                       for g in range(gpus)]
            try:
                for g, client in enumerate(clients):
                    self.assertTrue(client.session_stats().connected, g)
                # Past its budget each asks the daemon for room (a Release
                # call beside its stream), and gets it: the daemon grants
                # room past the budget from the GPU's spare memory, with no
                # call timed out and no session lost.
                for client in clients:
                    for t in range(1, 7):
                        client.track(t, 1 << 20)
                        client.unpin(t)
                for g, client in enumerate(clients):
                    s = client.session_stats()
                    self.assertTrue(s.connected, g)
                    self.assertEqual(s.sessions_lost, 0, g)
                    self.assertGreater(client.stats().device_bytes, BUDGET, g)
            finally:
                for client in clients:
                    client.close()


if __name__ == "__main__":
    unittest.main()
