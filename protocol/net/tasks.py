"""Cancellation that ``except Exception`` cannot swallow.

When a call awaited through ``asyncio.wait_for`` fails at the very moment its task
is cancelled, ``wait_for`` raises the call's error instead of ``CancelledError``. A
loop that catches ``Exception`` and retries then runs on past its cancel: a send
that fails later with no one awaiting it, or a shutdown that waits for ever."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


def honour_cancel() -> None:
    """Raise ``CancelledError`` if the running task has been asked to stop; call it
    first in an ``except Exception`` around an await. (Python 3.10's tasks do not
    count cancel requests: there it does nothing.)"""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    if cancelling is not None and cancelling() > 0:
        raise asyncio.CancelledError


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
