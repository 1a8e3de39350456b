"""bench/ping_flood.py runs against $DELTAD_BINARY and writes its section:
one row per strikes setting and concurrency and one for a client that
reads, the daemon up through the flood (its memory figures are the
benchmark's, nothing here bounds them)."""

import os
import re
import unittest

import bench_doc


class PingFloodBenchTest(unittest.TestCase):

    def test_a_small_flood_writes_its_rows_for_each_strikes_setting(self):
        binary = os.environ.get("DELTAD_BINARY")
        if not binary:
            raise unittest.SkipTest("DELTAD_BINARY is not set")
        text = bench_doc.run_into_doc(
            self, "ping_flood.py",
            ["--binary", binary, "--concurrency", "1,2", "--rounds", "1",
             "--bytes", str(256 << 10), "--seconds", "2", "--strikes", "0,2",
             "--settle", "0.5"])
        rows = re.findall(r"^\| (\d+) \| (\d+) \| 1 \| \d+ \| [\d.]+ \| \+",
                          text, re.MULTILINE)
        self.assertEqual(rows, [("0", "1"), ("0", "2"), ("2", "1"),
                                ("2", "2")], text)
        reading = re.findall(r"^\| (\d+) \| \d+ \| [\d.]+ \| "
                             r"(?:open|closed) \| [\d.]+ \(\d+%\) \| \+",
                             text, re.MULTILINE)
        self.assertEqual(reading, ["0", "2"], text)


if __name__ == "__main__":
    unittest.main()
