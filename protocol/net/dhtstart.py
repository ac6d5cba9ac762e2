"""A hivemind DHT node started so that its process dying, or not becoming ready in
time, is an error, not a wait without end: ``hivemind.DHT(start=True)`` waits for the
ready signal of the process it forks with no timeout. A process killed first never
sends one; one stuck would not either. (CI saw commands print nothing for minutes: a
lock of hivemind's that a killed process held, which the constructor takes in the
caller's process too, ``fusionllm.zygote._own_cross_process_locks``; ``started``
bounds the whole start.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as NotYet  # the builtin one only from Python 3.11
from typing import Any

import hivemind
import psutil

#: how often the start looks whether the DHT's process still lives while it waits
READY_POLL_S = 0.5
#: how long a dead process's own error may take to arrive (it sends it, then exits)
LAST_WORD_S = 1.0
#: the longest a DHT node without a deadline of its own (the coordinator's) may take to be ready
READY_S = 120.0
#: how much longer than its deadline a start may take (ending a process that was not ready) before ``started`` gives up
BACKSTOP_S = 10.0


class DhtDied(RuntimeError):
    """The DHT's process exited before it was ready."""


class DhtNotReady(RuntimeError):
    """The DHT's process was not ready by the deadline (it and its p2p daemon are ended)."""


def start_dht(timeout: float = READY_S, **kwargs: Any) -> hivemind.DHT:
    """``hivemind.DHT(**kwargs, start=True)``; raises :class:`DhtDied` (one line) where
    its process exits before it is ready (or the error it sent before it exited), and
    :class:`DhtNotReady` where it is not ready within ``timeout`` seconds. Blocks: run it
    on a worker thread from an event loop."""
    deadline = time.monotonic() + timeout
    dht = hivemind.DHT(**kwargs, start=False)
    dht.start()
    while True:
        alive = dht.is_alive()  # dead: one last wait, for the error it may have sent
        try:
            dht.wait_until_ready(min(READY_POLL_S, max(deadline - time.monotonic(), 0.0)) if alive else LAST_WORD_S)
            return dht
        except NotYet:
            if not alive:
                raise DhtDied(f"the DHT's process exited (code {dht.exitcode}) before it was ready") from None
            if time.monotonic() >= deadline:
                _end(dht)
                raise DhtNotReady(f"the DHT's process was not ready within {timeout:.0f} s") from None


def _end(dht: hivemind.DHT) -> None:
    """Kill a DHT node's process and what it started (its p2p daemon), stopped first so
    that it starts nothing after its children were listed."""
    try:
        os.kill(dht.pid, signal.SIGSTOP)
        below = psutil.Process(dht.pid).children(recursive=True)
    except (OSError, psutil.Error):
        below = []
    for proc in below:
        try:
            proc.kill()
        except psutil.Error:
            pass
    dht.kill()
    dht.join(LAST_WORD_S)


async def started(start: Callable[[], hivemind.DHT], timeout: float) -> hivemind.DHT:
    """``start`` (a :func:`start_dht` with ``timeout``) on a worker thread, awaited at
    most ``BACKSTOP_S`` past ``timeout``: DhtNotReady also where the start itself stays
    (the constructor waiting on a lock in this process)."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, start), timeout + BACKSTOP_S)
    except asyncio.TimeoutError:
        raise DhtNotReady(f"starting the DHT node took over {timeout + BACKSTOP_S:.0f} s") from None
