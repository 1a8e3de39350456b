"""stream_flood: what calls whose messages never end cost the daemon, and
the honest session beside them.

A deltad daemon on one simulated GPU (bench/sim_daemon.py) serves an honest
client (deltad.Client, one tensor tracked) while hostile clients that speak
HTTP/2 without gRPC connect to its socket: each opens --streams calls
(--method, Session by default), before it acknowledges the daemon's
SETTINGS or after (--orders; after it, no more than gRPC's SETTINGS allow,
and another for each one gRPC resets), sends each a gRPC message header that announces 15 MiB (under
gRPC's own limit here, 4 times limits.max_message_bytes) and then data as
fast as the daemon's flow control lets it, never finishing a message: gRPC
buffers what comes for a message it is reading. After --seconds, with the
flood still on, `deltactl status` is timed; then the hostile clients
leave. For each order and each limits.grpc_memory_bytes in --quotas (0:
the default), with a daemon of its own: the daemon's RSS (its peak during
the flood, and --settle seconds after it, both over the RSS before), what
the attackers got through, what gRPC did (streams reset, connections
closed with GOAWAY), and what the honest client saw (sessions lost: each
one ended and reopened, its tensors reported again). The attackers share
the honest client's user: 240 connections leave it room under
limits.max_grpc_connections_per_uid (256).

  python3 bench/stream_flood.py --update_doc docs/RELIABILITY.md
"""

import argparse
import os
import select
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from ping_flood import SETTLE_S, rss_mib  # noqa: E402
from sim_daemon import SimDaemon  # noqa: E402

TAG = "stream_flood"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = (
    0, 1, 3, 4, 6, 7, 8)
END_HEADERS, ACK = 0x4, 0x1
ANNOUNCED = 15 << 20  # bytes each message says it has
CHUNK = 16384  # HTTP/2's default largest frame


def frame(kind, flags, stream, payload):
    return (struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) +
            struct.pack(">I", stream) + payload)


def literal(name, value):
    """An HPACK header field without indexing, its name literal too."""
    return bytes([0, len(name)]) + name + bytes([len(value)]) + value


def header_block(method):
    """POST (static table entry 3), http (6), then :path and :authority as
    literals with indexed names (4 and 1), and gRPC's own two headers."""
    path = f"/deltad.v1.MemoryManager/{method}".encode()
    return (b"\x83\x86" + bytes([0x04, len(path)]) + path +
            bytes([0x01, 9]) + b"localhost" +
            literal(b"content-type", b"application/grpc") +
            literal(b"te", b"trailers"))


class Attacker:
    """One connection: its streams' windows, what it sent and saw."""

    def __init__(self, path, streams, headers, ack_first=False):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.connection_window = 65535
        self.initial_window = 65535
        self.windows = {}
        self.unsent = {}  # a stream's message header, not yet sent
        self.out = PREFACE + frame(SETTINGS, 0, 0, b"")
        self.to_open = (streams, headers)
        self.next_stream = 1
        self.max_streams = None  # the daemon's SETTINGS_MAX_CONCURRENT_STREAMS
        if not ack_first:
            self.open_calls()
        self.inbox = b""
        self.sent = 0
        self.resets = 0
        self.goaway = None
        self.closed = False

    def open_calls(self):
        streams, self.headers = self.to_open
        self.to_open = None
        # After the acknowledgement no more than the daemon allows: gRPC
        # ends a connection that opens more ("Max stream count exceeded").
        self.most = min(streams, self.max_streams or streams)
        for _ in range(self.most):
            self.open_call()

    def open_call(self):
        stream = self.next_stream
        self.next_stream += 2
        self.out += frame(HEADERS, END_HEADERS, stream, self.headers)
        self.windows[stream] = self.initial_window
        self.unsent[stream] = struct.pack(">BI", 0, ANNOUNCED)

    def read(self):
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    self.closed = True
                    break
                self.inbox += data
        except BlockingIOError:
            pass
        except OSError:
            self.closed = True
        while len(self.inbox) >= 9:
            length = int.from_bytes(self.inbox[:3], "big")
            if len(self.inbox) < 9 + length:
                break
            kind, flags = self.inbox[3], self.inbox[4]
            stream = int.from_bytes(self.inbox[5:9], "big") & 0x7FFFFFFF
            payload = self.inbox[9:9 + length]
            self.inbox = self.inbox[9 + length:]
            self.on_frame(kind, flags, stream, payload)

    def on_frame(self, kind, flags, stream, payload):
        if kind == SETTINGS and not flags & ACK:
            for at in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[at:at + 6])
                if key == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                    for s in self.windows:
                        self.windows[s] += value - self.initial_window
                    self.initial_window = value
                elif key == 3:  # SETTINGS_MAX_CONCURRENT_STREAMS
                    self.max_streams = value
            self.out += frame(SETTINGS, ACK, 0, b"")
            # The calls start once gRPC's SETTINGS say how many it takes
            # (the daemon's own, first, say nothing).
            if self.to_open and self.max_streams is not None:
                self.open_calls()
        elif kind == WINDOW_UPDATE:
            grant = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self.connection_window += grant
            elif stream in self.windows:
                self.windows[stream] += grant
        elif kind == RST_STREAM:
            self.resets += 1
            self.windows.pop(stream, None)
            self.unsent.pop(stream, None)
            if (self.goaway is None and self.to_open is None and
                    len(self.windows) < self.most and
                    self.next_stream < 1 << 30):
                self.open_call()  # another in its place: the flood goes on
        elif kind == GOAWAY and self.goaway is None:
            self.goaway = payload[8:].decode(errors="replace")
        elif kind == PING and not flags & ACK:
            self.out += frame(PING, ACK, 0, payload)

    def write(self):
        for stream, window in self.windows.items():
            n = min(window, self.connection_window, CHUNK)
            if n <= 0:
                continue
            data = (self.unsent.pop(stream, b"") + b"x" * CHUNK)[:n]
            self.out += frame(DATA, 0, stream, data)
            self.windows[stream] -= n
            self.connection_window -= n
            self.sent += n
        if self.out and not self.closed:
            try:
                k = self.sock.send(self.out)
                self.out = self.out[k:]
            except BlockingIOError:
                pass
            except OSError:
                self.closed = True


def deltactl_status(deltactl, path):
    """(seconds, None) or (None, why it failed)."""
    start = time.monotonic()
    try:
        r = subprocess.run([deltactl, f"--socket={path}", "status"],
                           capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None, "no answer in 10 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"failed: {last[:80]}".replace("|", "/")
    return time.monotonic() - start, None


def measure(a, quota, ack_first):
    """One row: a daemon of its own with `quota` (0: the default), the
    attackers' calls started after the SETTINGS acknowledgement or
    before."""
    import deltad
    config = (f"limits {{ grpc_memory_bytes: {quota} }}\n" if quota else "")
    if a.max_concurrent_streams:
        config += (f"limits {{ max_concurrent_streams: "
                   f"{a.max_concurrent_streams} }}\n")
    daemon = SimDaemon(a.binary, gpu_bytes=256 << 20, prefix="deltad-flood-",
                       extra_config=config)
    with daemon as path:
        pid = daemon.proc.pid
        honest = deltad.Client(socket=path, budget_bytes=64 << 20,
                               label="honest")
        try:
            honest.track(1, 1 << 20)
            time.sleep(0.5)
            base = peak = rss_mib(pid)
            attackers = [Attacker(path, a.streams, header_block(a.method),
                                  ack_first)
                         for _ in range(a.connections)]
            end = time.monotonic() + a.seconds
            while time.monotonic() < end:
                socks = [x.sock for x in attackers if not x.closed]
                select.select(socks, [], [], 0.01)
                for x in attackers:
                    if not x.closed:
                        x.read()
                        x.write()
                peak = max(peak, rss_mib(pid))
            took, why = deltactl_status(a.deltactl, path)
            peak = max(peak, rss_mib(pid))
            for x in attackers:
                x.sock.close()
            time.sleep(a.settle)
            settled = rss_mib(pid)
            lost = honest.session_stats().sessions_lost
        finally:
            honest.close()
    status = f"{took * 1000:.0f} ms" if took is not None else why
    goaways = sorted({x.goaway for x in attackers if x.goaway})
    # Closed with unread calls in its socket, a connection is reset, and
    # the GOAWAY before it may be lost to its client.
    closed = sum(1 for x in attackers if x.goaway or x.closed)
    why = (f" ({sum(1 for x in attackers if x.goaway)} with a GOAWAY read: "
           f"{', '.join(goaways)})" if goaways else "")
    return (f"| {'after' if ack_first else 'before'} | "
            f"{quota >> 20 if quota else 'default (256)'} | "
            f"{sum(x.sent for x in attackers) / (1 << 20):.0f} | "
            f"{base:.1f} | +{peak - base:.0f} | +{settled - base:.0f} | "
            f"{sum(x.resets for x in attackers)} | "
            f"{closed}{why} | "
            f"{lost} | {status} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=240,
                   help="hostile connections at once")
    p.add_argument("--streams", type=int, default=32,
                   help="calls each hostile connection starts")
    p.add_argument("--seconds", type=float, default=15,
                   help="how long the flood lasts")
    p.add_argument("--method", default="Session",
                   choices=("Session", "Release", "OpenSession"),
                   help="the calls the attackers start: the Session stream "
                        "(its handler waits for the first message) or a "
                        "unary call (gRPC reads the whole message before "
                        "any handler sees it)")
    p.add_argument("--orders", default="before,after",
                   help="when the attackers start their calls, a row each: "
                        "before acknowledging the daemon's SETTINGS (the "
                        "daemon refuses more than "
                        "limits.max_concurrent_streams), after (as an "
                        "honest client does: gRPC then holds the "
                        "connection to that limit, and the attacker opens "
                        "as many as it allows and another for each one "
                        "gRPC resets)")
    p.add_argument("--max_concurrent_streams", type=int, default=0,
                   help="limits.max_concurrent_streams (0: the default)")
    p.add_argument("--quotas", default="0,33554432",
                   help="comma-separated limits.grpc_memory_bytes (0: the "
                        "default)")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds after the flood before the settled RSS")
    p.add_argument("--binary", default=os.path.join(
        benchlib.REPO, "build", "daemon", "deltad"))
    p.add_argument("--deltactl", default=os.path.join(
        benchlib.REPO, "build", "tools", "deltactl"))
    p.add_argument("--update_doc", default=None)
    a = p.parse_args()
    for what in (a.binary, a.deltactl):
        if not os.path.exists(what):
            benchlib.fail(TAG, f"no {what}: build it first")
    try:
        quotas = [int(q) for q in a.quotas.split(",")]
    except ValueError:
        benchlib.fail(TAG, f"--quotas takes numbers, got {a.quotas!r}")
    orders = a.orders.split(",")
    if not orders or set(orders) - {"before", "after"}:
        benchlib.fail(TAG, f"--orders takes before and after, got "
                           f"{a.orders!r}")
    benchlib.import_deltad()
    start = time.time()
    rows = []
    for order in orders:
        for quota in quotas:
            benchlib.note(TAG, f"grpc_memory_bytes {quota or 'default'}: "
                               f"{a.connections} connections x {a.streams} "
                               f"{a.method} calls {order} the SETTINGS "
                               f"acknowledgement, for {a.seconds:g} s")
            rows.append(measure(a, quota, order == "after"))
    lines = benchlib.head("stream_flood: calls whose messages never end",
                          "python3 bench/stream_flood.py") + [
        f"{a.connections} hostile connections at once, each starting "
        f"{a.streams} {a.method} calls (before or after acknowledging the "
        f"daemon's SETTINGS: `calls`; after it, as many as gRPC's SETTINGS "
        f"allow, and another for each call gRPC resets) and sending each "
        f"a message that "
        f"announces {ANNOUNCED >> 20} MiB and never ends, as fast as flow "
        f"control lets it, for {a.seconds:g} s, beside an honest client "
        "(one session, one tensor); a daemon of its own per row (sim "
        "backend, default limits but `limits.grpc_memory_bytes`"
        + (f" and `limits.max_concurrent_streams: "
           f"{a.max_concurrent_streams}`" if a.max_concurrent_streams
           else "") + "). RSS over "
        f"the RSS before the flood: its peak, and {a.settle:g} s after the "
        "attackers left. `deltactl status` timed at the flood's end, "
        "with the flood still on.", "",
        "| calls | grpc_memory_bytes (MiB) | MiB the attackers sent | "
        "RSS before "
        "(MiB) | peak (MiB) | settled (MiB) | streams reset by gRPC | "
        "connections the daemon closed or sent a GOAWAY | honest sessions "
        "lost | "
        "`deltactl status` |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
        *rows, "",
        f"Whole run: {time.time() - start:.0f} s.", ""]
    benchlib.print_report(TAG, lines, a.update_doc)


if __name__ == "__main__":
    main()
