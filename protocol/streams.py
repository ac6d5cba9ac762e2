"""Reading a signed frame off a stream: its head with its sizes checked first, and
its payload into a buffer that grows as bytes arrive (never sized by a claim)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from protocol.envelope import HEAD, MAGIC, Reject, Rejected
from protocol.identity import SIGNATURE_BYTES
from protocol.wire import MAX_HEADER_BYTES, read_growing


async def read_or_end(reader: asyncio.StreamReader, n: int, what: str) -> bytes | None:
    """``n`` bytes that begin ``what``; None when the stream ends cleanly before them
    (``Rejected`` when it ends inside them)."""
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise Rejected(Reject.TRUNCATED, f"stream ended inside {what}") from None
        return None


async def read_frame_head(reader: asyncio.StreamReader) -> bytes | None:
    """A frame's head (magic, length, header, signature), its sizes checked before
    reading; None when the stream ends cleanly before one."""
    first = await read_or_end(reader, HEAD.size, "a frame head")
    if first is None:
        return None
    magic, hlen = HEAD.unpack(first)
    if magic != MAGIC:
        raise Rejected(Reject.MALFORMED, f"bad magic {magic!r}: not a signed FusionLLM frame")
    if hlen > MAX_HEADER_BYTES:
        raise Rejected(Reject.OVERSIZED, f"header of {hlen} bytes is over {MAX_HEADER_BYTES}")
    return first + await reader.readexactly(hlen + SIGNATURE_BYTES)


async def read_payload(
    reader: asyncio.StreamReader, size: int, on_chunk: Callable[[], None] | None = None
) -> memoryview:
    payload = await read_growing(reader, size, on_chunk)
    if payload is None:
        raise Rejected(Reject.TRUNCATED, "stream ended inside a payload")
    return payload


async def discard(reader: asyncio.StreamReader, size: int) -> None:
    while size > 0:
        chunk = await reader.read(min(size, 1 << 20))
        if not chunk:
            raise Rejected(Reject.TRUNCATED, "stream ended inside a rejected payload")
        size -= len(chunk)


async def linger(reader: asyncio.StreamReader, timeout: float) -> None:
    """Wait (at most ``timeout``) for the other end to close: what was written last is
    then read, not cut off by closing a stream whose bytes are still on their way
    through the daemons."""
    try:
        await asyncio.wait_for(reader.read(1), timeout)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
