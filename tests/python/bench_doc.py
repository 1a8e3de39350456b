"""What the benchmark tests share: a benchmark script run with
--update_doc into a document of its own, the text it left there."""

import os
import subprocess
import sys
import tempfile

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                     "bench")


def run_into_doc(test, script, args, timeout=170):
    """Runs bench/`script` with `args` and --update_doc; asserts (through
    `test`, a TestCase) that it succeeded and kept what the document held
    before its section; returns the document's text."""
    with tempfile.TemporaryDirectory() as d:
        doc = os.path.join(d, "doc.md")
        with open(doc, "w") as f:
            f.write("before\n")
        run = subprocess.run(
            [sys.executable, os.path.join(BENCH, script)] + list(args)
            + ["--update_doc", doc],
            capture_output=True, text=True, timeout=timeout)
        test.assertEqual(run.returncode, 0, run.stderr)
        with open(doc) as f:
            text = f.read()
    test.assertTrue(text.startswith("before\n"))
    return text
