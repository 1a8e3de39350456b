"""bench/prefetch_replay.py against $DELTAD_BINARY and $DELTAD_TRAINER:
one short run per setting writes its row, and the daemon said which order
the session kept after its trial (the row's last column; the figures are
the benchmark's, nothing here bounds them)."""

import os
import re
import unittest

import bench_doc


class PrefetchReplayBenchTest(unittest.TestCase):

    def test_a_short_run_writes_its_row_and_the_order_the_daemon_kept(self):
        binary = os.environ.get("DELTAD_BINARY")
        trainer = os.environ.get("DELTAD_TRAINER")
        if not binary or not trainer:
            raise unittest.SkipTest("DELTAD_BINARY or DELTAD_TRAINER unset")
        text = bench_doc.run_into_doc(
            self, "prefetch_replay.py",
            ["--deltad", binary, "--trainer", trainer, "--models", "unet",
             "--repeats", "1", "--iterations", "4"])
        rows = re.findall(
            r"^\| unet \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| "
            r"(its last iteration's order|DELTA's queue) \|$",
            text, re.MULTILINE)
        self.assertEqual(len(rows), 1, text)


if __name__ == "__main__":
    unittest.main()
