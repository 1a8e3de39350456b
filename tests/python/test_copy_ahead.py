"""bench/copy_ahead.py against $DELTAD_BINARY and $DELTAD_TRAINER: one short
run per setting writes its row, and with copies ahead some offloads took a
copy made ahead (the figures are the benchmark's, nothing here bounds
them)."""

import os
import re
import unittest

import bench_doc


class CopyAheadBenchTest(unittest.TestCase):

    def test_a_short_run_writes_its_row_and_offloads_took_copies(self):
        binary = os.environ.get("DELTAD_BINARY")
        trainer = os.environ.get("DELTAD_TRAINER")
        if not binary or not trainer:
            raise unittest.SkipTest("DELTAD_BINARY or DELTAD_TRAINER unset")
        text = bench_doc.run_into_doc(
            self, "copy_ahead.py",
            ["--deltad", binary, "--trainer", trainer, "--models", "resnet50",
             "--repeats", "1", "--iterations", "2"])
        rows = re.findall(
            r"^\| resnet50 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| "
            r"[\d.]+ / [\d.]+ \| [\d.]+ / [\d.]+ \| (\d+) of (\d+) \|$",
            text, re.MULTILINE)
        self.assertEqual(len(rows), 1, text)
        taken, offloads = map(int, rows[0])
        self.assertGreater(taken, 0, text)
        self.assertLessEqual(taken, offloads)


if __name__ == "__main__":
    unittest.main()
