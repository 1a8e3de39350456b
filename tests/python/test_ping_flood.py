"""bench/ping_flood.py runs against $DELTAD_BINARY and writes its section:
one row per strikes setting and concurrency and one for a client that
reads, the daemon up through the flood (its memory figures are the
benchmark's, nothing here bounds them)."""

import os
import re
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "bench", "ping_flood.py")


class PingFloodBenchTest(unittest.TestCase):

    def test_a_small_flood_writes_its_rows_for_each_strikes_setting(self):
        binary = os.environ.get("DELTAD_BINARY")
        if not binary:
            raise unittest.SkipTest("DELTAD_BINARY is not set")
        with tempfile.TemporaryDirectory() as d:
            doc = os.path.join(d, "doc.md")
            with open(doc, "w") as f:
                f.write("before\n")
            run = subprocess.run(
                [sys.executable, SCRIPT, "--binary", binary,
                 "--concurrency", "1,2", "--rounds", "1", "--bytes",
                 str(256 << 10), "--seconds", "2", "--strikes", "0,2",
                 "--settle", "0.5",
                 "--update_doc", doc],
                capture_output=True, text=True, timeout=170)
            self.assertEqual(run.returncode, 0, run.stderr)
            with open(doc) as f:
                text = f.read()
        self.assertTrue(text.startswith("before\n"))
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
