#!/usr/bin/env python3
"""Static checks of the Grafana dashboards (no server needed).

Every dashboards/*.json must parse and have: a title, a unique uid, the tag
`deltad`, the variables DS_PROMETHEUS (a Prometheus data source), instance
(label_values(deltad_build_info, instance)) and gpu
(label_values(deltad_gpu_budget_bytes{instance=~"$instance"}, gpu)). Every
panel: a unique id, a title, a description, a grid position, the
${DS_PROMETHEUS} data source (on the panel and its targets), a unit
(fieldConfig.defaults.unit, one Grafana knows) and at least one target
with an expr. Every expr: only metrics that daemon/metrics.cc registers
(histograms with their _bucket/_sum/_count series), only labels it sets (or
Prometheus adds: instance, job, le), only label values it sets for its
fixed-valued labels, every deltad selector filtered by $instance (and by
$gpu where the metric has a gpu label), and rate windows of
$__rate_interval.

  check_dashboards.py [--dashboards=DIR] [--metrics_cc=FILE]
  check_dashboards.py --self_test   # the checks catch broken copies
"""

import argparse
import copy
import json
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))

DS_UID = "${DS_PROMETHEUS}"
# Grafana unit ids the dashboards may use.
UNITS = {"bytes", "decbytes", "Bps", "binBps", "ops", "reqps", "s", "ms",
         "µs", "ns", "short", "none", "percent", "percentunit"}
PROMETHEUS_LABELS = {"instance", "job", "le"}
VARIABLES = {
    "instance": "label_values(deltad_build_info, instance)",
    "gpu": 'label_values(deltad_gpu_budget_bytes{instance=~"$instance"}, gpu)',
}
SELECTOR = re.compile(r"\b(deltad_\w+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def read_metrics(path):
    """From metrics.cc: {name: type}, the label names, and the values of
    the labels whose values are string literals ({label: {values}})."""
    with open(path) as f:
        src = f.read()
    metrics = {name: kind.lower() for kind, name in re.findall(
        r"Build(Gauge|Counter|Histogram|Summary)\(\)\s*\.Name\(\"(\w+)\"\)",
        src)}
    labels = set(re.findall(r"\{\s*\"(\w+)\"\s*,", src))
    labels |= set(re.findall(r"with\(\s*\"(\w+)\"\s*,", src))
    fixed = {}
    for label, value in re.findall(
            r"(?:\{|with\()\s*\"(\w+)\"\s*,\s*\"([^\"]*)\"\s*[})]", src):
        fixed.setdefault(label, set()).add(value)
    # Labels given a value that is not a literal (gpu, uuid, version...)
    # take any value.
    for label in list(fixed):
        if re.search(r"\{\s*\"%s\"\s*,\s*[^\"\s]" % label, src):
            del fixed[label]
    # Per-GPU metrics: those whose Add() gets the GPU's labels.
    per_gpu = set()
    for var, name in re.findall(
            r"auto&\s*(\w+)\s*=\s*prometheus::Build\w+\(\)\s*\.Name\(\"(\w+)\"\)",
            src):
        if re.search(r"\b%s\.Add\((labels|with\()" % var, src):
            per_gpu.add(name)
    return metrics, labels, fixed, per_gpu


class Checker:
    def __init__(self, metrics_cc):
        self.metrics, self.labels, self.fixed, self.per_gpu = \
            read_metrics(metrics_cc)
        if not self.metrics or "gpu" not in self.labels:
            raise SystemExit(f"{metrics_cc}: found no metrics or no gpu label;"
                             " has the way metrics are registered changed?")
        self.errors = []

    def error(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    def base_metric(self, name):
        if name in self.metrics:
            return name
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and self.metrics.get(base) == "histogram":
                return base
        return None

    def check_expr(self, where, expr):
        if not SELECTOR.search(expr):
            self.error(where, f"no deltad metric in {expr!r}")
        for m in SELECTOR.finditer(expr):
            name, body = m.group(1), m.group(2) or ""
            base = self.base_metric(name)
            if base is None:
                self.error(where, f"metric {name} is not in daemon/metrics.cc")
                continue
            matchers = MATCHER.findall(body)
            seen = {label: (op, value) for label, op, value in matchers}
            for label, op, value in matchers:
                if label not in self.labels | PROMETHEUS_LABELS:
                    self.error(where, f"label {label} (in {name}) is not set "
                                      "by daemon/metrics.cc")
                elif op == "=" and label in self.fixed and \
                        value not in self.fixed[label]:
                    self.error(where, f"{label}=\"{value}\" (in {name}): "
                                      f"the values are "
                                      f"{sorted(self.fixed[label])}")
            if seen.get("instance") != ("=~", "$instance"):
                self.error(where, f'{name} is not filtered by '
                                  f'instance=~"$instance"')
            if base in self.per_gpu and seen.get("gpu") != ("=~", "$gpu"):
                self.error(where, f'{name} is not filtered by gpu=~"$gpu"')
        for window in re.findall(r"\[([^\]]*)\]", expr):
            if window != "$__rate_interval":
                self.error(where, f"range [{window}]: use [$__rate_interval]")

    def check_datasource(self, where, ds):
        if not isinstance(ds, dict) or ds.get("type") != "prometheus" or \
                ds.get("uid") != DS_UID:
            self.error(where, f"data source {ds!r}, wanted "
                              f"{{type: prometheus, uid: {DS_UID}}}")

    def check_variables(self, name, dash):
        got = {v.get("name"): v for v in
               dash.get("templating", {}).get("list", [])}
        ds = got.get("DS_PROMETHEUS")
        if not ds or ds.get("type") != "datasource" or \
                ds.get("query") != "prometheus":
            self.error(name, "no variable DS_PROMETHEUS of type datasource "
                             "(query prometheus)")
        for var, query in VARIABLES.items():
            v = got.get(var)
            if not v:
                self.error(name, f"no variable {var}")
                continue
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            if v.get("type") != "query" or q != query or \
                    v.get("definition") != query:
                self.error(name, f"variable {var}: wanted a query variable "
                                 f"{query!r}, got {q!r}")
            self.check_datasource(f"{name}: variable {var}",
                                  v.get("datasource"))

    def check_dashboard(self, name, dash, uids):
        for key in ("title", "uid", "schemaVersion"):
            if not dash.get(key):
                self.error(name, f"no {key}")
        if dash.get("uid") in uids:
            self.error(name, f"uid {dash.get('uid')} used twice")
        uids.add(dash.get("uid"))
        if not isinstance(dash.get("schemaVersion"), int) or \
                dash["schemaVersion"] < 36:
            self.error(name, "schemaVersion below 36")
        if "deltad" not in dash.get("tags", []):
            self.error(name, "no tag deltad")
        self.check_variables(name, dash)
        panels = []
        for p in dash.get("panels", []):
            panels.extend(p.get("panels", []) if p.get("type") == "row"
                          else [p])
        if not panels:
            self.error(name, "no panels")
        ids = set()
        for p in panels:
            where = f"{name}: panel {p.get('id')} '{p.get('title')}'"
            if p.get("id") in ids or not isinstance(p.get("id"), int):
                self.error(where, "missing or repeated id")
            ids.add(p.get("id"))
            for key in ("title", "description", "type"):
                if not p.get(key):
                    self.error(where, f"no {key}")
            if not {"h", "w", "x", "y"} <= set(p.get("gridPos", {})):
                self.error(where, "no gridPos")
            self.check_datasource(where, p.get("datasource"))
            unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
            if not unit:
                self.error(where, "no unit (fieldConfig.defaults.unit)")
            elif unit not in UNITS:
                self.error(where, f"unit {unit!r} is not one of {sorted(UNITS)}")
            targets = p.get("targets", [])
            if not targets:
                self.error(where, "no targets")
            refs = set()
            for t in targets:
                twhere = f"{where} target {t.get('refId')}"
                if not t.get("refId") or t.get("refId") in refs:
                    self.error(twhere, "missing or repeated refId")
                refs.add(t.get("refId"))
                if "datasource" in t:
                    self.check_datasource(twhere, t["datasource"])
                if not t.get("expr"):
                    self.error(twhere, "no expr")
                else:
                    self.check_expr(twhere, t["expr"])

    def check_dir(self, directory):
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
        if not names:
            self.error(directory, "no dashboards (*.json)")
        uids = set()
        for n in names:
            try:
                with open(os.path.join(directory, n)) as f:
                    dash = json.load(f)
            except (OSError, ValueError) as e:
                self.error(n, f"does not parse: {e}")
                continue
            self.check_dashboard(n, dash, uids)
        return names


def check(directory, metrics_cc):
    c = Checker(metrics_cc)
    names = c.check_dir(directory)
    return names, c.errors


def self_test(directory, metrics_cc):
    """The checks pass on the dashboards and fail on broken copies."""
    names, errors = check(directory, metrics_cc)
    if errors:
        print("the dashboards themselves fail:\n  " + "\n  ".join(errors))
        return 1

    def first_target(d):
        return next(p for p in d["panels"] if p.get("targets"))["targets"][0]

    def misspell_metric(d):
        t = first_target(d)
        name = SELECTOR.search(t["expr"]).group(1)
        t["expr"] = t["expr"].replace(name, name[:8] + name[9:], 1)
        return f"metric {name[:8] + name[9:]} is not in daemon/metrics.cc"

    def drop_unit(d):
        del d["panels"][0]["fieldConfig"]["defaults"]["unit"]
        return "no unit"

    def drop_datasource(d):
        del d["panels"][0]["datasource"]
        return "data source None"

    def drop_gpu_variable(d):
        d["templating"]["list"] = [v for v in d["templating"]["list"]
                                   if v["name"] != "gpu"]
        return "no variable gpu"

    def bad_label(d):
        t = first_target(d)
        t["expr"] = t["expr"].replace('gpu=~"$gpu"', 'device=~"$gpu"', 1)
        return "label device"

    def bad_value(d):
        for p in d["panels"]:
            for t in p.get("targets", []):
                if 'direction="d2h"' in t["expr"]:
                    t["expr"] = t["expr"].replace('"d2h"', '"D2H"')
                    return 'direction="D2H"'
        return None

    def no_instance(d):
        t = first_target(d)
        t["expr"] = t["expr"].replace('instance=~"$instance", ', "", 1)
        return 'not filtered by instance'

    def fixed_window(d):
        for p in d["panels"]:
            for t in p.get("targets", []):
                if "[$__rate_interval]" in t["expr"]:
                    t["expr"] = t["expr"].replace("[$__rate_interval]", "[5m]")
                    return "range [5m]"
        return None

    def not_json(path):
        with open(path, "a") as f:
            f.write("}")
        return "does not parse"

    mutations = [misspell_metric, drop_unit, drop_datasource, drop_gpu_variable,
                 bad_label, bad_value, no_instance, fixed_window]
    failed = 0
    tried = 0
    with tempfile.TemporaryDirectory(prefix="dashboards-check.") as tmp:
        for name in names:
            src = os.path.join(directory, name)
            with open(src) as f:
                original = json.load(f)
            for mutate in mutations + [not_json]:
                work = os.path.join(tmp, "d")
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(directory, work)
                path = os.path.join(work, name)
                if mutate is not_json:
                    expect = mutate(path)
                else:
                    d = copy.deepcopy(original)
                    expect = mutate(d)
                    if expect is None:
                        continue  # nothing of that kind in this dashboard
                    with open(path, "w") as f:
                        json.dump(d, f)
                tried += 1
                _, errs = check(work, metrics_cc)
                caught = [e for e in errs if expect in e]
                if caught:
                    print(f"caught  {name} {mutate.__name__}: {caught[0]}")
                else:
                    failed += 1
                    print(f"MISSED  {name} {mutate.__name__}: wanted an error "
                          f"with {expect!r}, got {errs}")
    if failed:
        print(f"{failed} of {tried} broken copies passed the checks")
        return 1
    print(f"all {tried} broken copies were caught")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dashboards", default=os.path.join(ROOT, "dashboards"))
    ap.add_argument("--metrics_cc",
                    default=os.path.join(ROOT, "daemon", "metrics.cc"))
    ap.add_argument("--self_test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test(args.dashboards, args.metrics_cc)
    names, errors = check(args.dashboards, args.metrics_cc)
    if errors:
        print("\n".join(errors))
        print(f"{len(errors)} problems in {len(names)} dashboards")
        return 1
    print(f"{len(names)} dashboards: {', '.join(names)}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
