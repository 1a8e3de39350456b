#!/usr/bin/env python3
"""The dashboards against a real Prometheus.

Starts deltad on simulated GPUs, a real Prometheus server scraping it every
second and a demo load of deltad-trainer processes (stack.py), then:
  * `promtool check metrics` must accept deltad's /metrics page;
  * every template variable query of every dashboard must offer values (our
    node, GPUs 0 and 1);
  * every panel query (targets[].expr) of every dashboard, with the
    variables substituted as Grafana does, must return data over the load
    from Prometheus's HTTP API: at least one series, and a finite non-zero
    value in it (so rates see traffic and quantiles see decisions).
Exits 77 (skipped) only when the Prometheus server cannot start.

  prometheus_test.py --deltad=PATH --trainer=PATH [--dashboards=DIR]
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stack as st  # noqa: E402

SKIP = 77
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deltad", required=True)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--dashboards", default=os.path.join(ROOT, "dashboards"))
    ap.add_argument("--prometheus", default="prometheus")
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args()

    began = time.monotonic()
    failures = []

    def fail(msg):
        print(f"FAIL: {msg}", flush=True)
        failures.append(msg)

    if shutil.which(args.prometheus) is None:
        print(f"SKIPPED: no Prometheus server ('{args.prometheus}' is not on "
              "PATH; Debian: apt-get install --no-install-recommends "
              "prometheus)", flush=True)
        return SKIP

    dashboards = st.load_dashboards(args.dashboards)
    if not dashboards:
        print(f"FAIL: no dashboards in {args.dashboards}")
        return 1

    with st.Stack(args.deltad, args.trainer, prometheus=args.prometheus,
                  keep=args.keep) as s:
        try:
            s.start_daemon()
            try:
                s.start_prometheus()
            except st.PrometheusUnavailable as e:
                print(f"SKIPPED: {e}", flush=True)
                return SKIP
            s.wait_scraped()
            start, end = s.run_load(iterations=args.iterations)
            page = s.metrics_page()
            s.wait_sample_after(end)
        except (st.StackError, OSError) as e:  # URLError is an OSError
            # The reason again after the logs: a CI report that keeps only
            # the start and the end of the output lost it once.
            print(f"FAIL: {e}\n{s.diagnostics()}\nFAIL: {e}", flush=True)
            return 1

        # The target is healthy: Prometheus parsed every scrape.
        for t in s.api("/api/v1/targets")["activeTargets"]:
            if t["health"] != "up" or t.get("lastError"):
                fail(f"target {t['scrapeUrl']}: {t['health']} "
                     f"{t.get('lastError')}")

        # promtool's lint of the exposition format and the metric names.
        try:
            lint = subprocess.run([args.promtool, "check", "metrics"],
                                  input=page, capture_output=True, text=True,
                                  timeout=30)
            said = (lint.stdout + lint.stderr).strip()
            if lint.returncode != 0 or said:
                fail(f"promtool check metrics: status {lint.returncode}:\n"
                     f"{said}")
            else:
                print("promtool check metrics: no problems "
                      f"({len(page.splitlines())} lines)")
        except FileNotFoundError:
            fail(f"{args.promtool} not found (Debian's prometheus package "
                 "ships it beside the server)")

        queries = 0
        for name, dash in dashboards:
            try:
                values = st.resolve_variables(s, dash,
                                              prefer={"instance": s.instance})
            except st.StackError as e:
                fail(f"{name}: {e}")
                continue
            if values.get("gpu") != ["0", "1"]:
                fail(f"{name}: variable gpu offers {values.get('gpu')}, "
                     "wanted GPUs 0 and 1")
            print(f"{name}: variables {values}")
            for panel in st.panels(dash):
                for target in panel.get("targets", []):
                    expr = st.substitute(target["expr"], values)
                    queries += 1
                    where = f"{name}: panel '{panel.get('title')}' " \
                            f"{target.get('refId')}"
                    try:
                        result = s.query_range(expr, start, end + 1)["result"]
                    except (st.StackError, OSError) as e:
                        fail(f"{where}: {e}")
                        continue
                    points = [float(v) for r in result for _, v in r["values"]
                              if st.finite(v)]
                    if not result:
                        fail(f"{where}: no series for {expr}")
                    elif not any(points):
                        fail(f"{where}: only zero or NaN over the load for "
                             f"{expr}")
                    else:
                        print(f"ok  {where}: {len(result)} series, "
                              f"max {max(points):.4g}")

    took = time.monotonic() - began
    if failures:
        print(f"{len(failures)} failures ({queries} queries, {took:.0f} s)")
        return 1
    print(f"all {queries} panel queries of {len(dashboards)} dashboards "
          f"returned data ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
