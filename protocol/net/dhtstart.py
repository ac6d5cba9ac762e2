"""A hivemind DHT node started so that its process dying before it is ready is an
error, not a wait without end: ``hivemind.DHT(start=True)`` waits for the ready
signal of the process it forks with no timeout, and a process killed first (CI saw
three commands in a row print nothing for minutes, likeliest after such a kill)
never sends one."""

from __future__ import annotations

from concurrent.futures import TimeoutError as NotYet  # the builtin one only from Python 3.11
from typing import Any

import hivemind

#: how often the start looks whether the DHT's process still lives while it waits
READY_POLL_S = 0.5
#: how long a dead process's own error may take to arrive (it sends it, then exits)
LAST_WORD_S = 1.0


class DhtDied(RuntimeError):
    """The DHT's process exited before it was ready."""


def start_dht(**kwargs: Any) -> hivemind.DHT:
    """``hivemind.DHT(**kwargs, start=True)``; raises :class:`DhtDied` (one line) where
    its process exits before it is ready (or the error it sent before it exited).
    Blocks: run it on a worker thread from an event loop."""
    dht = hivemind.DHT(**kwargs, start=False)
    dht.start()
    while True:
        alive = dht.is_alive()  # dead: one last wait, for the error it may have sent
        try:
            dht.wait_until_ready(READY_POLL_S if alive else LAST_WORD_S)
            return dht
        except NotYet:
            if not alive:
                raise DhtDied(f"the DHT's process exited (code {dht.exitcode}) before it was ready") from None
