"""The status page's own process (``python -m coordinator.webserve FD``), started by
``coordinator.web.StatusServer``: it serves the page (assets in ``coordinator/static``),
``GET /api/v1/state`` and ``GET /metrics`` on the listening socket it inherits as ``FD``,
off the training loop and at the lowest CPU priority, so that no request rate slows
training: the page answers slower instead.

The coordinator hands it snapshots of the board on its stdin (a 4-byte big-endian
length, then the state as strict JSON) when it asks for one on its stdout (one byte);
it asks at most once per ``SNAPSHOT_S``, so the board is read and ``/metrics`` rendered
at most once a second whatever the request rate. Its stdin's end (the coordinator
closed it, or died, kill -9 included) ends it.

Connections are capped (``MAX_CONNECTIONS``, ``MAX_PER_CLIENT`` per address; one over
is closed at once, unanswered) and one that has not sent a whole request within
``HEADER_TIMEOUT_S`` of connecting or of its last answer is closed (slowloris).
Requests are read at most ``CLIENT_REQUESTS_PER_S`` a second from one client address
and ``REQUESTS_PER_S`` from all together (``RequestBudgets``): past that a connection's
reading pauses until the budgets allow its requests, so a flood waits in its own
sockets' buffers instead of costing CPU (the lowest priority does not cover the
kernel's work on each request), and one client's flood does not delay another's page.
Requests that would wait over ``MAX_BUDGET_WAIT_S`` reserve nothing and ask again after
it, so a flooder's debt, and its address's wait after the flood, stay that short, and
its paused connection is closed by the keep-alive timeout (closing it at once had the
flooder reconnect 17 times a second, 4% of a core in this process)."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from coordinator.status import PEER_STATES

logger = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
_ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
#: the board is snapshot (and /metrics rendered) at most once per this many seconds
SNAPSHOT_S = 1.0
#: how long a request waits for a fresh snapshot before it is answered with the last one
SNAPSHOT_WAIT_S = 2.0
#: a connection that has not sent a whole request head within this many seconds is closed
HEADER_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256
MAX_PER_CLIENT = 32
#: requests read a second, and the burst read at once, from all clients together and
#: from one client address (a page polls about once a second; a scraper less often)
REQUESTS_PER_S = 200.0
REQUEST_BURST = 400.0
CLIENT_REQUESTS_PER_S = 20.0
CLIENT_REQUEST_BURST = 60.0
#: the longest a connection's requests wait for the budgets with a reservation; longer,
#: they reserve nothing and are asked again after it (a flooder's debt stays this short,
#: and its connection, paused, closes at the keep-alive timeout rather than at once)
MAX_BUDGET_WAIT_S = HEADER_TIMEOUT_S / 2
#: client addresses whose budgets are kept; past it, refilled ones are forgotten
MAX_CLIENT_BUDGETS = 1024
#: the process's niceness: training processes always go first
NICENESS = 19
#: a snapshot frame's length prefix, and the largest frame read (the board bounds its own size)
FRAME = struct.Struct(">I")
MAX_SNAPSHOT_BYTES = 64 << 20
WANT = b"?"


def metrics_text(state: dict[str, Any]) -> bytes:
    """``/metrics`` (Prometheus text) of one board state."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(state))  # type: ignore[arg-type]
    return generate_latest(registry)


class _StateCollector:
    """Prometheus metrics of one board state (``StatusBoard.state()``)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        st = self.state
        tr = st["training"]
        gauges = {
            "fusionllm_step": ("Training steps done", tr["step"]),
            "fusionllm_steps_total": ("Steps the run will train", tr["steps"]),
            "fusionllm_loss": ("Loss of the last step", tr["loss"]),
            "fusionllm_validation_loss": ("Loss on the validation set at the last evaluation", tr["val_loss"]),
            "fusionllm_tokens_per_second": ("Tokens per second over the last 20 steps", tr["tokens_per_s"]),
            "fusionllm_eta_seconds": ("Estimated seconds to the end of the run", tr["eta_s"]),
            "fusionllm_epoch": ("Plan epoch", tr["epoch"]),
        }
        if st["checkpoint"] is not None:
            gauges["fusionllm_checkpoint_step"] = ("Steps held by the last checkpoint", st["checkpoint"]["step"])
            gauges["fusionllm_checkpoint_bytes"] = ("Size of the last checkpoint", st["checkpoint"]["bytes"])
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))  # "NaN" (strict JSON) reads as nan
        rec = st["recovery"]
        yield CounterMetricFamily("fusionllm_peer_failures", "Peer failures reported", value=rec["failures"])
        yield CounterMetricFamily("fusionllm_rollbacks", "Rollbacks to a checkpoint", value=rec["rollbacks"])
        yield CounterMetricFamily("fusionllm_steps_redone", "Steps undone by rollbacks", value=rec["steps_redone"])
        yield from self._peers(st["peers"])
        wire = CounterMetricFamily("fusionllm_link_wire_bytes", "Bytes on the wire per boundary", labels=["boundary"])
        raw = CounterMetricFamily(
            "fusionllm_link_raw_bytes", "Tensor bytes before compression per boundary", labels=["boundary"]
        )
        for link in st["links"]:
            wire.add_metric([str(link["boundary"])], link["wire_bytes"])
            raw.add_metric([str(link["boundary"])], link["raw_bytes"])
        yield wire
        yield raw
        rejected = CounterMetricFamily("fusionllm_rejected_messages", "Rejected messages by reason", labels=["code"])
        for code, n in st["rejected"].items():
            rejected.add_metric([code], n)
        yield rejected
        yield from self._breakdown(st.get("breakdown", []))

    @staticmethod
    def _breakdown(rows: list[dict[str, Any]]) -> Iterator[Metric]:
        """Per stage and part: the peers' mean seconds a step, and the estimator's."""
        measured = GaugeMetricFamily(
            "fusionllm_step_part_seconds", "Mean seconds a step per stage and part", labels=["stage", "part"]
        )
        predicted = GaugeMetricFamily(
            "fusionllm_step_part_predicted_seconds",
            "The estimator's seconds a step per stage and part (compute, wire, step)",
            labels=["stage", "part"],
        )
        for row in rows:
            for family, key in ((measured, "measured_ms"), (predicted, "predicted_ms")):
                for part, ms in row[key].items():
                    family.add_metric([str(row["stage"]), part], float(ms) / 1e3)
        yield measured
        yield predicted

    @staticmethod
    def _peers(peers: list[dict[str, Any]]) -> Iterator[Metric]:
        health = GaugeMetricFamily("fusionllm_peers", "Peers by health", labels=["health"])
        for h in ("ok", "late", "silent", "left"):
            health.add_metric([h], sum(1 for p in peers if p["health"] == h))
        yield health
        states = GaugeMetricFamily("fusionllm_peer_states", "Peers by their part in the run", labels=["state"])
        for state in PEER_STATES:
            states.add_metric([state], sum(1 for p in peers if p["state"] == state))
        yield states
        flops = GaugeMetricFamily("fusionllm_peer_flops", "Measured FLOP/s per peer", labels=["peer", "stage"])
        for p in peers:
            flops.add_metric([p["id"], "" if p["stage"] is None else str(p["stage"])], p.get("flops", 0.0))
        yield flops


class Snapshots:
    """The last snapshot of the board, and asking the coordinator for a fresh one (at
    most one request outstanding; the coordinator paces them to one per ``SNAPSHOT_S``)."""

    def __init__(self, ask: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.ask, self.clock = ask, clock
        self.body = b""  # the state as strict JSON
        self.at = -float("inf")
        self._metrics: bytes | None = None
        self._fresh: asyncio.Future[None] | None = None

    def put(self, body: bytes) -> None:
        self.body, self.at, self._metrics = body, self.clock(), None
        if self._fresh is not None and not self._fresh.done():
            self._fresh.set_result(None)
        self._fresh = None

    async def state_json(self) -> bytes:
        """The board's state, at most ``SNAPSHOT_S`` old if the coordinator answers within
        ``SNAPSHOT_WAIT_S`` (else the last one it sent)."""
        if self.clock() - self.at >= SNAPSHOT_S:
            if self._fresh is None:
                self._fresh = asyncio.get_running_loop().create_future()
                self.ask()
            try:
                await asyncio.wait_for(asyncio.shield(self._fresh), SNAPSHOT_WAIT_S)
            except asyncio.TimeoutError:
                pass
        return self.body

    async def metrics(self) -> bytes:
        body = await self.state_json()
        if self._metrics is None:  # rendered once per snapshot
            self._metrics = metrics_text(json.loads(body)) if body else b""
        return self._metrics


class Limits:
    """Open connections, in all and per client address."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_client: int = MAX_PER_CLIENT) -> None:
        self.total, self.per_client = total, per_client
        self.open: collections.Counter[str] = collections.Counter()
        self.refused = 0

    def take(self, client: str) -> bool:
        if sum(self.open.values()) >= self.total or self.open[client] >= self.per_client:
            self.refused += 1
            return False
        self.open[client] += 1
        return True

    def give(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


class RequestBudget:
    """Requests read at ``rate`` a second after a burst of ``burst``: ``delay(n)``
    reserves ``n`` and says how long to wait before reading them (0: now)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.allowance, self.clock = 1.0 / rate, burst / rate, clock
        self.due = clock()  # when the requests reserved so far would all have been read at ``rate``

    def delay(self, n: int, most: float = float("inf")) -> float | None:
        """Reserve ``n`` and say how long to wait, or reserve nothing and say None if
        that would be over ``most`` seconds (so a flood's debt stays bounded)."""
        now = self.clock()
        due = max(self.due, now) + n * self.interval
        wait = max(0.0, due - now - self.allowance)
        if wait > most:
            return None
        self.due = due
        return wait

    def idle(self) -> bool:
        """Whether it is full again (as good as a new one)."""
        return self.due <= self.clock()


class RequestBudgets:
    """One budget per client address and one for all clients together: a client's
    requests pass its own budget first and then the common one, so a flood from one
    address reserves no more of the common budget than its own allows."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.all = RequestBudget(REQUESTS_PER_S, REQUEST_BURST, clock)
        self.clients: dict[str, RequestBudget] = {}
        self.deferred = 0  # reads put off without a reservation, for being too far over budget

    def of(self, client: str) -> RequestBudget:
        """``client``'s own budget (the refilled ones are forgotten past ``MAX_CLIENT_BUDGETS``)."""
        budget = self.clients.get(client)
        if budget is None:
            if len(self.clients) >= MAX_CLIENT_BUDGETS:
                self.clients = {c: b for c, b in self.clients.items() if not b.idle()}
            budget = self.clients[client] = RequestBudget(CLIENT_REQUESTS_PER_S, CLIENT_REQUEST_BURST, self.clock)
        return budget


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, made only once ``Limits`` lets the
    connection in (else it is closed at once, unread)."""

    def __init__(self, make: Callable[[], asyncio.Protocol], limits: Limits, budgets: RequestBudgets) -> None:
        self._make, self._limits, self._budgets = make, limits, budgets
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else ""
        if not self._limits.take(client):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._client, self._inner = client, self._make()
        self._transport = transport  # type: ignore[assignment]
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            self._limits.give(self._client)
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Pass ``data`` on once the client's budget and then the common one allow the
        requests it holds; reading pauses while it waits (requests that would wait over
        ``MAX_BUDGET_WAIT_S`` reserve nothing and ask again after it)."""
        if self._inner is not None:
            self._admit(data, max(1, data.count(b"\r\n\r\n")), self._budgets.of(self._client))

    def _admit(self, data: bytes, n: int, budget: RequestBudget) -> None:
        after = self._budgets.all if budget is not self._budgets.all else None
        wait = budget.delay(n, MAX_BUDGET_WAIT_S)
        if wait is None:  # over budget for longer than that: nothing reserved, asked again later
            self._budgets.deferred += 1
            self._pause()
            asyncio.get_running_loop().call_later(MAX_BUDGET_WAIT_S, self._retry, data, n, budget)
        elif wait > 0:
            self._pause()
            asyncio.get_running_loop().call_later(wait, self._waited, data, n, after)
        elif after is not None:
            self._admit(data, n, after)
        else:
            self._pass(data)

    def _pause(self) -> None:
        self._paused = True
        self._transport.pause_reading()  # type: ignore[union-attr]

    def _retry(self, data: bytes, n: int, budget: RequestBudget) -> None:
        if self._inner is not None and self._transport is not None and not self._transport.is_closing():
            self._admit(data, n, budget)

    def _waited(self, data: bytes, n: int, after: RequestBudget | None) -> None:
        if self._inner is None or self._transport is None or self._transport.is_closing():
            return
        if after is not None:
            self._admit(data, n, after)
        else:
            self._pass(data)

    def _pass(self, data: bytes) -> None:
        self._inner.data_received(data)  # type: ignore[union-attr]
        if self._paused and self._transport is not None and not self._transport.is_closing():
            self._paused = False
            self._transport.resume_reading()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


def app_of(snapshots: Snapshots) -> web.Application:
    """The page's routes: only GET (and HEAD) exist."""

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=(STATIC / "index.html").read_bytes(), content_type="text/html")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _ASSETS:
            raise web.HTTPNotFound(text=f"no asset {name}")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=_ASSETS[name])

    async def state(request: web.Request) -> web.Response:
        body = await snapshots.state_json()
        headers = {"Cache-Control": "no-store"}
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=await snapshots.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", asset)
    app.router.add_get("/api/v1/state", state)
    app.router.add_get("/metrics", metrics)
    return app


async def _feed(snapshots: Snapshots) -> None:
    """Read snapshot frames from stdin until it ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    while True:
        try:
            (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            if size > MAX_SNAPSHOT_BYTES:
                raise ValueError(f"a snapshot of {size} bytes")
            snapshots.put(await reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the coordinator closed the pipe, or is gone


def _ask() -> None:
    """Ask the coordinator for a snapshot (it may be gone: stdin's end then ends us)."""
    try:
        os.write(sys.stdout.buffer.fileno(), WANT)
    except OSError:
        pass


async def serve(fd: int) -> None:
    """Serve the listening socket ``fd`` until stdin ends."""
    sock = socket.socket(fileno=fd)
    snapshots = Snapshots(_ask)
    runner = web.AppRunner(
        app_of(snapshots), access_log=None, keepalive_timeout=HEADER_TIMEOUT_S, handler_cancellation=True
    )
    await runner.setup()
    limits, budgets = Limits(), RequestBudgets()
    server = await asyncio.get_running_loop().create_server(
        lambda: _Guarded(runner.server, limits, budgets),  # type: ignore[arg-type]
        sock=sock,
    )
    try:
        await _feed(snapshots)
    finally:
        server.close()
        await runner.cleanup()


def main() -> None:
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    try:
        asyncio.run(serve(int(sys.argv[1])))
    except (BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
