"""A frame sealed and ready to write: what ``Transport.prepare`` makes (encoding,
hashing and signing, the CPU work of a send) apart from what ``Transport.transmit``
does with it (the wire), so a caller can time the two and run the first where it
chooses. The payload chunks are views of the values' own memory where the codec
keeps their bytes as they are (no copy between the compute thread and the stream)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.wire.encoding import Link, encode_values, raw_bytes, split_buffers
from protocol.wire.envelope import Sealer, payload_digest
from protocol.wire.messages import Message


@dataclass(frozen=True)
class Outgoing:
    peer_id: str
    head: bytes  # magic, length, header and signature (b"": sealed once hashed, ``seal``)
    chunks: list[memoryview]  # the payload, in order
    raw: int  # what the payload's values were before compression, in bytes
    lane_sizes: list[int] | None = None  # bytes per lane when the payload travels over lanes
    lane_parts: list[list[memoryview]] | None = None
    frame_id: int = -1
    #: a payload-first frame's (``protocol.net.payload_first``): its head for the payload's digest
    seal: Callable[[str], bytes] | None = None

    @property
    def payload_bytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def head_now(self) -> bytes:
        """The head, hashing the payload first where it was left to be hashed on the way."""
        return self.head if self.seal is None else self.seal(payload_digest(self.chunks))


def seal_outgoing(
    sealer: Sealer,
    peer_id: str,
    message: Message,
    values: list[Any] | None,
    link: Link | None,
    lanes: Callable[[int], tuple[int, int] | None],
    later: Callable[[int], bool] = lambda total: False,
) -> Outgoing:
    """Encode ``values`` with ``link``'s codec and seal ``message`` with them for
    ``peer_id``; where ``lanes(payload bytes)`` gives (frame id, lane count), the
    payload is split over that many lanes; where ``later(payload bytes)``, it is
    hashed and sealed on its way (a payload-first frame)."""
    descs: list[Any] = []
    chunks: list[memoryview] = []
    if values is not None:
        descs, chunks = encode_values(values, link)
    codec = str(link.codec) if link is not None else "none"
    total = sum(len(c) for c in chunks)
    raw = raw_bytes(descs)
    if later(total):

        def seal(digest: str) -> bytes:
            return sealer.seal(message, descs, chunks, codec, digest=digest)[0]

        return Outgoing(peer_id, b"", chunks, raw, seal=seal)
    laned = lanes(total)
    if laned is None:
        head, _ = sealer.seal(message, descs, chunks, codec)
        return Outgoing(peer_id, head, chunks, raw)
    frame_id, count = laned
    parts = split_buffers(chunks, count)
    sizes = [sum(len(c) for c in part) for part in parts]
    head, _ = sealer.seal(message, descs, chunks, codec, {"id": frame_id, "bytes": sizes})
    return Outgoing(peer_id, head, chunks, raw, sizes, parts, frame_id)
