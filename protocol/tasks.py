"""Cancellation that ``except Exception`` cannot swallow.

When a call awaited through ``asyncio.wait_for`` fails at the very moment its task
is cancelled, ``wait_for`` raises the call's error instead of ``CancelledError``. A
loop that catches ``Exception`` and retries then runs on past its cancel: a send
that fails later with no one awaiting it, or a shutdown that waits for ever."""

from __future__ import annotations

import asyncio


def honour_cancel() -> None:
    """Raise ``CancelledError`` if the running task has been asked to stop; call it
    first in an ``except Exception`` around an await."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError
