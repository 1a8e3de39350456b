"""bench/torch_recompute.py --smoke: every mode runs, deltad's modes
recompute under their budgets, and the section is written between its
markers. (Its comparison with checkpoint is the benchmark's own figure:
nothing here is timed.)"""

import re
import unittest

from bench_doc import run_into_doc


class SmokeRunTest(unittest.TestCase):

    def test_smoke_run_measures_every_mode_and_updates_the_doc(self):
        text = run_into_doc(self, "torch_recompute.py", ["--smoke"],
                            timeout=240)
        self.assertIn("<!-- torch_recompute:begin -->\n## torch_recompute:",
                      text)
        self.assertTrue(text.endswith("<!-- torch_recompute:end -->\n"))
        rows = {}
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 7:
                rows[cells[0]] = cells
        for mode in ("none", "checkpoint", "deltad 0.5", "deltad 0.1"):
            self.assertIn(mode, rows, text)
            self.assertNotIn("failed", rows[mode][1], text)
        # Under a tenth of their saved peak, deltad's steps must rebuild.
        self.assertGreater(float(rows["deltad 0.1"][6]), 0, text)
        self.assertEqual(rows["none"][6], "-")
        self.assertTrue(re.search(r"- Least memory: `deltad [0-9.]+`", text),
                        text)


if __name__ == "__main__":
    unittest.main()
