"""Application-level pacing of sends: each destination may have a rate, and bytes
sent to it wait as long as they take at that rate (e.g. to mimic a slow link, or to
send no faster than the plan's measured bandwidth)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict


class Pacer:
    """Rates per destination peer, and when each paced link is next free."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}  # peer id -> bytes/s
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._free_at: dict[str, float] = defaultdict(float)

    def set_rate(self, peer_id: str, mbps: float | None) -> None:
        """Pace sends to ``peer_id`` to ``mbps`` Mbit/s (None: as fast as possible)."""
        if mbps is None or mbps <= 0:
            self._rates.pop(peer_id, None)
        else:
            self._rates[peer_id] = mbps * 1e6 / 8

    async def wait(self, peer_id: str, nbytes: int) -> None:
        """Wait as long as ``nbytes`` take on the paced link to ``peer_id``."""
        rate = self._rates.get(peer_id)
        if rate is None:
            return
        async with self._locks[peer_id]:
            now = time.monotonic()
            start = max(now, self._free_at[peer_id])
            self._free_at[peer_id] = start + nbytes / rate
            await asyncio.sleep(self._free_at[peer_id] - now)
