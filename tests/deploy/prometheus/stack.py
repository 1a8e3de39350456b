"""deltad, a demo load and a real Prometheus server, for the dashboards.

Shared by prometheus_test.py (every panel query of dashboards/*.json must
return data from a real Prometheus) and scripts/dashboard-plots (the same
queries drawn as SVG pictures). Starts:

  * deltad on 2 simulated GPUs (320 MiB each), its metrics on a free
    loopback port (--metrics=127.0.0.1:0; the port is read from its stderr),
    its sockets in a temporary directory;
  * Prometheus (Debian's /usr/bin/prometheus) with a temporary configuration
    and database, on a free loopback port, scraping deltad every second;
  * deltad-trainer processes, as scripts/run starts them but smaller: each
    job is above its GPU's share, so deltad offloads, prefetches, evicts and
    recomputes, and GPU 0 is shared by two jobs.

Only the standard library: Debian's python3 has no `requests`.
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

# The simulated node: 2 GPUs of 320 MiB with 256 KiB chunks, as scripts/run's
# GPUs at its default scale of 1/8.
DAEMON_CONFIG = """\
sim { gpus: 2 memory_bytes: 335544320 chunk_bytes: 262144 }
min_session_bytes: 16777216
host_pool_bytes: 2147483648
host_slab_bytes: 16777216
default_host_quota_bytes: 1073741824
"""

SCALE = 0.125

# (label, GPU, seconds after the load starts, model flags). The GPT evicts
# and recomputes, ResNet-50 mostly offloads; U-Net joins GPU 0 later, so its
# budget is split and the sessions gauge moves. The GPT asks for 70% of its
# peak (the whole GPU's budget): at the trainer's default of 60%, scripts/run's
# GPT job, it fails now and then with "device memory is full".
JOBS = [
    ("resnet50", 0, 0.0, ["--model=resnet50", "--batch=32"]),
    ("gpt", 1, 0.0, ["--model=gpt", "--batch=2", "--gpt_layers=6",
                     "--budget=0.7"]),
    ("unet", 0, 3.0, ["--model=unet", "--batch=8"]),
]

SCRAPE_INTERVAL_S = 1


class PrometheusUnavailable(Exception):
    """The Prometheus server is missing or cannot listen: a test skips."""


class StackError(Exception):
    """Anything else that went wrong: a test fails."""


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


class Stack:
    """deltad + Prometheus + the load, in one temporary directory.

    with Stack(deltad, trainer) as s:
        s.start_daemon(); s.start_prometheus(); s.wait_scraped()
        start, end = s.run_load(iterations=3)
        s.query_range('deltad_sessions', start, end)
    """

    def __init__(self, deltad, trainer, prometheus="prometheus", log=None,
                 keep=False):
        self.deltad = deltad
        self.trainer = trainer
        self.prometheus = prometheus
        self.log = log or (lambda msg: print(msg, flush=True))
        self.keep = keep
        self.dir = tempfile.mkdtemp(prefix="deltad-prometheus.")
        self.socket = os.path.join(self.dir, "deltad.sock")
        self.daemon = None
        self.server = None
        self.metrics_port = None
        self.prometheus_port = None
        self.jobs = []

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for _, proc in self.jobs:
            self._stop(proc, signal.SIGKILL)
        self._stop(self.server, signal.SIGTERM)
        self._stop(self.daemon, signal.SIGTERM)
        if self.keep:
            self.log(f"kept {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _stop(proc, sig):
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def diagnostics(self):
        """What the daemon and the server said, for a failure message."""
        out = []
        for name, proc, log in (("deltad", self.daemon, "deltad.log"),
                                ("prometheus", self.server, "prometheus.log")):
            if proc is None:
                continue
            state = "running" if proc.poll() is None else \
                f"exited with status {proc.returncode}"
            out.append(f"--- {name} ({state}), the end of its log:\n"
                       + self._tail(log))
        return "\n".join(out)

    def _file(self, name):
        return os.path.join(self.dir, name)

    def _tail(self, name, lines=20):
        try:
            with open(self._file(name), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # -- deltad ------------------------------------------------------------

    def start_daemon(self, timeout=15.0):
        """Starts deltad; returns its metrics port (read from its stderr)."""
        with open(self._file("deltad.conf"), "w") as f:
            f.write(DAEMON_CONFIG)
        log = open(self._file("deltad.log"), "w")
        self.daemon = subprocess.Popen(
            [self.deltad, f"--config={self._file('deltad.conf')}",
             f"--socket={self.socket}", "--backend=sim",
             "--metrics=127.0.0.1:0", "--drain_seconds=1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise StackError("deltad exited with status "
                                 f"{self.daemon.returncode}:\n"
                                 + self._tail("deltad.log"))
            m = re.search(r"metrics on http://\S+ \(port (\d+)\)",
                          self._tail("deltad.log", 50))
            if m and os.path.exists(self.socket + ".fds"):
                self.metrics_port = int(m.group(1))
                self.log(f"deltad: metrics on 127.0.0.1:{self.metrics_port}")
                return self.metrics_port
            time.sleep(0.1)
        raise StackError(f"deltad did not start within {timeout:.0f} s:\n"
                         + self._tail("deltad.log"))

    def metrics_page(self):
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    @property
    def instance(self):
        """The `instance` label Prometheus gives deltad's series."""
        return f"127.0.0.1:{self.metrics_port}"

    # -- Prometheus --------------------------------------------------------

    def start_prometheus(self, timeout=30.0, attempts=3):
        """Starts Prometheus scraping deltad every second.

        Raises PrometheusUnavailable when the binary is missing or the server
        cannot listen (a chosen free port is retried a few times)."""
        binary = shutil.which(self.prometheus)
        if binary is None:
            raise PrometheusUnavailable(
                f"no Prometheus server ('{self.prometheus}' is not on PATH; "
                "Debian: apt-get install --no-install-recommends prometheus)")
        config = self._file("prometheus.yml")
        with open(config, "w") as f:
            f.write(
                "global:\n"
                f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
                f"  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
                f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
                "scrape_configs:\n"
                "  - job_name: deltad\n"
                "    static_configs:\n"
                f"      - targets: ['{self.instance}']\n")
        why = ""
        for _ in range(attempts):
            port = free_port()
            data = self._file(f"tsdb-{port}")
            log = open(self._file("prometheus.log"), "w")
            self.server = subprocess.Popen(
                [binary, f"--config.file={config}",
                 f"--storage.tsdb.path={data}",
                 f"--web.listen-address=127.0.0.1:{port}",
                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.dir)
            log.close()
            self.prometheus_port = port
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.server.poll() is not None:
                    break
                try:
                    http_get(self._api_url("/-/ready"), timeout=1)
                    self.log(f"prometheus: on 127.0.0.1:{port}")
                    return port
                except (urllib.error.URLError, OSError):
                    time.sleep(0.2)
            self._stop(self.server, signal.SIGTERM)
            why = self._tail("prometheus.log", 10)
        self.server = None
        raise PrometheusUnavailable(
            f"the Prometheus server did not start or listen ({binary}):\n{why}")

    def _api_url(self, path, **params):
        url = f"http://127.0.0.1:{self.prometheus_port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        return url

    def api(self, path, **params):
        """GET on Prometheus's HTTP API; returns `data`, raises on an error."""
        url = self._api_url(path, **params)
        try:
            body = json.loads(http_get(url, timeout=10))
        except urllib.error.HTTPError as e:
            body = json.loads(e.read().decode("utf-8") or "{}")
        if body.get("status") != "success":
            raise StackError(f"{path} {params}: {body.get('errorType')}: "
                             f"{body.get('error')}")
        return body["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("/api/v1/query", **params)

    def query_range(self, expr, start, end, step=SCRAPE_INTERVAL_S):
        return self.api("/api/v1/query_range", query=expr,
                        start=f"{start:.3f}", end=f"{end:.3f}", step=step)

    def label_values(self, label, match):
        return self.api(f"/api/v1/label/{label}/values",
                        **{"match[]": match})

    def wait_scraped(self, timeout=20.0):
        """Waits until Prometheus scrapes deltad (target up, samples in)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            targets = self.api("/api/v1/targets")["activeTargets"]
            last = targets
            up = [t for t in targets if t["health"] == "up"]
            if up and self.query(
                    f'deltad_build_info{{instance="{self.instance}"}}')["result"]:
                return
            time.sleep(0.3)
        raise StackError(f"Prometheus did not scrape deltad within "
                         f"{timeout:.0f} s; targets: {json.dumps(last)}")

    def wait_sample_after(self, t, timeout=10.0):
        """Waits until Prometheus holds a sample of deltad taken after Unix
        time t (so a range ending at t is complete)."""
        expr = f'timestamp(deltad_build_info{{instance="{self.instance}"}})'
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.query(expr)["result"]
            if r and float(r[0]["value"][1]) > t:
                return
            time.sleep(0.2)
        raise StackError(f"Prometheus took no sample of deltad after {t:.1f} "
                         f"within {timeout:.0f} s")

    # -- the load ----------------------------------------------------------

    def run_load(self, iterations=3, jobs=JOBS, timeout=120.0):
        """Runs the training jobs to their end; returns (start, end) in Unix
        seconds. Raises StackError when one fails."""
        start = time.time()
        pending = sorted(jobs, key=lambda j: j[2])
        self.jobs = []
        deadline = time.monotonic() + timeout
        while pending or any(p.poll() is None for _, p in self.jobs):
            while pending and time.time() - start >= pending[0][2]:
                label, gpu, _, flags = pending.pop(0)
                out = open(self._file(f"{label}.out"), "w")
                err = open(self._file(f"{label}.err"), "w")
                self.jobs.append((label, subprocess.Popen(
                    [self.trainer, f"--socket={self.socket}", f"--gpu={gpu}",
                     f"--label={label}", f"--scale={SCALE}",
                     f"--iterations={iterations}", *flags],
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL)))
                out.close()
                err.close()
                self.log(f"load: {label} on GPU {gpu}")
            if time.monotonic() > deadline:
                raise StackError(f"the load ran past {timeout:.0f} s")
            time.sleep(0.1)
        end = time.time()
        failed = [(label, p.returncode) for label, p in self.jobs if p.returncode != 0]
        if failed:
            raise StackError("training jobs failed: " + ", ".join(
                f"{label} (status {rc}):\n{self._tail(label + '.out')}"
                f"{self._tail(label + '.err')}" for label, rc in failed))
        for label, _ in self.jobs:
            for line in self._tail(f"{label}.out", 5).splitlines():
                if line.startswith("SUMMARY"):
                    self.log("load: " + " ".join(line.split()[1:]))
        self.log(f"load: {end - start:.1f} s")
        return start, end


# -- dashboards ----------------------------------------------------------------

def load_dashboards(directory):
    """[(name, dashboard)] for every dashboards/*.json, sorted by name."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out.append((name[:-len(".json")], json.load(f)))
    return out


def panels(dashboard):
    """Every panel that shows data, rows' nested panels included, in order."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def variables(dashboard):
    return dashboard.get("templating", {}).get("list", [])


def regex_escape(value):
    """A value as Grafana puts it into a Prometheus regex matcher."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def format_value(values):
    """Grafana's formatting of a variable for a `=~` matcher: one value
    escaped, several (or All) as (a|b|c)."""
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr, values, rate_interval="5s", interval="1s"):
    """expr with $var, ${var} and [[var]] replaced, and Grafana's
    $__rate_interval and $__interval as given. `values` maps a variable's
    name to its list of selected values."""
    def one(name):
        if name == "__rate_interval":
            return rate_interval
        if name == "__interval":
            return interval
        if name not in values:
            raise KeyError(f"unknown variable ${name} in {expr}")
        return format_value(values[name])
    expr = re.sub(r"\[\[(\w+)\]\]", lambda m: one(m.group(1)), expr)
    expr = re.sub(r"\$\{(\w+)(?::\w+)?\}", lambda m: one(m.group(1)), expr)
    return re.sub(r"\$(\w+)", lambda m: one(m.group(1)), expr)


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")


def resolve_variables(stack, dashboard, prefer=None):
    """The values of every query variable as Grafana would offer them, by
    running its label_values() query against Prometheus, in the order they
    are declared (later ones use earlier): All for a multi-value variable,
    for a single-value one prefer[name] (which must be among the values), else
    the first."""
    prefer = prefer or {}
    values = {}
    for v in variables(dashboard):
        if v.get("type") != "query":
            continue
        query = v.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        m = LABEL_VALUES.match(query or "")
        if not m:
            raise StackError(f"variable {v['name']}: not a label_values() "
                             f"query: {query!r}")
        match, label = m.group(1), m.group(2)
        match = substitute(match, values) if match else None
        got = stack.label_values(label, match) if match else \
            stack.api(f"/api/v1/label/{label}/values")
        if not got:
            raise StackError(f"variable {v['name']}: {query} "
                             f"(as {match}) has no values")
        got = sorted(got, key=lambda s: (len(s), s))
        name = v["name"]
        if v.get("multi") or v.get("includeAll"):
            values[name] = got
        elif name in prefer:
            if prefer[name] not in got:
                raise StackError(f"variable {name}: {query} (as {match}) "
                                 f"offers {got}, not {prefer[name]}")
            values[name] = [prefer[name]]
        else:
            values[name] = got[:1]
    return values


def finite(sample_value):
    x = float(sample_value)
    return not (math.isnan(x) or math.isinf(x))
