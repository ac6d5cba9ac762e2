"""A DHT node whose process dies before it is ready is an error, not a wait without end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import hivemind
import psutil
import pytest

from protocol.net import dhtstart
from protocol.net.dhtstart import DhtDied, DhtNotReady, start_dht, started


def test_a_dht_whose_process_dies_before_it_is_ready_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind's own start waits for its forked process's ready signal with no timeout:
    a process killed first (or that exits) left the command silent for good."""
    monkeypatch.setattr(hivemind.DHT, "run", lambda self: os._exit(3))  # the forked process, before ready
    start = time.monotonic()
    with pytest.raises(DhtDied, match=r"the DHT's process exited \(code 3\) before it was ready"):
        start_dht()
    assert time.monotonic() - start < 10


def test_a_dht_not_ready_by_its_deadline_is_an_error_and_is_ended(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A DHT process that lives but never becomes ready (CI: one waiting for good on a
    lock a killed process held) is ended at the deadline with what it started (its
    p2p daemon; here a stand-in), not waited for."""
    pids = tmp_path / "pids"

    def stuck(self: hivemind.DHT) -> None:  # the forked process: starts its "daemon", then hangs
        daemon = subprocess.Popen(["sleep", "600"])
        pids.write_text(f"{os.getpid()} {daemon.pid}")
        time.sleep(600)

    monkeypatch.setattr(hivemind.DHT, "run", stuck)
    start = time.monotonic()
    with pytest.raises(DhtNotReady, match=r"the DHT's process was not ready within 2 s"):
        start_dht(2.0)
    assert 2.0 <= time.monotonic() - start < 10
    started = [int(pid) for pid in pids.read_text().split()]  # both had started
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in started)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dht_that_starts_is_returned_ready() -> None:
    dht = start_dht()
    try:
        assert dht.is_alive() and dht.get_visible_maddrs()
    finally:
        dht.shutdown()


def test_a_start_that_itself_stays_past_its_deadline_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor runs in the caller's process and can wait there (on a lock of
    hivemind's): ``started`` gives up ``BACKSTOP_S`` past the deadline."""
    monkeypatch.setattr(dhtstart, "BACKSTOP_S", 0.5)
    with pytest.raises(DhtNotReady, match=r"starting the DHT node took over 1 s"):
        asyncio.run(started(lambda: time.sleep(5), 0.5))  # type: ignore[arg-type,func-returns-value]
