"""``join --throttle``: the pause math, the throttle file, the command line, and a
throttled compute call of a real stage executor."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from fusionllm.cli import build_parser
from peer import bench
from peer.bench import measure_flops
from peer.compute import INLINE_MAX_S, Compute
from peer.config import PeerConfig
from peer.executor import StageExecutor
from peer.node import PeerNode
from peer.throttle import Throttle, ThrottleError, check_throttle, parse_throttle
from protocol.model.recipe import Recipe
from tests.conftest import run_cli

# ------------------------------------------------------------------ the pause


@pytest.mark.parametrize(("f", "compute_s", "pause"), [(1.0, 0.2, 0.0), (0.5, 0.2, 0.2), (0.25, 0.1, 0.3)])
def test_pause_is_one_over_f_minus_one_times_the_compute(f: float, compute_s: float, pause: float) -> None:
    t = Throttle(f)
    assert t.pause_for(compute_s) == pytest.approx(pause)
    assert (compute_s + t.pause_for(compute_s)) * f == pytest.approx(compute_s)


@pytest.mark.parametrize(
    ("f", "compute_s", "work_s", "pause"),
    [(0.25, 0.2, 0.1, 0.2), (0.25, 0.2, 0.05, 0.0), (0.5, 0.2, 0.3, 0.2), (0.5, 0.2, 0.0, 0.0), (1.0, 0.2, 0.1, 0.0)],
)
def test_pause_counts_the_work_not_the_wait_for_a_core(f: float, compute_s: float, work_s: float, pause: float) -> None:
    """A call that waited for a core (wall 0.2 s, 0.1 s of CPU) lasts work / F in all,
    not 1/F times its wait too; work above the wall time counts as the wall time."""
    assert Throttle(f).pause_for(compute_s, work_s) == pytest.approx(pause)


@pytest.mark.parametrize(
    ("work_s", "call_s", "pause"),
    [(0.1, 0.02, 0.24), (0.01, 0.02, 0.0), (0.1, 0.0, 0.3), (0.1, -1.0, 0.3), (0.1, math.nan, 0.3)],
)
def test_a_calls_own_work_is_not_stretched(work_s: float, call_s: float, pause: float) -> None:
    """``join --throttle-call-ms``: at F = 0.25 a call of 0.1 s of work, 0.02 of it its
    own (Python, the graph), lasts 0.02 + 0.08 / 0.25 in all; a call no longer than its
    own work is not stretched; a bad or absent figure stretches all of it."""
    assert Throttle(0.25, call_s=call_s).pause_for(work_s, work_s) == pytest.approx(pause)


def test_no_pause_for_no_compute() -> None:
    t = Throttle(0.1)
    assert t.pause_for(0.0) == 0.0 and t.pause_for(-1.0) == 0.0 and t.pause_for(math.nan) == 0.0


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.0000001, 2.0, math.inf, -math.inf, math.nan])
def test_out_of_range_throttles_are_refused(bad: float) -> None:
    with pytest.raises(ThrottleError, match=r"is not a number in \(0, 1\]"):
        check_throttle(bad)
    with pytest.raises(ThrottleError):
        Throttle(bad)
    with pytest.raises(ThrottleError):
        PeerNode(PeerConfig(initial_peers=[], throttle=bad))


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "abc", "inf", "nan", "", "0.5x", "1e-400"])
def test_bad_throttle_text_gives_a_one_line_error(text: str) -> None:
    with pytest.raises(ThrottleError) as err:
        parse_throttle(text)
    assert "\n" not in str(err.value) and "(0, 1]" in str(err.value)


def test_set_tells_each_change_once() -> None:
    told: list[str] = []
    t = Throttle(1.0, on_change=told.append)
    assert t.set(0.25, "here") and not t.set(0.25, "here")
    assert t.value == 0.25 and told == ["throttle: 0.25 (from here)"]


def test_peer_node_owns_the_configured_throttle() -> None:
    node = PeerNode(PeerConfig(initial_peers=[], throttle=0.5, throttle_file="/nowhere", throttle_call_s=0.002))
    try:
        assert node.throttle.value == 0.5 and node.throttle.call_s == 0.002
        told: list[str] = []
        node.on_event = told.append
        node.throttle.set(0.75, "f")
        assert told == ["throttle: 0.75 (from f)"]
    finally:
        asyncio.run(node.aclose())


# ------------------------------------------------------------------ the throttle file


def test_file_changes_are_taken_and_announced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "throttle"
    told: list[str] = []
    t = Throttle(0.5, on_change=told.append)
    with caplog.at_level(logging.INFO, logger="peer.throttle"):
        assert not t.poll(str(path))  # absent: keeps the value, says nothing
        path.write_text("0.25\n")
        assert t.poll(str(path)) and t.value == 0.25
        assert not t.poll(str(path))  # unchanged: told once
        path.write_text("1")
        assert t.poll(str(path)) and t.value == 1.0
    assert told == [f"throttle: 0.25 (from {path})", f"throttle: 1 (from {path})"]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == told
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_bad_contents_keep_the_value_and_warn_once_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "throttle"
    t = Throttle(0.5)
    with caplog.at_level(logging.INFO, logger="peer.throttle"):
        for content in ["fast", "fast", "0", "0", "2", " \n", "0." + "5" * 100, "fast"]:
            path.write_text(content)
            assert not t.poll(str(path)) and t.value == 0.5
        path.unlink()
        assert not t.poll(str(path)) and t.value == 0.5
        path.write_text("0.3")
        assert t.poll(str(path)) and t.value == 0.3
        path.write_text("fast")
        assert not t.poll(str(path)) and t.value == 0.3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one per distinct bad content in a row; an empty file is one being written (no warning)
    assert len(warnings) == 6, warnings
    assert "'fast' is not a number in (0, 1]; keeping 0.5" in warnings[0]
    assert "more than 64 bytes" in warnings[3] and "keeping 0.3" in warnings[5]
    assert all("\n" not in w for w in warnings)


def test_an_unreadable_file_keeps_the_value(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = Throttle(0.5)
    with caplog.at_level(logging.WARNING, logger="peer.throttle"):
        assert not t.poll(str(tmp_path)) and not t.poll(str(tmp_path))  # a directory
    assert t.value == 0.5
    assert len(caplog.records) == 1 and "unreadable" in caplog.records[0].getMessage()


def test_watch_picks_up_changes_within_two_seconds(tmp_path: Path) -> None:
    path = tmp_path / "throttle"

    async def until(t: Throttle, value: float, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if t.value == value:
                return True
            await asyncio.sleep(0.01)
        return False

    async def main() -> None:
        told: list[str] = []
        t = Throttle(1.0, on_change=told.append)
        watcher = asyncio.create_task(t.watch(str(path), interval=0.05))
        try:
            await asyncio.sleep(0.1)  # absent for a few reads
            assert t.value == 1.0
            path.write_text("0.4")
            assert await until(t, 0.4, time.monotonic() + 2.0)
            path.write_text("garbage")
            await asyncio.sleep(0.2)
            path.write_text("0.8")
            assert await until(t, 0.8, time.monotonic() + 2.0)
            assert told == [f"throttle: 0.4 (from {path})", f"throttle: 0.8 (from {path})"]
        finally:
            watcher.cancel()

    asyncio.run(main())


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "fast", "inf", "nan"])
def test_join_rejects_a_bad_throttle(value: str) -> None:
    r = run_cli("join", "--initial-peers", "/ip4/127.0.0.1/tcp/9", "--throttle", value, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--throttle" in lines[0] and "(0, 1]" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_join_parses_the_throttle_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["join", "--initial-peers", "/ip4/127.0.0.1/tcp/9"])
    assert args.throttle == 1.0 and args.throttle_file is None
    args = parser.parse_args(
        ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/9", "--throttle", "0.25", "--throttle-file", "/tmp/t"]
    )
    assert args.throttle == 0.25 and args.throttle_file == "/tmp/t"


# ------------------------------------------------------------------ throttled compute


def test_a_throttled_compute_call_idles_on_the_loop_with_the_thread_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # wall time is the work (as on several threads)
    torch.manual_seed(0)
    ex = StageExecutor(_Stage(), Recipe(lr=1e-3), False)
    x = torch.randn(2048, 256)
    f = 0.25

    async def main() -> None:
        compute = Compute(torch.device("cpu"), Throttle(f))
        try:
            computed = threading.Event()
            took: list[float] = []
            ticks = 0

            async def ticker() -> None:  # stands for heartbeats and messages: the loop must stay free
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.002)
                    ticks += 1

            tick = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            call = asyncio.create_task(compute.throttled(_flagged, computed, took, ex.forward, 0, [x]))
            deadline = time.monotonic() + 10
            while not computed.is_set() and time.monotonic() < deadline:  # the compute thread is done
                await asyncio.sleep(0.001)
            ticks_then = ticks
            t1 = time.perf_counter()
            await compute.run(_no_op)  # the thread takes other work while the call idles
            no_op_s = time.perf_counter() - t1
            idling = not call.done()
            out, busy_s = await call
            wall = time.perf_counter() - t0
            tick.cancel()
        finally:
            compute.shutdown()

        compute_s = took[0]  # as the compute thread measured it
        pause_s = busy_s - compute_s
        assert out[0].shape == (2048, 256)
        assert compute_s > 0.01, compute_s  # a real compute call of some milliseconds
        # the pause is (1/F - 1) times the call, and both count as busy (StepDone.compute_s)
        assert pause_s == pytest.approx(compute_s * (1 / f - 1), rel=0.1, abs=0.005)
        assert wall >= busy_s - 0.005  # the pause was slept, not just counted
        assert idling and no_op_s < pause_s, (no_op_s, pause_s)
        assert ticks > ticks_then  # the loop ran during the pause

    asyncio.run(main())


class _Stage(nn.Module):
    """A middle stage: its outputs are a tuple, as a split graph's are."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.mlp(x),)


def _flagged(done: threading.Event, took: list[float], fn: Any, *args: Any) -> Any:
    t0 = time.perf_counter()
    out = fn(*args)
    took.append(time.perf_counter() - t0)
    done.set()
    return out


def _no_op() -> None:
    return None


def test_one_threads_reading_is_its_speed_while_it_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-thread CPU peer that got half a core while it measured (its thread's CPU
    clock ticks half as fast as the wall clock) reads the speed of a whole one: by wall
    time the demo's four peers, measuring at once, read 14 to 87 GFLOP/s. With more
    threads the wall time is the divisor."""
    now = [0.0]

    def wall() -> float:
        now[0] += 0.125  # exact in binary, as above
        return now[0]

    fake = SimpleNamespace(perf_counter=wall, thread_time=lambda: now[0] / 2)
    monkeypatch.setattr(bench, "time", fake)
    device = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    by_wall = measure_flops(device, seconds=1.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert measure_flops(device, seconds=1.0) == pytest.approx(2 * by_wall)


def test_a_one_thread_cpu_peer_is_throttled_by_its_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-thread CPU peer that waits (here: sleeps, as for a busy machine's core)
    does not idle 1/F times the wait: the call lasts its CPU time over F."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    f = 0.25

    def waits() -> float:
        time.sleep(0.05)
        return time.thread_time()

    def works() -> float:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return 0.0

    throttle = Throttle(f)
    pauses: list[float] = []
    real = throttle.pause_for
    monkeypatch.setattr(throttle, "pause_for", lambda *a: pauses.append(real(*a)) or pauses[-1])

    async def main() -> tuple[float, float]:
        compute = Compute(torch.device("cpu"), throttle)
        try:
            (_, waited), (_, worked) = await compute.throttled(waits), await compute.throttled(works)
        finally:
            compute.shutdown()
        return waited, worked

    waited, worked = asyncio.run(main())
    assert pauses[0] < 0.01, pauses  # 0.05 s slept, next to no CPU: (almost) no pause, not 3 x 0.05 s
    assert waited >= 0.05 and worked >= 0.02 / f - 0.002, (waited, worked)  # 0.02 s of CPU lasts 0.08 s


def test_the_benchmark_under_throttle_half_reports_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that ticks the same for every call (a shared machine's load would
    drown a real-time comparison), throttle F scales the measured FLOP/s by F."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.125  # exact in binary: every run sees the same ticks
        return now[0]

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock, thread_time=clock))
    device = torch.device("cpu")
    full = measure_flops(device, seconds=1.0)
    assert measure_flops(device, seconds=1.0, throttle=0.5) == pytest.approx(0.5 * full)
    assert measure_flops(device, seconds=1.0, throttle=0.1) == pytest.approx(0.1 * full)


def test_short_stage_pieces_run_on_the_loop_long_ones_and_spot_checks_on_the_thread() -> None:
    """A kind of piece runs on the event loop once it measured under ``INLINE_MAX_S``;
    one that took longer, and anything handed in while the thread is busy (a spot
    check), runs on the thread, in the order the calls came."""

    def where() -> int:
        return threading.get_ident()

    def slow(tag: str) -> int:
        order.append(tag)
        end = time.perf_counter() + INLINE_MAX_S * 2
        while time.perf_counter() < end:  # working, not waiting: long by its CPU time too
            pass
        return threading.get_ident()

    order: list[str] = []

    async def main() -> None:
        compute = Compute(torch.device("cpu"), Throttle())
        here = threading.get_ident()
        try:
            first, _ = await compute.timed(where, inline="forward")
            assert first != here, "a kind of piece not measured yet runs on the thread"
            again, _ = await compute.timed(where, inline="forward")
            assert again == here, "a short piece runs on the loop"
            assert (await compute.timed(slow, "long", inline="backward"))[0] != here
            assert (await compute.timed(slow, "long again", inline="backward"))[0] != here, "a long one stays off it"
            check = asyncio.ensure_future(compute.timed(slow, "spot check"))
            await asyncio.sleep(0)
            queued, _ = await compute.timed(lambda: (order.append("forward"), where())[1], inline="forward")
            assert queued != here, "with the thread busy, a short piece waits for it there"
            await check
            assert order[-2:] == ["spot check", "forward"]
        finally:
            compute.shutdown()

    asyncio.run(main())


def test_a_piece_held_up_by_a_busy_machine_stays_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU peer computing on one thread, a piece counts as long by its CPU time: one
    that took long only because it waited for a core (here: it sleeps) stays on the
    event loop, where handing it to the thread would cost the hand-off and win nothing."""
    monkeypatch.setattr("peer.compute.one_cpu_thread", lambda device: True)

    def waits() -> int:
        time.sleep(INLINE_MAX_S * 2)
        return threading.get_ident()

    async def main() -> None:
        compute = Compute(torch.device("cpu"), Throttle())
        here = threading.get_ident()
        try:
            assert (await compute.timed(waits, inline="forward"))[0] != here, "not measured yet: on the thread"
            ran, seconds = await compute.timed(waits, inline="forward")
            assert ran == here and seconds >= INLINE_MAX_S * 2, "long on the clock, short in CPU time: on the loop"
        finally:
            compute.shutdown()

    asyncio.run(main())


def test_short_spot_checks_run_on_the_loop_and_an_arbitration_that_may_build_on_the_thread() -> None:
    """A spot check's work goes where the stage's own pieces would (``SpotChecks._timed``):
    on the loop once its kind measured short and the thread is idle, its seconds still
    counted apart, each kind measured apart; one that may build a stage (``kind`` None)
    always on the thread."""
    from peer.spotcheck import SpotChecks

    def verdict() -> int:
        return threading.get_ident()

    async def main() -> None:
        compute = Compute(torch.device("cpu"), Throttle())
        builder = SimpleNamespace(a=None, job=SimpleNamespace(micro_batches=2), num_stages=2, other=None)
        spot = SpotChecks(SimpleNamespace(), "coord", compute, builder)  # type: ignore[arg-type]
        here = threading.get_ident()
        try:
            assert await spot._timed(verdict) != here, "not measured yet: on the thread"
            assert await spot._timed(verdict) == here, "measured short: on the loop"
            assert await spot._timed(verdict, kind=None) != here, "it may build a stage: on the thread"
            assert await spot._timed(verdict) == here
            assert await spot._timed(verdict, kind="verdict:1:load") != here, "another kind: measured apart"
            assert spot.spent() > 0 and spot.spent() == 0, "every call counted as spot-check work, once"
            assert set(compute._last) == {"check:verdict", "check:verdict:1:load"}, "apart from the stage's pieces"
        finally:
            compute.shutdown()

    asyncio.run(main())
