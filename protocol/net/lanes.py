"""Payload parts of large frames, which travel over several parallel streams
("lanes") while their signed head travels on the message stream: each part waits
here for its head (or the head for its parts), a sender's unclaimed parts are
bounded and expire, and the parts of a rejected head are dropped as they come."""

from __future__ import annotations

import asyncio
import time

from protocol.net.streams import FRAME_MIN_RATE, PAYLOAD_GRACE_S
from protocol.wire.envelope import Envelope
from protocol.wire.reject import Reject, Rejected

#: a lane part's key: (sender, frame id, lane index)
Key = tuple[str, int, int]


class LaneParts:
    """The lane parts held now (``len``), by (sender, frame id, lane)."""

    def __init__(self, ttl_s: float, max_waiting: int) -> None:
        self.ttl_s = ttl_s  # parts no head claimed are dropped after this long
        self.max_waiting = max_waiting  # and a sender may have at most this many waiting
        self._parts: dict[Key, asyncio.Future[bytes]] = {}
        self._dropped: set[tuple[str, int]] = set()  # (sender, lane frame id) of rejected frames
        self._born: dict[Key, float] = {}  # lane parts waiting for their head: since when

    def __len__(self) -> int:
        return len(self._parts)

    def drop(self, sender: str, frame_id: int, lanes: int) -> None:
        """The head of ``sender``'s frame ``frame_id`` was rejected: drop its parts."""
        if len(self._dropped) > 4096:
            self._dropped.clear()
        self._dropped.add((sender, frame_id))
        for lane in range(lanes):
            self._parts.pop((sender, frame_id, lane), None)

    def dropped(self, sender: str, frame_id: int) -> bool:
        return (sender, frame_id) in self._dropped

    def _future(self, key: Key) -> asyncio.Future[bytes]:
        if key not in self._parts:
            self._parts[key] = asyncio.get_running_loop().create_future()
        return self._parts[key]

    def store(self, key: Key, data: memoryview) -> None:
        """Keep a lane part for its frame's head; parts no head claims expire after
        ``ttl_s``, and a sender may have at most ``max_waiting`` waiting."""
        now = time.monotonic()
        for old in [k for k, born in self._born.items() if now - born > self.ttl_s]:
            del self._born[old]
            fut = self._parts.get(old)
            if fut is not None and fut.done():
                del self._parts[old]
        waiting = sum(1 for k, f in self._parts.items() if k[0] == key[0] and f.done())
        if waiting >= self.max_waiting:
            raise Rejected(Reject.UNEXPECTED, f"{waiting} lane parts that no frame head has claimed")
        fut = self._future(key)
        if not fut.done():
            fut.set_result(data)
            self._born[key] = now

    async def join(self, sender: str, env: Envelope) -> memoryview:
        """The payload of ``sender``'s frame whose head is ``env``, joined from its parts."""
        lanes = env.lanes or {}
        sizes = lanes["bytes"]
        keys = [(sender, lanes["id"], i) for i in range(len(sizes))]
        limit = PAYLOAD_GRACE_S + sum(sizes) / FRAME_MIN_RATE
        try:
            parts = await asyncio.wait_for(asyncio.gather(*(self._future(k) for k in keys)), limit)
        except asyncio.TimeoutError:
            raise Rejected(Reject.TRUNCATED, f"lane parts did not arrive within {limit:.0f} s") from None
        finally:
            for k in keys:
                self._parts.pop(k, None)
                self._born.pop(k, None)
        if [len(p) for p in parts] != sizes:
            raise Rejected(Reject.TRUNCATED, "lane parts do not match their announced sizes")
        return memoryview(bytearray().join(parts))
