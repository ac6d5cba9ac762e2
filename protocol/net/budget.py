"""Bytes in flight: how much payload a process reads from one sender at once.

A payload's bytes are read only once its claimed size fits its sender's budget;
until then its stream is left unread, so TCP's flow control holds the sender back
(nothing is refused: honest traffic only waits). A payload always fits when its
sender has nothing else in flight, so one larger than the limit still arrives,
alone. The budget is per sender only: a claim that is never paid (a head claiming
4 GiB, then silence) holds up its own sender's later payloads and no one else's; a
budget shared by all senders would let one such claim stop everyone's traffic. A
claim allocates nothing by itself (payloads grow as bytes arrive), and what a
sender may claim is bounded by the plan's sizes and the stream limits."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

#: claimed payload bytes read at once from one sender
PER_SENDER_IN_FLIGHT = 1 << 30


class ByteBudget:
    """Claimed payload bytes being read, per sender (see the module)."""

    def __init__(self, per_sender: int = PER_SENDER_IN_FLIGHT) -> None:
        self.per_sender = per_sender
        self.held: dict[str, int] = defaultdict(int)
        self.waits = 0  # payloads that had to wait for room (counted, not refused)
        self._waiting: set[asyncio.Future[None]] = set()

    @property
    def in_flight(self) -> int:
        return sum(self.held.values())

    def fits(self, sender: str, nbytes: int) -> bool:
        mine = self.held.get(sender, 0)
        return mine == 0 or mine + nbytes <= self.per_sender

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
