"""Bytes in flight: how much payload a process reads at once, per sender and in all.

A payload's bytes are read only once its claimed size fits the budget; until then
its stream is left unread, so TCP's flow control holds the sender back (nothing is
refused: honest traffic only waits). A payload always fits when nothing else is held
(of its sender, and in all), so one larger than a limit still arrives, alone. What a
claim can hold is bounded anyway (the gate refuses payloads over the plan's sizes);
the budget bounds how many such claims are read at the same time."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

#: payload bytes read at once from one sender, and from all of them
PER_SENDER_IN_FLIGHT = 1 << 30
TOTAL_IN_FLIGHT = 4 << 30


class ByteBudget:
    """Claimed payload bytes being read, per sender and in all (see the module)."""

    def __init__(self, per_sender: int = PER_SENDER_IN_FLIGHT, total: int = TOTAL_IN_FLIGHT) -> None:
        self.per_sender, self.total = per_sender, total
        self.held: dict[str, int] = defaultdict(int)
        self.waits = 0  # payloads that had to wait for room (counted, not refused)
        self._waiting: set[asyncio.Future[None]] = set()

    @property
    def in_flight(self) -> int:
        return sum(self.held.values())

    def fits(self, sender: str, nbytes: int) -> bool:
        mine, everyone = self.held.get(sender, 0), self.in_flight
        return (mine == 0 or mine + nbytes <= self.per_sender) and (everyone == 0 or everyone + nbytes <= self.total)

    @contextlib.asynccontextmanager
    async def hold(self, sender: str, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of ``sender``'s budget while the block runs (waiting for room;
        released without awaiting, so a cancelled reader never leaks its bytes)."""
        if not self.fits(sender, nbytes):
            self.waits += 1
        while not self.fits(sender, nbytes):
            woken = asyncio.get_running_loop().create_future()
            self._waiting.add(woken)
            try:
                await woken
            finally:
                self._waiting.discard(woken)
        self.held[sender] += nbytes
        try:
            yield
        finally:
            self.held[sender] -= nbytes
            if not self.held[sender]:
                del self.held[sender]
            for woken in self._waiting:
                if not woken.done():
                    woken.set_result(None)
