"""A hivemind DHT node started so that its process dying before it is ready is an
error, not a wait without end: ``hivemind.DHT(start=True)`` waits for the ready
signal of the process it forks with no timeout, and a process killed first (CI saw
three commands in a row print nothing for minutes, likeliest after such a kill)
never sends one."""

from __future__ import annotations

from typing import Any

import hivemind

#: how often the start looks whether the DHT's process still lives while it waits
READY_POLL_S = 0.5


class DhtDied(RuntimeError):
    """The DHT's process exited before it was ready."""


def start_dht(**kwargs: Any) -> hivemind.DHT:
    """``hivemind.DHT(**kwargs, start=True)``; raises :class:`DhtDied` (one line) where
    its process exits before it is ready. Blocks: run it on a worker thread from a loop."""
    dht = hivemind.DHT(**kwargs, start=False)
    dht.start()
    while True:
        try:
            dht.wait_until_ready(READY_POLL_S)
            return dht
        except TimeoutError:
            if not dht.is_alive():
                raise DhtDied(f"the DHT's process exited (code {dht.exitcode}) before it was ready") from None
