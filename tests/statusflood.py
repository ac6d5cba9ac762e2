"""Outsiders against the coordinator's status page (issue 35): a request flood and a
slowloris, each cheap for the attacker.

``python -m tests.statusflood URL [--rate R] [--seconds S] [--connections C]
[--cpus LIST] [--go-file F]`` floods ``URL``'s ``/api/v1/state`` and ``/metrics``
over ``C`` keep-alive connections (raw sockets, one thread), writing ``R`` requests/s
pipelined whether or not they are answered (an attacker does not wait), for ``S``
seconds; it prints ``ready``, waits for ``F`` if given, prints ``flooding``, then one
JSON line: requests offered and written (taken by the kernel), answers read, seconds,
written and answered per second, connections the server closed.

:func:`slowloris` holds connections open that never finish their request head."""

from __future__ import annotations

import argparse
import collections
import json
import os
import selectors
import socket
import time
from urllib.parse import urlsplit

#: requests one connection holds unwritten before the flooder stops adding to it
MAX_PENDING = 20_000
PATHS = ("/api/v1/state", "/metrics")


def _request(host: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


class _Conn:
    """One keep-alive connection: requests waiting to be written, and reading answers."""

    def __init__(self, addr: tuple[str, int], host: str, n: int) -> None:
        self.sock = socket.create_connection(addr, timeout=10)
        self.sock.setblocking(False)
        self.requests = [_request(host, PATHS[(n + i) % len(PATHS)]) for i in range(len(PATHS))]
        self.out = bytearray()
        self.ends: collections.deque[int] = collections.deque()  # each unwritten request's end, in bytes ever queued
        self.total = self.taken = 0  # bytes ever queued, and taken by the kernel
        self.buf = bytearray()
        self.body_left = -1  # bytes of the current answer's body still to read (-1: in its head)
        self.queued = 0

    def queue(self, k: int) -> int:
        """Add up to ``k`` requests; how many were added."""
        k = max(0, min(k, MAX_PENDING - len(self.ends)))
        for i in range(k):
            request = self.requests[(self.queued + i) % len(self.requests)]
            self.out += request
            self.total += len(request)
            self.ends.append(self.total)
        self.queued += k
        return k

    def write(self) -> int:
        """Write what the socket takes now: requests wholly written (-1: closed)."""
        if not self.out:
            return 0
        try:
            n = self.sock.send(self.out)
        except BlockingIOError:
            return 0
        except OSError:
            return -1
        del self.out[:n]
        self.taken += n
        done = 0
        while self.ends and self.ends[0] <= self.taken:
            self.ends.popleft()
            done += 1
        return done

    def read(self) -> int:
        """Answers completed by what the socket holds now; -1 when the server closed it."""
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return 0
        except OSError:
            return -1
        if not chunk:
            return -1
        self.buf += chunk
        done = 0
        while True:
            if self.body_left < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return done
                head = bytes(self.buf[:end]).lower()
                at = head.find(b"content-length:")
                self.body_left = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
                del self.buf[: end + 4]
            if len(self.buf) < self.body_left:
                self.body_left -= len(self.buf)
                self.buf.clear()
                return done
            del self.buf[: self.body_left]
            self.body_left = -1
            done += 1


def flood(url: str, rate: float, seconds: float, connections: int) -> dict[str, float]:
    """Flood ``url`` for ``seconds``: its tally."""
    parts = urlsplit(url)
    addr = (parts.hostname or "127.0.0.1", parts.port or 80)
    sel = selectors.DefaultSelector()
    conns: list[_Conn] = []
    tally = {"offered": 0, "written": 0, "answers": 0, "closed": 0}

    def connect(n: int) -> None:
        conn = _Conn(addr, parts.netloc, n)
        conns.append(conn)
        sel.register(conn.sock, selectors.EVENT_READ, conn)

    def drop(conn: _Conn) -> None:  # closed on us: another in its place
        tally["closed"] += 1
        sel.unregister(conn.sock)
        conn.sock.close()
        conns.remove(conn)
        connect(len(conns))

    for n in range(connections):
        connect(n)
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        due = int(rate * (now - start)) - tally["offered"]
        for i, conn in enumerate(list(conns)):
            tally["offered"] += conn.queue(due // len(conns) + (i < due % len(conns)))
            wrote = conn.write()
            if wrote < 0:
                drop(conn)
            tally["written"] += max(wrote, 0)
        for key, _ in sel.select(0.002):
            conn = key.data
            if conn in conns:
                got = conn.read()
                if got < 0:
                    drop(conn)
                tally["answers"] += max(got, 0)
    took = time.monotonic() - start
    for conn in conns:
        conn.sock.close()
    per_s = {"written_per_s": round(tally["written"] / took, 1), "answers_per_s": round(tally["answers"] / took, 1)}
    return {**tally, "seconds": round(took, 2), **per_s}


def slowloris(url: str, n: int, source: str = "") -> list[socket.socket]:
    """``n`` connections to ``url``'s server, each having sent part of a request head
    (the caller sends more bytes to keep them slow, or none)."""
    parts = urlsplit(url)
    addr = (parts.hostname or "127.0.0.1", parts.port or 80)
    socks = []
    for _ in range(n):
        s = socket.create_connection(addr, timeout=10, source_address=(source, 0) if source else None)
        s.sendall(f"GET /api/v1/state HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode())
        socks.append(s)
    return socks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--rate", type=float, default=2500.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--cpus", default="", help="run on these CPUs only, e.g. 1")
    ap.add_argument("--go-file", default="")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    print("ready", flush=True)
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.01)
    print("flooding", flush=True)
    print(json.dumps(flood(args.url, args.rate, args.seconds, args.connections)), flush=True)


if __name__ == "__main__":
    main()
