"""A DHT node whose process dies before it is ready is an error, not a wait without end."""

from __future__ import annotations

import os
import time

import hivemind
import pytest

from protocol.net.dhtstart import DhtDied, start_dht


def test_a_dht_whose_process_dies_before_it_is_ready_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind's own start waits for its forked process's ready signal with no timeout:
    a process killed first (or that exits) left the command silent for good."""
    monkeypatch.setattr(hivemind.DHT, "run", lambda self: os._exit(3))  # the forked process, before ready
    start = time.monotonic()
    with pytest.raises(DhtDied, match=r"the DHT's process exited \(code 3\) before it was ready"):
        start_dht()
    assert time.monotonic() - start < 10


def test_a_dht_that_starts_is_returned_ready() -> None:
    dht = start_dht()
    try:
        assert dht.is_alive() and dht.get_visible_maddrs()
    finally:
        dht.shutdown()
