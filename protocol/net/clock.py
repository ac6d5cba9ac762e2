"""The clock every driver and periodic loop reads, injected so that tests (and the
simulator) can drive time instead of waiting for it.

``SystemClock`` is the real one (monotonic seconds, ``asyncio.sleep``). ``FakeClock``
moves only when a test calls ``advance``: each sleeper wakes, in order of its wake
time, once the clock passes it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Real time: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


class FakeClock:
    """A clock that stands still until ``advance`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(0.0, seconds), next(self._order), future))
        await future

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking each sleeper due by then in order
        and letting what it runs settle before the next one wakes."""
        target = self._now + seconds
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            wake, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, wake)
            if not future.done():
                future.set_result(None)
            await _settle()
        self._now = target

    @property
    def sleeping(self) -> int:
        """How many sleepers wait (cancelled ones included until their time comes)."""
        return sum(1 for *_, f in self._sleepers if not f.done())


async def _settle(rounds: int = 20) -> None:
    """Let ready callbacks run: a few passes of the event loop."""
    for _ in range(rounds):
        await asyncio.sleep(0)
