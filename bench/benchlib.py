"""benchlib: what the Python benchmarks (bench/torch_bench.py,
bench/torch_overhead.py) share around their measurements, as bench/report.h
does for the C++ ones: messages on stderr under the benchmark's tag, PyTorch
required, the deltad package imported from PYTHONPATH or this checkout, the
lines that head a report (command, machine, date, software), and the report
printed and written between a Markdown file's markers.

Imported by the scripts from their own folder (python3 puts a script's folder
first on sys.path); scripts/gpu-pack ships it beside torch_bench.py. It
imports nothing but the standard library at import time, so that a script
can call require_torch before it imports torch itself.
"""

import datetime
import os
import platform
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --- messages


def note(tag, message):
    """`tag: message` on stderr."""
    print(f"{tag}: {message}", file=sys.stderr, flush=True)


def fail(tag, message, status=2):
    """note, then exit with `status` (2: bad arguments or environment)."""
    note(tag, message)
    sys.exit(status)


# --- imports


def require_torch(tag):
    """Exits 2 with a note when PyTorch is not importable: there is nothing
    to measure without it."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        fail(tag, f"PyTorch is not importable ({e}); install it (Debian: "
             f"python3-torch) or run with an interpreter that has it")


def import_deltad():
    """The deltad package with deltad.torch loaded, from PYTHONPATH or this
    checkout (client/python, with build/client/libdeltad_client.so when
    DELTAD_CLIENT_LIBRARY is not set). ImportError when neither has it."""
    if "DELTAD_CLIENT_LIBRARY" not in os.environ:
        built = os.path.join(REPO, "build", "client", "libdeltad_client.so")
        if os.path.exists(built):
            os.environ["DELTAD_CLIENT_LIBRARY"] = built
    try:
        import deltad.torch  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "client", "python"))
        import deltad.torch  # noqa: F401
    import deltad
    return deltad


# --- the report's head


def command_line(script):
    """The command for a report's "Command:" line: `script` and this run's
    arguments, or DELTAD_BENCH_COMMAND where set (as bench/report.h's
    CommandLine)."""
    return os.environ.get("DELTAD_BENCH_COMMAND") or " ".join(
        [script] + [shlex.quote(a) for a in sys.argv[1:]])


def cpu_model():
    """"AMD EPYC ..." from /proc/cpuinfo, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_description():
    """The CPU and its cores, for a report's machine line."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def today():
    """Today's date, UTC, as YYYY-MM-DD."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"


def head(title, script):
    """A report's first lines: its heading, then the command, the CPU and
    today's date."""
    return [f"## {title}", "",
            f"Command: `{command_line(script)}`  ",
            f"Machine: {cpu_description()}  ",
            f"Date: {today()}", ""]


def software():
    """PyTorch's and Python's versions, for a report's software line."""
    import torch
    return f"torch {torch.__version__}, Python {platform.python_version()}"


# --- the report in a Markdown file


def update_doc(path, tag, section):
    """Replaces the text between `<!-- tag:begin -->` and `<!-- tag:end -->`
    of the Markdown file at `path` with `section` (appending both markers
    and the section when the file has none), as bench/report.cc's
    UpdateDocSection."""
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    try:
        with open(path) as f:
            doc = f.read()
    except FileNotFoundError:
        doc = ""
    block = f"{begin}\n{section}{end}"
    b, e = doc.find(begin), doc.find(end)
    if b != -1 and e != -1 and e > b:
        doc = doc[:b] + block + doc[e + len(end):]
    else:
        doc += f"\n{block}\n"
    with open(path, "w") as f:
        f.write(doc)


def print_report(tag, lines, doc=None):
    """Prints the report of `lines` (joined, ending in a newline) on stdout
    and, when `doc` is given, writes it as the `tag` section of that
    Markdown file (update_doc), as bench/report.h's PrintReport."""
    text = "\n".join(lines)
    if not text.endswith("\n"):
        text += "\n"
    print(text, end="", flush=True)
    if doc:
        update_doc(doc, tag, text)
        note(tag, f"updated {doc}")
