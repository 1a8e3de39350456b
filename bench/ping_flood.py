"""ping_flood: what HTTP/2 PING floods cost the daemon's memory.

A deltad daemon on one simulated GPU (bench/sim_daemon.py); clients that
speak HTTP/2 without gRPC connect to its socket and send PINGs (the frames
gRPC answers by itself, without a call) until the daemon closes the
connection, a connection has sent --bytes or --seconds have passed. For
each concurrency (how many flood at once) it runs --rounds of clients that
never read and samples the daemon's resident memory every 50 ms: the peak,
right after the last round, and after the heap return's next trim (12 s
later). Then one client that reads every answer floods for --seconds: the
daemon's CPU time answering it. Each of those, for each value of
limits.max_ping_strikes in --strikes (0, the default: no strikes, no
GOAWAY), with a daemon of its own.

  python3 bench/ping_flood.py --strikes 0,2 --update_doc docs/RELIABILITY.md
"""

import argparse
import os
import select
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from sim_daemon import SimDaemon  # noqa: E402

TAG = "ping_flood"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The acknowledgement of the daemon's SETTINGS, sent ahead: without it the
# daemon does not hand the connection to gRPC (daemon/http2_gate.h), and
# this measures gRPC's handling of PINGs.
SETTINGS_ACK = bytes([0, 0, 0, 4, 1, 0, 0, 0, 0])
SETTINGS, PING = 4, 6
# The heap return trims at most every 10 s.
SETTLE_S = 12


def frame(kind, payload):
    """One HTTP/2 frame on stream 0: 24-bit length, type, flags, id."""
    return (struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) +
            struct.pack(">I", 0) + payload)


PINGS = b"".join(frame(PING, b"flood-01") for _ in range(1024))


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def flood(path, most_bytes, seconds, sent):
    """Sends PINGs and never reads, as a hostile client would, until the
    daemon closes the connection, `most_bytes` or `seconds`."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(0.2)
    total = 0
    start = time.time()
    try:
        s.sendall(PREFACE + frame(SETTINGS, b"") + SETTINGS_ACK)
        while time.time() - start < seconds and total < most_bytes:
            try:
                total += s.send(PINGS)
            except socket.timeout:
                pass
    except OSError:
        pass  # closed by the daemon
    s.close()
    sent.append(total)


def flood_reading(path, most_bytes, seconds):
    """Sends PINGs and reads every answer; (bytes sent, seconds, whether
    the daemon closed the connection)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.setblocking(False)
    data = PREFACE + frame(SETTINGS, b"") + SETTINGS_ACK
    total = 0
    start = time.time()
    closed = False
    try:
        while time.time() - start < seconds and total < most_bytes:
            readable, writable, _ = select.select([s], [s], [], 0.1)
            if readable and not s.recv(1 << 16):
                closed = True
                break
            if writable:
                n = s.send(data)
                total += n
                data = data[n:] or PINGS
    except OSError:
        closed = True
    s.close()
    return total, time.time() - start, closed


def cpu_seconds(pid):
    """The process's user and system time so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pid, path, concurrency, rounds, most_bytes, seconds, settle):
    base = peak = rss_mib(pid)
    sent = []
    for _ in range(rounds):
        threads = [threading.Thread(target=flood,
                                    args=(path, most_bytes, seconds, sent))
                   for _ in range(concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)
        for t in threads:
            t.join()
    after = rss_mib(pid)
    time.sleep(settle)
    settled = rss_mib(pid)
    return base, peak, after, settled, sum(sent) / max(len(sent), 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated connections flooding at once")
    p.add_argument("--rounds", type=int, default=0,
                   help="rounds per concurrency (default: 32 connections "
                        "in all, at least 2 rounds)")
    p.add_argument("--bytes", type=int, default=4 << 20,
                   help="the most PING bytes one connection sends")
    p.add_argument("--seconds", type=float, default=10,
                   help="the longest one connection floods")
    p.add_argument("--strikes", default="0,2",
                   help="comma-separated limits.max_ping_strikes (0: none)")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds to wait after a row's flood before reading "
                        "the daemon's settled RSS")
    p.add_argument("--binary", default=os.path.join(
        benchlib.REPO, "build", "daemon", "deltad"))
    p.add_argument("--update_doc", default=None)
    a = p.parse_args()
    if not os.path.exists(a.binary):
        benchlib.fail(TAG, f"no daemon at {a.binary}: build it first")
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
        strikes = [int(c) for c in a.strikes.split(",")]
    except ValueError:
        benchlib.fail(TAG, f"--concurrency and --strikes take numbers, got "
                           f"{a.concurrency!r}, {a.strikes!r}")
    rows, reading_rows = [], []
    start = time.time()
    for k in strikes:
        config = f"limits {{ max_ping_strikes: {k} }}\n"
        for n in levels:
            rounds = a.rounds or max(2, 32 // n)
            # A daemon of its own per row: what one left behind would
            # count in the next.
            daemon = SimDaemon(a.binary, gpu_bytes=256 << 20,
                               prefix="deltad-flood-", extra_config=config)
            with daemon as path:
                pid = daemon.proc.pid
                benchlib.note(TAG, f"strikes {k}: {n} at once, "
                                   f"{rounds} rounds")
                base, peak, after, settled, mean_sent = measure(
                    pid, path, n, rounds, a.bytes, a.seconds, a.settle)
            rows.append(f"| {k} | {n} | {rounds} | {mean_sent / 1024:.0f} "
                        f"| {base:.1f} | +{peak - base:.0f} | "
                        f"+{after - base:.0f} | +{settled - base:.0f} |")
        daemon = SimDaemon(a.binary, gpu_bytes=256 << 20,
                           prefix="deltad-flood-", extra_config=config)
        with daemon as path:
            pid = daemon.proc.pid
            benchlib.note(TAG, f"strikes {k}: one client that reads")
            base = rss_mib(pid)
            cpu = cpu_seconds(pid)
            sent, took, closed = flood_reading(path, 1 << 40, a.seconds)
            cpu = cpu_seconds(pid) - cpu
            after = rss_mib(pid)
        reading_rows.append(
            f"| {k} | {sent / 1024:.0f} | {took:.1f} | "
            f"{'closed' if closed else 'open'} | {cpu:.1f} "
            f"({100 * cpu / took:.0f}%) | +{after - base:.0f} |")
    lines = benchlib.head(
        "ping_flood: the daemon's memory under HTTP/2 PING floods",
        "python3 bench/ping_flood.py") + [
        "Connections that send HTTP/2 PINGs and never read, `concurrency` "
        "at a time, `rounds` times, each for at most "
        f"{a.seconds:g} s or {a.bytes >> 20} MiB, to a daemon of its own "
        "per row (sim backend, default limits but "
        "`limits.max_ping_strikes`; 0: no strikes, no GOAWAY). RSS sampled "
        "every 50 ms: its peak over the rounds, right after them, and "
        f"{a.settle:g} s later (after the heap return's next trim at the "
        f"default {SETTLE_S} s), each "
        "over the RSS before.", "",
        "| max_ping_strikes | concurrency | rounds | KiB of PINGs per "
        "connection | RSS before (MiB) | peak (MiB) | after (MiB) | "
        "settled (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        f"One connection that reads every answer, flooding for at most "
        f"{a.seconds:g} s: what the daemon spent answering it (CPU "
        "seconds, and their share of the flood's time) and its RSS "
        "after, over the RSS before.", "",
        "| max_ping_strikes | KiB of PINGs sent | seconds | connection | "
        "daemon CPU s | RSS (MiB) |",
        "|---:|---:|---:|---|---:|---:|",
        *reading_rows, "",
        f"Whole run: {time.time() - start:.0f} s.", ""]
    benchlib.print_report(TAG, lines, a.update_doc)


if __name__ == "__main__":
    main()
