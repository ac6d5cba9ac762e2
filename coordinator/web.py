"""The coordinator's read-only HTTP side: the status page, ``GET /api/v1/state`` (JSON,
schema in ``coordinator.status``) and ``GET /metrics`` (Prometheus text), served by a
process of its own (``coordinator.webserve``) so that no request rate slows training.

The coordinator's loop binds the socket (so a port that cannot be bound is said at
once), starts that process on it, and hands it a snapshot of the board when it asks:
the board is read on the loop that writes it, at most once per ``SNAPSHOT_S``, and
crosses to the page as bytes nobody can change."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.status import StatusBoard, finite_json
from coordinator.webserve import FRAME, SNAPSHOT_S

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8470
#: snapshot bytes the page's process may leave unread before the next are skipped
MAX_UNREAD = 8 << 20
#: how long closing waits for the page's process to end (told by its input's end and SIGTERM) before SIGKILL
CLOSE_WAIT_S = 2.0


class StatusServer:
    """Serves one board; ``start`` binds and starts the page's process, ``aclose`` stops
    it. The constructor does no I/O."""

    def __init__(
        self,
        board: StatusBoard,
        host: str = "127.0.0.1",
        port: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board, self.host, self.port, self.clock = board, host, port, clock
        self.snapshots = 0  # snapshots of the board taken so far
        self._proc: asyncio.subprocess.Process | None = None
        self._asks: asyncio.Task[None] | None = None
        self._sent_at = -float("inf")
        self._pending: asyncio.TimerHandle | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def pid(self) -> int | None:
        """The page's process (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Bind ``host:port``; with no port given, the default one or, if taken, any free one.
        Raises OSError (one line) when an explicitly given port cannot be bound."""
        sock = self._bind()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "coordinator.webserve",
                str(sock.fileno()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(sock.fileno(),),
                env={**os.environ, "PYTHONPATH": _path_with_ours()},
            )
        finally:
            sock.close()  # the page's process holds it now
        self._asks = asyncio.create_task(self._serve_asks())

    def _bind(self) -> socket.socket:
        ports = [self.port] if self.port is not None else [DEFAULT_PORT, 0]
        for i, port in enumerate(ports):
            try:
                family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
                dual = family == socket.AF_INET6 and self.host == "::" and socket.has_dualstack_ipv6()
                sock = socket.create_server((self.host, port), family=family, dualstack_ipv6=dual, backlog=512)
            except OSError as exc:
                if i + 1 < len(ports):
                    continue
                raise OSError(f"cannot serve the status page on {self.host}:{port}: {exc.strerror}") from None
            self.port = sock.getsockname()[1]
            return sock
        raise AssertionError("unreachable")

    async def _serve_asks(self) -> None:
        """Answer the page's asks for a snapshot, at most one per ``SNAPSHOT_S``."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        while await proc.stdout.read(64):
            if self._pending is None:
                wait = max(0.0, self._sent_at + SNAPSHOT_S - self.clock())
                self._pending = asyncio.get_running_loop().call_later(wait, self._send)
        code = await proc.wait()
        if self._proc is proc:  # not closed by us
            logger.warning("the status page's process ended (exit code %d): the page is down", code)

    def _send(self) -> None:
        self._pending = None
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        if proc.stdin.transport.get_write_buffer_size() > MAX_UNREAD:  # type: ignore[attr-defined]
            return  # the page is not reading: it asks again
        body = json.dumps(finite_json(self.board.state()), allow_nan=False).encode()
        self.snapshots += 1
        self._sent_at = self.clock()
        proc.stdin.write(FRAME.pack(len(body)) + body)

    async def aclose(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()  # its end of input (what ends it should we be killed)
        with contextlib.suppress(ProcessLookupError):
            # and SIGTERM now: niced behind a busy run's peers it may get no CPU for seconds
            # (every run's end waited the whole CLOSE_WAIT_S for it); what it serves is over
            proc.terminate()
            # and on: a stopped process acts on no SIGTERM (one stopped early in its start
            # waited out the whole CLOSE_WAIT_S, nearly every time on a quiet machine)
            proc.send_signal(signal.SIGCONT)
        try:
            await asyncio.wait_for(proc.wait(), CLOSE_WAIT_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
        if self._asks is not None:
            await asyncio.gather(self._asks, return_exceptions=True)
            self._asks = None


def _path_with_ours() -> str:
    """PYTHONPATH with this checkout first, so the page's process imports this code."""
    ours = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([ours, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
