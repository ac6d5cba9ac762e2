"""Outsiders against the coordinator's status page (issue 35): a request flood and a
slowloris, each cheap for the attacker.

``python -m tests.statusflood URL [--rate R] [--seconds S] [--connections C]
[--cpus LIST] [--go-file F]`` floods ``URL``'s ``/api/v1/state`` and ``/metrics``
over ``C`` keep-alive connections with requests pipelined (raw sockets, one thread),
paced to at most ``R`` requests/s, for ``S`` seconds; it prints ``ready``, waits for
``F`` if given, prints ``flooding``, then one JSON line: requests sent, answers read,
seconds, answers per second, connections the server closed.

:func:`slowloris` holds connections open that never finish their request head."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import time
from urllib.parse import urlsplit

#: requests in flight on one connection (pipelined)
DEPTH = 8
PATHS = ("/api/v1/state", "/metrics")


def _request(host: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


class _Conn:
    """One keep-alive connection: requests in flight, and reading their answers."""

    def __init__(self, addr: tuple[str, int], host: str, n: int) -> None:
        self.sock = socket.create_connection(addr, timeout=10)
        self.sock.setblocking(False)
        self.requests = [_request(host, PATHS[(n + i) % len(PATHS)]) for i in range(len(PATHS))]
        self.buf = bytearray()
        self.body_left = -1  # bytes of the current answer's body still to read (-1: in its head)
        self.in_flight = 0
        self.sent = 0

    def send(self, k: int) -> None:
        self.sock.sendall(b"".join(self.requests[(self.sent + i) % len(self.requests)] for i in range(k)))
        self.sent += k
        self.in_flight += k

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
            self.in_flight -= 1
            done += 1


def flood(url: str, rate: float, seconds: float, connections: int) -> dict[str, float]:
    """Flood ``url`` for ``seconds``: its tally."""
    parts = urlsplit(url)
    addr = (parts.hostname or "127.0.0.1", parts.port or 80)
    sel = selectors.DefaultSelector()
    conns: list[_Conn] = []
    tally = {"sent": 0, "answers": 0, "closed": 0}

    def connect(n: int) -> None:
        conn = _Conn(addr, parts.netloc, n)
        conns.append(conn)
        sel.register(conn.sock, selectors.EVENT_READ, conn)

    for n in range(connections):
        connect(n)
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        allowed = int(rate * (now - start)) + DEPTH - tally["sent"]
        for conn in conns:
            k = min(DEPTH - conn.in_flight, allowed)
            if k > 0:
                conn.send(k)
                tally["sent"] += k
                allowed -= k
        for key, _ in sel.select(0.005):
            conn = key.data
            got = conn.read()
            if got < 0:  # closed on us: another in its place
                tally["closed"] += 1
                sel.unregister(conn.sock)
                conn.sock.close()
                conns.remove(conn)
                connect(len(conns))
            else:
                tally["answers"] += got
    took = time.monotonic() - start
    for conn in conns:
        conn.sock.close()
    return {**tally, "seconds": round(took, 2), "answers_per_s": round(tally["answers"] / took, 1)}


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
