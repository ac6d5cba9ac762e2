"""Reading a signed frame off a stream: its head with its sizes checked first, and
its payload into a buffer that grows as bytes arrive (never sized by a claim)."""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from protocol.trust.identity import SIGNATURE_BYTES
from protocol.wire.encoding import MAX_HEADER_BYTES, read_growing
from protocol.wire.envelope import HEAD, MAGIC
from protocol.wire.reject import Reject, Rejected

T = TypeVar("T")
#: a payload-first frame (``protocol.net.payload_first``) starts with this magic where a
#: head's is, a zero length, then its payload's size
PAYLOAD_FIRST = b"FLP1"
PAYLOAD_SIZE = struct.Struct(">Q")


async def read_or_end(reader: asyncio.StreamReader, n: int, what: str) -> bytes | None:
    """``n`` bytes that begin ``what``; None when the stream ends cleanly before them
    (``Rejected`` when it ends inside them)."""
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise Rejected(Reject.TRUNCATED, f"stream ended inside {what}") from None
        return None


async def read_frame_head(reader: asyncio.StreamReader, payload_first: bool = False) -> bytes | int | None:
    """A frame's head (magic, length, header, signature), its sizes checked before
    reading; None when the stream ends cleanly before one. ``payload_first``: a
    payload-first frame's start is taken too, and its payload's size returned."""
    first = await read_or_end(reader, HEAD.size, "a frame head")
    if first is None:
        return None
    magic, hlen = HEAD.unpack(first)
    if magic == PAYLOAD_FIRST and payload_first:
        if hlen:
            raise Rejected(Reject.MALFORMED, f"a payload-first frame's start with a length of {hlen}")
        return int(PAYLOAD_SIZE.unpack(await reader.readexactly(PAYLOAD_SIZE.size))[0])
    if magic != MAGIC:
        raise Rejected(Reject.MALFORMED, f"bad magic {magic!r}: not a signed FusionLLM frame")
    if hlen > MAX_HEADER_BYTES:
        raise Rejected(Reject.OVERSIZED, f"header of {hlen} bytes is over {MAX_HEADER_BYTES}")
    return first + await reader.readexactly(hlen + SIGNATURE_BYTES)


#: a payload must arrive at this average rate at least, after a grace of
#: ``PAYLOAD_GRACE_S``: a sender that trickles bytes (or stops inside a payload) holds
#: its stream, its budget and the bytes read so far no longer than that. One stream's
#: floor is a sixteenth of a laned frame's (``FRAME_MIN_RATE``): a frame's lanes and
#: the sender's other streams share its uplink (an 8 Mbit/s one carries 120 streams at it)
MIN_PAYLOAD_RATE = 8 * 1024  # bytes per second
PAYLOAD_GRACE_S = 120.0
#: a whole frame sent over lanes must arrive at this average rate (1 Mbit/s), after the same grace
FRAME_MIN_RATE = 125_000


def payload_deadline(size: int) -> float:
    """Seconds a payload of ``size`` bytes may take to arrive."""
    return PAYLOAD_GRACE_S + size / MIN_PAYLOAD_RATE


async def _within(read: Awaitable[T], seconds: float) -> T:
    """``read``, cancelled after ``seconds`` (``asyncio.TimeoutError``); on Python 3.11+
    without the task ``wait_for`` makes for each call (this runs for every payload)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await read
    return await asyncio.wait_for(read, seconds)


async def read_payload(
    reader: asyncio.StreamReader, size: int, on_chunk: Callable[[], None] | None = None, digest: Any = None
) -> memoryview:
    """A payload of ``size`` bytes (``Rejected``: the stream ended inside it, or it came
    slower than ``MIN_PAYLOAD_RATE``), hashed into ``digest`` as it arrives if given."""
    limit = payload_deadline(size)
    try:
        payload = await _within(read_growing(reader, size, on_chunk, digest), limit)
    except asyncio.TimeoutError:
        raise Rejected(
            Reject.TRUNCATED,
            f"a payload of {size} bytes did not arrive within {limit:.0f} s (slower than {MIN_PAYLOAD_RATE} B/s)",
        ) from None
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
