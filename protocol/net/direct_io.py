"""Direct streams whose payloads land where they are wanted: ``DirectReader`` is an
``asyncio.StreamReader`` that, while ``fill`` runs, copies arriving bytes straight
into the caller's buffer instead of its own (one copy less, and no
``bytes`` cut from a buffer that is then shifted down), and ``serve`` and ``connect``
make TCP streams that read with it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from protocol.wire.encoding import next_stop

#: a stream's own buffer (asyncio pauses reading above twice this); bytes that
#: ``fill`` takes bypass it
READ_LIMIT = 1 << 22
KEEPALIVE_IDLE_S, KEEPALIVE_PROBE_S, KEEPALIVE_PROBES = 30, 10, 3
KEEPALIVE_S = KEEPALIVE_IDLE_S + KEEPALIVE_PROBE_S * KEEPALIVE_PROBES
STAGING = 1 << 18  # what the loop receives into at once where no buffer is being filled

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class DirectReader(asyncio.StreamReader):
    """A stream reader with ``fill`` (the rest as ``asyncio.StreamReader``)."""

    _target: memoryview | None = None
    _filled = 0
    _step = 0
    _next = 0  # how full the target is when ``fill`` next yields
    _landed: asyncio.Future[None] | None = None

    def feed_data(self, data: bytes) -> None:
        if self._target is None:
            super().feed_data(data)
            return
        view = memoryview(data)
        n = min(len(view), len(self._target) - self._filled)
        self._target[self._filled : self._filled + n] = view[:n]
        self._filled += n
        if self._filled >= self._next:
            self._wake()
        if n < len(view):
            super().feed_data(view[n:])

    def room(self) -> memoryview | None:
        """Where the next bytes received go: the rest of the buffer ``fill`` fills, if any."""
        if self._target is None or self._filled == len(self._target):
            return None
        return self._target[self._filled :]

    def landed(self, nbytes: int) -> bool:
        """``nbytes`` were received into ``room()``; False if they went elsewhere."""
        if self._target is None or self._filled == len(self._target):
            return False
        self._filled += nbytes
        if self._filled >= self._next:
            self._wake()
        return True

    def feed_eof(self) -> None:
        super().feed_eof()
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self._landed is not None and not self._landed.done():
            self._landed.set_result(None)

    async def fill(self, view: memoryview, step: int) -> AsyncIterator[int]:
        """Fill ``view`` with the stream's next bytes, yielding how many it holds each
        time ``step`` more have landed (``encoding.next_stop``), and at the end (``IncompleteReadError`` where the
        stream ends first). Bytes land in ``view`` while the caller works on those yielded."""
        buffered = self._buffer  # type: ignore[attr-defined]
        n = min(len(buffered), len(view))
        with memoryview(buffered) as held:
            view[:n] = held[:n]
        del buffered[:n]
        self._maybe_resume_transport()  # type: ignore[attr-defined]
        self._target, self._filled, self._step = view, n, step
        try:
            while True:
                self._next = next_stop(self._filled, len(view), step)
                if self._filled < self._next and not self._eof and self._exception is None:  # type: ignore[attr-defined]
                    self._landed = asyncio.get_running_loop().create_future()
                    await self._landed
                if self._exception is not None:  # type: ignore[attr-defined]
                    raise self._exception  # type: ignore[attr-defined]
                if self._filled < self._next and self._eof:  # type: ignore[attr-defined]
                    raise asyncio.IncompleteReadError(bytes(view[: self._filled]), len(view))
                landed = self._filled
                yield landed
                if landed == len(view):  # (more may have landed while the caller had the last)
                    return
        finally:
            self._target, self._landed = None, None


class _Protocol(asyncio.BufferedProtocol):
    """A stream protocol that has the event loop receive straight into the buffer a
    ``DirectReader.fill`` is filling (else into a staging buffer, then ``feed_data``);
    the rest is a ``StreamReaderProtocol``'s, which it holds (``inner``) rather than
    extends: uvloop hands a protocol that is an ``asyncio.Protocol`` its bytes through
    ``data_received`` whatever else it has, so a subclass of one received every
    payload into a new bytes object and copied it again (measured: every byte of a
    64 MiB frame)."""

    def __init__(self, reader: DirectReader, connected: Connected | None) -> None:
        self.inner = asyncio.StreamReaderProtocol(reader, connected, loop=asyncio.get_running_loop())
        self._direct = reader
        self._staging = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        keep_alive(transport.get_extra_info("socket"))
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._direct.room()
        if target is not None:
            return target
        if not self._staging:
            self._staging = bytearray(STAGING)
        return memoryview(self._staging)

    def buffer_updated(self, nbytes: int) -> None:
        if not self._direct.landed(nbytes):
            self.inner.data_received(bytes(self._staging[:nbytes]))


def keep_alive(sock: socket.socket | None) -> None:
    """TCP keepalive on ``sock``: a peer that vanishes without a word (its machine off, a
    NAT that forgot it) is found within ``KEEPALIVE_S`` and its stream ends, as libp2p's
    pings would end a libp2p stream."""
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_PROBE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def _protocol(reader: DirectReader, connected: Connected | None = None) -> _Protocol:
    return _Protocol(reader, connected)


async def serve(host: str, port: int, connected: Connected) -> asyncio.AbstractServer:
    """A TCP server at ``host``:``port`` whose streams read with ``DirectReader``."""
    return await asyncio.get_running_loop().create_server(
        lambda: _protocol(DirectReader(READ_LIMIT), connected), host, port
    )


async def connect(host: str, port: int) -> Streams:
    """A TCP stream to ``host``:``port`` that reads with ``DirectReader``."""
    loop = asyncio.get_running_loop()
    reader = DirectReader(READ_LIMIT)  # the protocol holds it weakly: held here until the writer has it
    transport, protocol = await loop.create_connection(lambda: _protocol(reader), host, port)
    return reader, asyncio.StreamWriter(transport, protocol.inner, reader, loop)
