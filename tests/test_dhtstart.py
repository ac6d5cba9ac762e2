"""A DHT node whose process dies before it is ready is an error, not a wait without end."""

from __future__ import annotations

import os
import time

import hivemind
import psutil
import pytest

from protocol.net.dhtstart import DhtDied, DhtNotReady, start_dht


def test_a_dht_whose_process_dies_before_it_is_ready_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind's own start waits for its forked process's ready signal with no timeout:
    a process killed first (or that exits) left the command silent for good."""
    monkeypatch.setattr(hivemind.DHT, "run", lambda self: os._exit(3))  # the forked process, before ready
    start = time.monotonic()
    with pytest.raises(DhtDied, match=r"the DHT's process exited \(code 3\) before it was ready"):
        start_dht()
    assert time.monotonic() - start < 10


def test_a_dht_not_ready_by_its_deadline_is_an_error_and_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DHT process that lives but never becomes ready (CI: one waiting for good on a
    lock a killed process held) is ended at the deadline, not waited for."""
    monkeypatch.setattr(hivemind.DHT, "run", lambda self: time.sleep(600))  # the forked process: stuck
    before = {p.pid for p in psutil.Process().children()}
    start = time.monotonic()
    with pytest.raises(DhtNotReady, match=r"the DHT's process was not ready within 2 s"):
        start_dht(2.0)
    assert 2.0 <= time.monotonic() - start < 10
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == []


def test_a_dht_that_starts_is_returned_ready() -> None:
    dht = start_dht()
    try:
        assert dht.is_alive() and dht.get_visible_maddrs()
    finally:
        dht.shutdown()
