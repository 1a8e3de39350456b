"""bench/torch_targets.py: which further batches torch_bench times for the
PyTorch targets, and the verdicts it draws from the timings (met, missed,
or why a figure is missing), on made-up timings."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "bench"))
import torch_targets  # noqa: E402


class Stats:
    def __init__(self, offloads=0, evictions=0):
        self.offloads = offloads
        self.evictions = evictions


class Run:
    """A RunResult's fields that the targets read."""

    def __init__(self, samples_per_s=None, oom=False, released=0,
                 managed=False):
        self.ok = samples_per_s is not None
        self.oom = oom
        self.samples_per_s = samples_per_s
        self.deltad = Stats(offloads=released) if managed else None


LARGEST = {"none": 100, "checkpoint": 180, "save_on_cpu": 150,
           "deltad": 260}


def results(by_row):
    return {target.split(":")[0].split(" (")[0]: (measured, result)
            for target, measured, result in by_row}


class ExtraRunsTest(unittest.TestCase):

    def test_the_quiet_batch_then_the_scaled_and_the_rivals_batches(self):
        self.assertEqual(
            torch_targets.extra_runs(LARGEST, 32),
            [("none", 32), ("deltad", 32), ("deltad", 150),
             ("deltad", 250), ("deltad", 180)])

    def test_batches_over_deltads_largest_are_not_tried(self):
        runs = torch_targets.extra_runs(dict(LARGEST, deltad=160), 32)
        self.assertIn(("deltad", 150), runs)
        self.assertNotIn(("deltad", 250), runs)
        self.assertNotIn(("deltad", 180), runs)

    def test_modes_not_run_are_not_timed(self):
        runs = torch_targets.extra_runs({"none": 10, "deltad": 40}, 2)
        self.assertEqual(runs, [("none", 2), ("deltad", 2), ("deltad", 15),
                                ("deltad", 25)])

    def test_a_mode_that_fitted_nothing_is_not_timed(self):
        # deltad skipped (it did not import) or cut by the time budget
        # before its first try.
        self.assertEqual(
            torch_targets.extra_runs({"none": 10, "deltad": 0}, 2),
            [("none", 2)])


class RowsTest(unittest.TestCase):

    def timed(self):
        t = {("none", 32): Run(1000.0), ("deltad", 32): Run(980.0,
                                                           managed=True),
             ("none", 100): Run(1100.0),
             ("deltad", 150): Run(950.0, managed=True),
             ("deltad", 250): Run(850.0, managed=True),
             ("deltad", 260): Run(840.0, managed=True),
             ("deltad", 180): Run(900.0, managed=True),
             ("checkpoint", 180): Run(800.0),
             ("save_on_cpu", 150): Run(700.0)}
        return t

    def test_every_target_met(self):
        got = results(torch_targets.rows(LARGEST, self.timed(), 32, True))
        self.assertEqual(got["nothing released"], ("0.98x", "met"))
        self.assertEqual(got["largest batch >= 2.5x none's"],
                         ("260 vs 100 (2.60x)", "met"))
        self.assertEqual(got["at 1.5x none's largest"], ("0.86x", "met"))
        self.assertEqual(got["at 2.5x none's largest"], ("0.77x", "met"))
        self.assertEqual(got["largest batch above checkpoint's"],
                         ("260 vs 180", "met"))
        self.assertEqual(got["faster than checkpoint at its largest batch"],
                         ("1.12x", "met"))
        self.assertEqual(got["faster than save_on_cpu at its largest batch"],
                         ("1.36x", "met"))

    def test_slow_runs_are_missed_with_their_figure(self):
        timed = self.timed()
        timed[("deltad", 32)] = Run(950.0, managed=True)
        timed[("deltad", 250)] = Run(700.0, managed=True)
        got = results(torch_targets.rows(LARGEST, timed, 32, True))
        self.assertEqual(got["nothing released"], ("0.95x", "missed"))
        self.assertEqual(got["at 2.5x none's largest"], ("0.64x", "missed"))

    def test_a_quiet_run_that_released_is_not_counted(self):
        timed = self.timed()
        timed[("deltad", 32)] = Run(990.0, managed=True, released=3)
        measured, result = results(torch_targets.rows(
            LARGEST, timed, 32, True))["nothing released"]
        self.assertIn("not a quiet run", result)

    def test_a_smaller_largest_batch_misses_the_scaled_targets(self):
        largest = dict(LARGEST, deltad=140)
        got = results(torch_targets.rows(largest, self.timed(), 32, True))
        self.assertEqual(got["largest batch >= 2.5x none's"][1], "missed")
        self.assertEqual(got["at 1.5x none's largest"],
                         ("-", "missed: deltad's largest is 140"))
        self.assertEqual(got["largest batch above checkpoint's"][1],
                         "missed")

    def test_runs_cut_by_the_time_budget_say_so(self):
        timed = self.timed()
        del timed[("deltad", 150)]
        got = results(torch_targets.rows(LARGEST, timed, 32, True))
        self.assertEqual(got["at 1.5x none's largest"][0], "-")
        self.assertIn("not timed", got["at 1.5x none's largest"][1])

    def test_without_a_memory_cap_the_batch_targets_are_not_judged(self):
        got = results(torch_targets.rows(LARGEST, self.timed(), 32, False))
        self.assertIn("no memory limit",
                      got["largest batch >= 2.5x none's"][1])
        self.assertIn("no memory limit", got["at 1.5x none's largest"][1])
        self.assertEqual(got["nothing released"][1], "met")

    def test_the_table_has_a_row_per_target(self):
        lines = torch_targets.table(LARGEST, self.timed(), 32, True)
        self.assertEqual(lines[0], "| target | measured | result |")
        self.assertEqual(len(lines), 2 + len(torch_targets.rows(
            LARGEST, self.timed(), 32, True)))


if __name__ == "__main__":
    unittest.main()
