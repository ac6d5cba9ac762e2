"""Direct streams whose payloads land where they are wanted: ``DirectReader`` is an
``asyncio.StreamReader`` that, while ``read_into`` waits, copies arriving bytes
straight into the caller's buffer instead of its own (one copy less, and no
``bytes`` cut from a buffer that is then shifted down), and ``serve`` and ``connect``
make TCP streams that read with it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

#: a stream's own buffer (asyncio pauses reading above twice this); bytes that
#: ``read_into`` takes bypass it
READ_LIMIT = 1 << 22

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class DirectReader(asyncio.StreamReader):
    """A stream reader with ``read_into`` (the rest as ``asyncio.StreamReader``)."""

    _target: memoryview | None = None
    _filled = 0
    _full: asyncio.Future[None] | None = None

    def feed_data(self, data: bytes) -> None:
        if self._target is None:
            super().feed_data(data)
            return
        view = memoryview(data)
        n = min(len(view), len(self._target) - self._filled)
        self._target[self._filled : self._filled + n] = view[:n]
        self._filled += n
        if self._filled == len(self._target):
            self._wake()
        if n < len(view):
            super().feed_data(view[n:])

    def feed_eof(self) -> None:
        super().feed_eof()
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self._full is not None and not self._full.done():
            self._full.set_result(None)

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the stream's next bytes (``IncompleteReadError`` where it
        ends first)."""
        buffered = self._buffer  # type: ignore[attr-defined]
        n = min(len(buffered), len(view))
        with memoryview(buffered) as held:
            view[:n] = held[:n]
        del buffered[:n]
        self._maybe_resume_transport()  # type: ignore[attr-defined]
        if n == len(view):
            return
        self._target, self._filled = view, n
        self._full = asyncio.get_running_loop().create_future()
        try:
            if not self._eof and self._exception is None:  # type: ignore[attr-defined]
                await self._full
        finally:
            got, self._target, self._full = self._filled, None, None
        if self._exception is not None:  # type: ignore[attr-defined]
            raise self._exception  # type: ignore[attr-defined]
        if got < len(view):
            raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))


def _protocol(reader: DirectReader, connected: Connected | None = None) -> asyncio.StreamReaderProtocol:
    return asyncio.StreamReaderProtocol(reader, connected, loop=asyncio.get_running_loop())


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
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
