"""An outsider that floods a coordinator (issue 14), and the measurement of what
the flood costs a training swarm.

``python -m tests.flooder --initial-peers MADDR [--run RUN] [--frames N]
[--min-seconds S] [--mode wrong_run|unadmitted] [--go-file F]`` starts a fresh
hivemind P2P node with an identity of its own that was never admitted (with
``--go-file``: prints ``ready`` and waits until that file exists), and sends the
coordinator at least N small signed frames (of another run, or of this run from
a sender nobody admitted) as fast as it can, for at least S seconds, reopening
a stream whenever one is closed on it (or held unread for a second), but for
``MAX_FLOOD_S`` at most. It prints
``flooding`` when its first stream is open and one JSON line when done: frames
sent, seconds, streams opened and refused; then it stays up ``--linger`` seconds.

:func:`measure_flood` runs a loopback swarm, trains, and compares the steps per
second of windows during floods with those of the windows without flood around
them (:class:`FloodTarget` is that swarm); :func:`flood_ratios` gives a benchmark its two
numbers, a burst and a sustained flood measured on one swarm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

#: the frames of one flood, and how long it lasts at least
FRAMES = 100_000
FLOOD_S = 8.0
#: a flood ends after this long even if not all its frames got through (within one mute)
MAX_FLOOD_S = 45.0
_STEP = re.compile(r"\|\s*(\d+)/\d+ \[")
T = TypeVar("T")


async def flood(
    maddrs: list[str],
    run_id: str,
    frames: int,
    min_seconds: float,
    mode: str,
    workers: int,
    linger: float = 0.0,
    go_file: str = "",
    max_seconds: float = MAX_FLOOD_S,
) -> None:
    from hivemind.p2p import P2P, PeerID

    from protocol.net.addrs import peer_id_of
    from protocol.net.transport import MSG_PROTOCOL
    from protocol.trust.identity import Identity
    from protocol.wire.envelope import Sealer
    from protocol.wire.messages import Beat

    target = peer_id_of(maddrs[0])
    assert target is not None, f"no /p2p/ peer id in {maddrs[0]}"
    p2p = await P2P.create(initial_peers=maddrs)
    sealer = Sealer(Identity.generate(), p2p.peer_id.to_base58())
    run = "elsewhere" if mode == "wrong_run" else run_id
    batch = [sealer.seal(Beat(run, step), [], [])[0] for step in range(100)]
    pid = PeerID.from_base58(target)
    tally = {"sent": 0, "streams": 0, "refused": 0}
    if go_file:
        print("ready", flush=True)
        while not os.path.exists(go_file):
            await asyncio.sleep(0.01)
    start = time.monotonic()

    def done() -> bool:
        took = time.monotonic() - start
        return (tally["sent"] >= frames and took >= min_seconds) or took >= max_seconds

    async def worker() -> None:
        while not done():
            try:
                _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(pid, MSG_PROTOCOL), 10)
            except Exception:
                tally["refused"] += 1
                await asyncio.sleep(0.01)
                continue
            if tally["streams"] == 0:
                print("flooding", flush=True)
            tally["streams"] += 1
            try:
                while not done() and not reader.at_eof():
                    writer.writelines(batch)
                    await asyncio.wait_for(writer.drain(), 1.0)  # a stream held unread: open another
                    tally["sent"] += len(batch)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(worker() for _ in range(workers)))
    seconds = time.monotonic() - start
    out = {**tally, "seconds": round(seconds, 2), "frames_per_s": round(tally["sent"] / seconds)}
    print(json.dumps(out), flush=True)
    await asyncio.sleep(linger)  # still counted as the test's own processes
    await p2p.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peers", nargs="+", required=True)
    ap.add_argument("--run", default="fusionllm")
    ap.add_argument("--coordinator-key", default=None)  # as printed in the join command; unused
    ap.add_argument("--frames", type=int, default=FRAMES)
    ap.add_argument("--min-seconds", type=float, default=0.0)
    ap.add_argument("--mode", choices=("wrong_run", "unadmitted"), default="wrong_run")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cpus", default="", help="run on these CPUs only, e.g. 1 or 2,3")
    ap.add_argument("--linger", type=float, default=0.0, help="seconds to stay up after the flood")
    ap.add_argument("--go-file", default="", help="print 'ready', then start once this file exists")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # the p2p daemon inherits it
    a = args
    asyncio.run(flood(a.initial_peers, a.run, a.frames, a.min_seconds, a.mode, a.workers, a.linger, a.go_file))


# ---------------------------------------------------------------- measurement
#: CPU-seconds per second that the machine may spend on anything but this process and
#: its descendants in a window (another job on the machine) before the windows are
#: measured again, at most ATTEMPTS times in all
OTHERS_MAX = 0.15
ATTEMPTS = 3
#: floods measured in one attempt, each by a flooder of its own, each window between two
#: clean ones: the swarm's own speed varies by 10-20% from second to second here, with
#: its CPU use the same; one 8 s window against its neighbours failed 0.9 about 1 run in 4
ROUNDS = 3
#: the benchmark's floods per attempt: the flood itself costs the swarm's CPU 1-3% (the
#: coordinator's p2p daemon and process, counted per process), yet three rounds' ratio
#: came out 0.87-0.95 in four runs: drift of the swarm's own speed, which eight rounds cut by about 1.6x
BENCH_ROUNDS = 8


@dataclass
class FloodResult:
    clean_steps_per_s: float  # each flood window's baseline (the mean of its two neighbours), averaged
    flood_steps_per_s: float  # the flood windows' rates, averaged
    flood: dict[str, Any]  # the last flooder's own tally
    state: dict[str, Any]  # /api/v1/state after the floods
    output: str  # the coordinator's output
    window_s: float  # the flood windows' mean length
    others: tuple[float, float]  # CPU-seconds per second other processes used (clean windows, flood windows)
    attempts: int  # attempts made (each with ``rounds`` flooders of its own)
    tries: list[tuple[float, float, float]]  # each attempt's (ratio, others' CPUs in clean and flood windows)
    rounds: int = 1  # flood windows per attempt
    cpus: str = ""  # how the CPUs were split, if they were

    @property
    def ratio(self) -> float:
        return self.flood_steps_per_s / self.clean_steps_per_s

    @property
    def flooders(self) -> int:
        """Flooders started in all (each a new identity, muted once)."""
        return self.attempts * self.rounds

    def __str__(self) -> str:
        return (
            f"{self.clean_steps_per_s:.1f} steps/s without flood, {self.flood_steps_per_s:.1f} with "
            f"(ratio {self.ratio:.3f}; {self.rounds} floods; {self.window_s:.1f} s windows; "
            f"{self.cpus or 'CPUs shared'}; other processes used {self.others[0]:.2f} and {self.others[1]:.2f} "
            f"CPUs; attempts {self.tries}); last flooder: {self.flood}"
        )


def steps_at(lines: list[str], times: list[float], t: float) -> int:
    """Steps done by time ``t``, from the coordinator's progress lines and when they were read."""
    done = 0
    for line, at in zip(lines, times, strict=False):
        if at > t:
            break
        m = _STEP.search(line)
        if m:
            done = max(done, int(m.group(1)))
    return done


def _cpu() -> tuple[float, dict[int, float]]:
    """CPU-seconds so far: the machine's busy time, and each of this process and its
    descendants."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    me = psutil.Process()
    ours = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            c = p.cpu_times()
        except psutil.Error:
            continue
        ours[p.pid] = c.user + c.system
    return busy, ours


class _Window:
    """A span of time: steps done in it, and the CPU the rest of the machine used."""

    def __init__(self) -> None:
        self.start, self.cpu = time.monotonic(), _cpu()

    def end(self, at: float | None = None) -> None:
        self.stop = at if at is not None else time.monotonic()
        time.sleep(max(0.0, self.stop + 0.2 - time.monotonic()))  # its last progress lines
        busy, ours = _cpu()
        mine = sum(v - self.cpu[1].get(pid, 0.0) for pid, v in ours.items())
        self.others = max(0.0, busy - self.cpu[0] - mine) / (time.monotonic() - self.start)

    def rate(self, lines: list[str], times: list[float]) -> float:
        return (steps_at(lines, times, self.stop) - steps_at(lines, times, self.start)) / (self.stop - self.start)


def _clean(seconds: float) -> _Window:
    window = _Window()
    time.sleep(seconds)
    window.end()
    return window


def _flooded(flooder: Any, go: Path, seconds: float, frames: int) -> tuple[_Window, dict[str, Any]]:
    """The window from the start of ``flooder``'s flood: ``seconds``, or as long as it lasts."""
    go.touch()
    window = _Window()
    tally = json.loads(flooder.wait_line(r"^\{.*\}$", 120 + seconds + frames / 1000).group(0))
    time.sleep(max(0.0, window.start + seconds - time.monotonic()))
    window.end(max(flooder.last_time, window.start + seconds))
    return window, tally


#: clean windows, flood windows, and the last flooder's tally
Windows = tuple[list[_Window], list[_Window], dict[str, Any]]


def _windows(swarm: Any, flood_args: list[str], tmp: Path, seconds: float, rounds: int, frames: int) -> Windows:
    """Clean, flood, clean, ... flood, clean windows back to back, with every flooder's
    process up (each waits for its go file) in all of them: (clean, flood windows,
    the last flooder's tally)."""
    from tests.swarmproc import Proc

    tag = len(list(tmp.glob("go-*")))
    goes = [tmp / f"go-{tag + i}" for i in range(rounds)]
    flooders = []
    for go in goes:
        flooders.append(Proc(*swarm.join_args, *flood_args, "--go-file", str(go), module="tests.flooder"))
        swarm.procs.append(flooders[-1])
    for f in flooders:
        f.wait_line(r"^ready$", 60)
    cleans, floods = [_clean(seconds)], []
    tally: dict[str, Any] = {}
    for flooder, go in zip(flooders, goes, strict=True):
        window, tally = _flooded(flooder, go, seconds, frames)
        floods.append(window)
        cleans.append(_clean(seconds))
    for f in flooders:
        f.kill_all()
    return cleans, floods, tally


def measure_flood(
    tmp: Path,
    frames: int = FRAMES,
    seconds: float = FLOOD_S,
    split_cpus: bool = True,
    mode: str = "wrong_run",
    sustained: bool = False,
    attempts: int = ATTEMPTS,
    rounds: int = ROUNDS,
) -> FloodResult:
    """Train a 2-peer loopback swarm and measure its steps per second in windows back
    to back: ``seconds`` without flood, then ``rounds`` times over as long from the
    start of a flood of ``frames`` frames, sent as fast as an outsider can (or longer,
    if the flood lasts longer; with ``sustained``, the outsider goes on flooding for
    the whole window) followed by ``seconds`` without flood again. Each flood comes
    from a flooder of its own (a fresh identity), whose process is up in all windows.
    Each flood window's baseline is the mean of its two neighbours, so a drift of the
    swarm's own speed (on this KVM machine, 10-15% within half a minute, flood or
    not) is not counted as the flood's. Spot checks are off: their random
    re-executions would add noise that is not the flood's. With ``split_cpus`` (and
    at least 2 CPUs) the swarm runs on every CPU but the last and the flooders on the
    last: the attacker's own CPU time is not the victim's cost (a real one floods
    from its own machine). When other processes on the machine used more than
    ``OTHERS_MAX`` CPUs in a window, the windows are measured again with new
    flooders, ``attempts`` times in all."""
    target = FloodTarget(tmp, split_cpus)
    try:
        return target.measure(frames, seconds, mode, sustained, attempts, rounds)
    finally:
        target.close()


class FloodTarget:
    """The training swarm that floods are measured against (see :func:`measure_flood`):
    started on construction, trained past its warm-up, measured by :meth:`measure` as
    often as asked (each time with flooders of its own), ended by :meth:`close`."""

    def __init__(self, tmp: Path, split_cpus: bool = True) -> None:
        from tests.swarmproc import SMALL, Swarm, join_together, wait_for

        self.tmp = tmp
        cpus = sorted(os.sched_getaffinity(0))
        self.swarm_cpus, self.flood_cpus = cpus, cpus
        if split_cpus and len(cpus) >= 2:
            self.swarm_cpus, self.flood_cpus = cpus[:-1], cpus[-1:]
        os.sched_setaffinity(0, set(self.swarm_cpus))  # the swarm's processes inherit it
        try:
            training = ["--steps", "100000", "--seed", "0", *SMALL, "--min-peers", "2"]
            # no rebalancing either: a move (on by default) would change the speed being compared
            quiet = ["--checkpoint-every", "0", "--step-timeout", "60", "--spot-check", "0", "--rebalance-every", "0"]
            self.swarm = Swarm(tmp, [*training, *quiet, "--run-dir", str(tmp / "run")], peers=0)
            try:
                join_together(self.swarm, [[], []])  # the two peers' start-ups overlap
            except BaseException:
                self.close()
                raise
        finally:
            os.sched_setaffinity(0, set(cpus))
        self.split = f"swarm on CPUs {self.swarm_cpus}, flooder on {self.flood_cpus}" if self.flood_cpus != cpus else ""
        self.cpu_arg = ["--cpus", ",".join(map(str, self.flood_cpus))] if self.flood_cpus != cpus else []
        try:
            wait_for(self.swarm.url, lambda s: s["training"]["step"] >= 20, timeout=120)
            time.sleep(1.0)  # past the first steps' warm-up
        except BaseException:
            self.close()
            raise

    def measure(
        self, frames: int, seconds: float, mode: str, sustained: bool, attempts: int, rounds: int
    ) -> FloodResult:
        from tests.swarmproc import api

        coord = self.swarm.coord
        linger = (2 * rounds + 1) * seconds + 5
        lasting = ["--min-seconds", str(seconds if sustained else 0), "--linger", str(linger)]
        flood_args = ["--frames", str(frames), "--mode", mode, *lasting, *self.cpu_arg]
        tries: list[tuple[float, float, float]] = []
        while True:
            cleans, floods, tally = _windows(self.swarm, flood_args, self.tmp, seconds, rounds, frames)
            lines, times = list(coord.lines), list(coord.times)
            base = [(a.rate(lines, times) + b.rate(lines, times)) / 2 for a, b in zip(cleans, cleans[1:])]
            flooded = [w.rate(lines, times) for w in floods]
            clean_rate, flood_rate = sum(base) / rounds, sum(flooded) / rounds
            others = (max(w.others for w in cleans), max(w.others for w in floods))
            tries.append((round(flood_rate / clean_rate, 3), round(others[0], 2), round(others[1], 2)))
            if max(others) <= OTHERS_MAX or len(tries) >= attempts:
                break
        state = api(self.swarm.url)
        assert coord.popen.poll() is None, coord.output[-3000:]
        window_s = sum(w.stop - w.start for w in floods) / rounds
        return FloodResult(
            clean_rate, flood_rate, tally, state, coord.output, window_s, others, len(tries), tries, rounds, self.split
        )

    def close(self) -> None:
        self.swarm.close()


def on_own_target(measure: Callable[[FloodTarget], T]) -> T:
    """What ``measure`` returns on a :class:`FloodTarget` of its own (in a temporary
    directory), closed after."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        target = FloodTarget(Path(tmp))
        try:
            return measure(target)
        finally:
            target.close()


def flood_ratios(short: bool, target: FloodTarget | None = None) -> tuple[float, float]:
    """Training throughput during a flood of ``FRAMES`` frames over throughput without,
    and the same while the outsider floods for the whole window (not only ``FRAMES``
    frames), measured on one swarm (``target``, or one of its own): the goal is >= 0.9
    for both (``short``: one flood each, 2-second windows instead of 8 (a flood's own
    lasts as long as the flood), measured once however busy the machine is)."""
    seconds, attempts, rounds = (FLOOD_S / 4, 1, 1) if short else (FLOOD_S, ATTEMPTS, BENCH_ROUNDS)
    if target is None:
        return on_own_target(lambda own: flood_ratios(short, own))
    burst = target.measure(FRAMES, seconds, "wrong_run", False, attempts, rounds)
    sustained = target.measure(FRAMES, seconds, "wrong_run", True, attempts, rounds)
    return burst.ratio, sustained.ratio


if __name__ == "__main__":
    sys.exit(main())
