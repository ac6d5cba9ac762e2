"""The stage's compute: one call at a time, in order. Long calls run on a thread of
their own, off the event loop, so that messages and heartbeats go on while a stage
computes; a stage's short, frequent pieces (``inline``) run on the event loop itself
once such a piece measured under ``INLINE_MAX_S``, and the thread is idle: handing
each micro-batch's forward and backward to the thread and back cost 4-10 ms a step on
the demo (the ``handoff`` of the step's breakdown), where the loop is held at most a
few ms each time."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from peer.bench import one_cpu_thread
from peer.throttle import Throttle

#: a piece that last took less than this runs on the event loop (the loop's other work
#: waits that long at most); one that took longer goes back to the thread. Its CPU time
#: where one CPU thread did its work (``_timed``): a piece that waited for a core on a
#: busy machine went to the thread by its clock time and paid the hand-off for nothing
#: (the demo's handoff part fell from 1.0-2.1 to 0.8-1.4 ms a step, three alternated runs)
INLINE_MAX_S = 0.01


class Compute:
    """Runs calls one at a time, in order; ``throttled`` adds the idle time the throttle asks for."""

    def __init__(self, device: torch.device, throttle: Throttle) -> None:
        self.device = device
        self.throttle = throttle
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._on_thread = 0  # calls handed to the thread and not back yet
        self._last: dict[str, float] = {}  # an inline kind of piece -> the seconds it last took

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the compute thread (one at a time, in order)."""
        self._on_thread += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._on_thread -= 1

    async def timed(self, fn: Any, *args: Any, inline: str | None = None) -> tuple[Any, float]:
        """``fn(*args)`` and the seconds it took, its GPU work included: on the compute
        thread, or, for a piece of kind ``inline`` whose last run took under
        ``INLINE_MAX_S`` while the thread has nothing (so the order of calls holds), on
        the event loop, which then runs once (as when the thread hands a result back)."""
        out, seconds, _ = await self._timed_work(fn, *args, inline=inline)
        return out, seconds

    async def _timed_work(self, fn: Any, *args: Any, inline: str | None = None) -> tuple[Any, float, float | None]:
        """As ``timed``, with the call's work (``_timed``'s third value)."""
        if inline is not None and self._on_thread == 0 and self._last.get(inline, INLINE_MAX_S) < INLINE_MAX_S:
            out, seconds, work = _timed(self.device, fn, *args)
            await asyncio.sleep(0)  # what the piece made ready (its sends) goes on before the next piece
        else:
            out, seconds, work = await self.run(_timed, self.device, fn, *args)
        if inline is not None:
            self._last[inline] = seconds if work is None else work
        return out, seconds, work

    async def throttled(self, fn: Any, *args: Any, inline: str | None = None) -> tuple[Any, float]:
        """``fn(*args)`` (as ``timed``), then the idle time the throttle asks for (on the
        event loop: messages and heartbeats go on); the result and the busy seconds (both count)."""
        out, seconds, work = await self._timed_work(fn, *args, inline=inline)
        return out, seconds + await self.throttle.idle(seconds, work)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(device: torch.device, fn: Any, *args: Any) -> tuple[Any, float, float | None]:
    """``fn(*args)``, the seconds it took, and its work: the thread's CPU seconds where
    one CPU thread did all of it (``peer.throttle``), else None (its wall time)."""
    one_thread = one_cpu_thread(device)
    t0, c0 = time.perf_counter(), time.thread_time() if one_thread else 0.0
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0, time.thread_time() - c0 if one_thread else None
