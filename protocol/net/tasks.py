"""Asyncio helpers every component shares: the one periodic loop (``every``), the one
bounded wait (``wait_until``), and cancellation that ``except Exception`` cannot swallow.

When a call awaited through ``asyncio.wait_for`` fails at the very moment its task
is cancelled, ``wait_for`` raises the call's error instead of ``CancelledError``. A
loop that catches ``Exception`` and retries then runs on past its cancel: a send
that fails later with no one awaiting it, or a shutdown that waits for ever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from protocol.net.clock import SYSTEM_CLOCK, Clock

logger = logging.getLogger(__name__)
T = TypeVar("T")


def honour_cancel() -> None:
    """Raise ``CancelledError`` if the running task has been asked to stop; call it
    first in an ``except Exception`` around an await. (Python 3.10's tasks do not
    count cancel requests: there it does nothing.)"""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    if cancelling is not None and cancelling() > 0:
        raise asyncio.CancelledError


async def unless_set(wait: Awaitable[T], event: asyncio.Event, timeout: float) -> T | None:
    """``wait``'s result, or None if ``event`` is set first: ``wait`` is then cancelled,
    and waited for up to ``timeout`` s to end."""
    task, woken = asyncio.ensure_future(wait), asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, woken}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        woken.cancel()
    if task.done():
        return task.result()
    await cancel_and_wait(task, timeout)
    return None


def log_failure(task: asyncio.Future[Any]) -> None:
    """A done-callback: a background task's failure is logged, never left unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a background task failed: %s", task.exception())


async def cancel_and_wait(task: asyncio.Future[Any], timeout: float) -> bool:
    """Cancel ``task`` and wait up to ``timeout`` s for it to end, cancelling it again
    each second (a cancel can still be lost where ``wait_for``'s call returned as it
    came); whether it ended. Its own failure is retrieved, not raised."""
    deadline = time.monotonic() + timeout
    while not task.done():
        task.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.wait({task}, timeout=min(1.0, left))
    if not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" report
    return True


async def cancel_all(tasks: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """``cancel_and_wait`` for each of ``tasks`` at once."""
    await asyncio.gather(*(cancel_and_wait(t, timeout) for t in list(tasks)))


async def every(
    period: float,
    tick: Callable[[], Awaitable[bool | None]],
    *,
    what: str,
    clock: Clock = SYSTEM_CLOCK,
    first: float | None = None,
    level: int = logging.DEBUG,
) -> None:
    """The one periodic loop: wait ``period`` s (``first`` s the first time), run
    ``tick``, and again, until ``tick`` returns True. A tick that fails is logged at
    ``level`` ("<what> failed: <error>") and the loop goes on; a cancel always ends it."""
    await clock.sleep(period if first is None else first)
    while True:
        try:
            if await tick():
                return
        except Exception as exc:
            honour_cancel()
            logger.log(level, "%s failed: %s", what, exc)
        await clock.sleep(period)


async def wait_until(
    probe: Callable[[], Awaitable[T | None]],
    timeout: float,
    *,
    interval: float = 1.0,
    clock: Clock = SYSTEM_CLOCK,
) -> T | None:
    """The one bounded wait: ask ``probe`` every ``interval`` s until it returns
    something other than None (returned) or ``timeout`` s have passed (None). The
    probe is asked at least once; a cancel ends the wait."""
    deadline = clock.now() + timeout
    while True:
        found = await probe()
        if found is not None:
            return found
        left = deadline - clock.now()
        if left <= 0:
            return None
        await clock.sleep(min(interval, left))
