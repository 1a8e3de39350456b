"""bench/stream_flood.py runs against $DELTAD_BINARY and $DELTAD_DELTACTL
and writes its section: one row per order (calls before or after the
SETTINGS acknowledgement) and gRPC memory quota, the attackers' calls
carried data, the honest client stayed up and `deltactl status`
answered (its memory figures are the benchmark's, nothing here bounds
them)."""

import os
import re
import unittest

import bench_doc


class StreamFloodBenchTest(unittest.TestCase):

    def test_a_small_flood_writes_a_row_per_quota(self):
        binary = os.environ.get("DELTAD_BINARY")
        deltactl = os.environ.get("DELTAD_DELTACTL")
        if not binary or not deltactl:
            raise unittest.SkipTest("DELTAD_BINARY or DELTAD_DELTACTL is "
                                    "not set")
        text = bench_doc.run_into_doc(
            self, "stream_flood.py",
            ["--binary", binary, "--deltactl", deltactl, "--connections",
             "2", "--streams", "8", "--seconds", "1", "--settle", "0.5",
             "--quotas", f"0,{8 << 20}"])
        rows = re.findall(
            r"^\| (before|after) \| (default \(256\)|\d+) \| (\d+) \| "
            r"[\d.]+ \| \+\d+ \| [+-]\d+ \| \d+ \| \d+[^|]* \| \d+ \| "
            r"(\d+) ms \|", text, re.MULTILINE)
        self.assertEqual([r[:2] for r in rows],
                         [("before", "default (256)"), ("before", "8"),
                          ("after", "default (256)"), ("after", "8")], text)
        for order, quota, sent, _ in rows:
            self.assertGreater(int(sent), 0, (order, quota))


if __name__ == "__main__":
    unittest.main()
