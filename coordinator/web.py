"""The coordinator's read-only HTTP side, on the coordinator's own event loop:
the status page (assets shipped in ``coordinator/static``), ``GET /api/v1/state``
(JSON, schema in ``coordinator.status``) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from coordinator.status import PEER_STATES, StatusBoard, finite_json

logger = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
_ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
DEFAULT_PORT = 8470


class _BoardCollector:
    """Prometheus metrics read from the board at scrape time."""

    def __init__(self, board: StatusBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        st = self.board.state()
        tr = st["training"]
        gauges = {
            "fusionllm_step": ("Training steps done", tr["step"]),
            "fusionllm_steps_total": ("Steps the run will train", tr["steps"]),
            "fusionllm_loss": ("Loss of the last step", tr["loss"]),
            "fusionllm_validation_loss": ("Loss on the validation set at the last evaluation", tr["val_loss"]),
            "fusionllm_tokens_per_second": ("Tokens per second over the last 20 steps", tr["tokens_per_s"]),
            "fusionllm_eta_seconds": ("Estimated seconds to the end of the run", tr["eta_s"]),
        }
        gauges["fusionllm_epoch"] = ("Plan epoch", tr["epoch"])
        if st["checkpoint"] is not None:
            gauges["fusionllm_checkpoint_step"] = ("Steps held by the last checkpoint", st["checkpoint"]["step"])
            gauges["fusionllm_checkpoint_bytes"] = ("Size of the last checkpoint", st["checkpoint"]["bytes"])
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        rec = st["recovery"]
        yield CounterMetricFamily("fusionllm_peer_failures", "Peer failures reported", value=rec["failures"])
        yield CounterMetricFamily("fusionllm_rollbacks", "Rollbacks to a checkpoint", value=rec["rollbacks"])
        yield CounterMetricFamily("fusionllm_steps_redone", "Steps undone by rollbacks", value=rec["steps_redone"])
        peers = GaugeMetricFamily("fusionllm_peers", "Peers by health", labels=["health"])
        for health in ("ok", "late", "silent", "left"):
            peers.add_metric([health], sum(1 for p in st["peers"] if p["health"] == health))
        yield peers
        states = GaugeMetricFamily("fusionllm_peer_states", "Peers by their part in the run", labels=["state"])
        for state in PEER_STATES:
            states.add_metric([state], sum(1 for p in st["peers"] if p["state"] == state))
        yield states
        flops = GaugeMetricFamily("fusionllm_peer_flops", "Measured FLOP/s per peer", labels=["peer", "stage"])
        for p in st["peers"]:
            flops.add_metric([p["id"], "" if p["stage"] is None else str(p["stage"])], p.get("flops", 0.0))
        yield flops
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


class StatusServer:
    """Serves one board; ``start`` binds, ``aclose`` stops. Only GET (and HEAD) exist."""

    def __init__(self, board: StatusBoard, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.board = board
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_BoardCollector(board))  # type: ignore[arg-type]
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> None:
        """Bind ``host:port``; with no port given, the default one or, if taken, any free one.
        Raises OSError (one line) when an explicitly given port cannot be bound."""
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._asset)
        app.router.add_get("/api/v1/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        ports = [self.port] if self.port is not None else [DEFAULT_PORT, 0]
        for i, port in enumerate(ports):
            site = web.TCPSite(self._runner, self.host, port)
            try:
                await site.start()
            except OSError as exc:
                if i + 1 < len(ports):
                    continue
                await self._runner.cleanup()
                raise OSError(f"cannot serve the status page on {self.host}:{port}: {exc.strerror}") from None
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=(STATIC / "index.html").read_bytes(), content_type="text/html")

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _ASSETS:
            raise web.HTTPNotFound(text=f"no asset {name}")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=_ASSETS[name])

    async def _state(self, request: web.Request) -> web.Response:
        state = finite_json(self.board.state())  # strict JSON: a NaN loss arrives as "NaN"
        return web.json_response(state, headers={"Cache-Control": "no-store"}, dumps=_strict_dumps)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _strict_dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False)
