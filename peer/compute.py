"""The stage's compute thread: one call at a time, in order, off the event loop, so
that messages and heartbeats go on while a stage computes."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from peer.throttle import Throttle


class Compute:
    """Runs calls on one thread; ``throttled`` adds the idle time the throttle asks for."""

    def __init__(self, device: torch.device, throttle: Throttle) -> None:
        self.device = device
        self.throttle = throttle
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the compute thread (one at a time, in order)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def timed(self, fn: Any, *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` on the compute thread and the seconds it took, its GPU work included."""
        return await self.run(_timed, self.device, fn, *args)

    async def throttled(self, fn: Any, *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` on the compute thread, then the idle time the throttle asks for
        (on the event loop: messages and heartbeats go on); the result and the busy
        seconds (both count)."""
        out, seconds = await self.timed(fn, *args)
        return out, seconds + await self.throttle.idle(seconds)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(device: torch.device, fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0
