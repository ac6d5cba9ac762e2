"""Swarm throughput against one process, the RAD data path (hivemind libp2p
streams carrying signed FusionLLM frames) against a plain TCP socket, and the
step-time cost of the recipe's global gradient-norm clip and of bf16 against
fp32 (the same swarm, median step times), and the swarm whose stages travel as
programs of ATen operators (the default) against the same swarm rebuilding its
stages from the model's code (``code_*``, ``programs_vs_code``), measured in one
run. Prints one JSON object.

The anchor: the swarm with spot checks off against ``torch.distributed.pipelining``
(``Schedule1F1B``, gloo on loopback, a process of one thread per stage;
``benchmarks/_pipelining.py``) training the same job split at the swarm's own cut,
in the same run: five sets of the two and the default swarm (spot checks at their
default rate), each run 200 steps and the three of a set back to back, the unchecked
swarm between the others (``anchor_pairs``: the machine's load drifts over minutes,
and a short run weighs the swarm's one-time costs as a demo's 1,200 steps do not);
``swarm_vs_pipelining``, the cut, the step breakdown and both sides' median step ms
are the median set's (``swarm_vs_pipelining_runs``: each set's ratio, null where its
anchor failed), ``pipelining_tokens_per_s`` and ``swarm_unchecked_tokens_per_s``
the medians of each side (``pipelining_loss_gap``: the
largest gap between the anchor's loss and the whole model's in one process at any
of the reference's steps, so that both are seen to do the same work); what spot
checks at their default rate cost in tokens/s (``spot_check_cost``: the median of
the sets' 1 - the checked swarm's over the unchecked one's, over the sets whose two
swarms started on the same cut, ``spot_check_cost_sets`` of them (all, where under
half did: ``check_cost``), ``spot_check_cost_runs`` each set's: two runs a minute apart, so a
set's swung from -0.23 to 0.21 in stop 63's runs; until then one 60-step pair, 0.29
in stop 62's run);
``spot_check_cost_in_run``: the median of what the checked swarms' summaries say
their checks cost their steps, from their steps with and without a check under way,
``protocol.trust.spotcheck.step_overhead``; null where the runs had too few of
either); and where the unchecked swarm's step
time goes, per stage (``step_breakdown_ms``: each part's mean ms per step, from the
run's summary).

``--short`` runs the same paths smaller, for the test suite: 2 peers instead of
4, 8 training steps instead of 60 and one set of 8 steps (the checked swarm, the
unchecked one and the anchor on the 2 peers' cut) and 16 MiB messages instead of 64 MiB (still
above the lane threshold, so they travel over parallel streams); the
``*_64mib_*`` keys then hold the 16 MiB figures. The recipes' swarms run at once
there (``recipe_runs``): their ratios then say only that each recipe trains.

RAD against TCP, on the event loop the peers run (uvloop): rounds of one 64 MiB
transfer of each, back to back (in turn RAD first and TCP first), after a round that
opens the streams; each side's median MB/s,
and ``rad_vs_tcp`` the median of the rounds' ratios (``rad_vs_tcp_range``: the
lowest and highest). Measured apart and each side's best kept, as before, the two
sides met different loads on a busy machine: 0.849 in one run, 0.044 in the next.
Both ends of those run in this process; ``*_two_processes`` are the same rounds with
the receiver in a process of its own (``benchmarks/_two_process.py``), as peers are."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import faulthandler
import itertools
import json
import logging
import re
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from p2p import transport_pair  # noqa: E402

from benchmarks import _two_process  # noqa: E402
from benchmarks._pipelining import PipeliningResult, pipelining_run  # noqa: E402
from fusionllm.local import TrainResult, train_reference, train_staged  # noqa: E402
from protocol.model.job import JobSpec  # noqa: E402
from protocol.net.transport import Transport  # noqa: E402
from protocol.wire.messages import Activations  # noqa: E402
from tests.conftest import demo_output  # noqa: E402
from tests.swarmproc import summary_tokens_per_s  # noqa: E402

logger = logging.getLogger("benchmarks.pipeline")
T = TypeVar("T")


@dataclass(frozen=True)
class Sizes:
    steps: int
    message: int  # bytes per RAD / TCP transfer
    repeats: int  # timed transfers (after one that opens the stream)
    peers: int = 4
    anchor_steps: int = 200  # steps of each run of a pair set against the anchor
    pairs: int = 5  # sets of an unchecked swarm, the anchor and a checked swarm, back to back


FULL = Sizes(steps=60, message=64 << 20, repeats=9)
SHORT = Sizes(steps=8, message=16 << 20, repeats=3, peers=2, anchor_steps=8, pairs=1)
#: how long the RAD and TCP transfers may take together (a hang leaves the rest their time)
TRANSFERS_TIMEOUT_S = 60.0


#: the recipes whose step time is set against plain fp32
RECIPES = {"fp32": [], "clip": ["--clip-grad-norm", "1.0"], "bf16": ["--precision", "bf16"]}
#: the same fp32 swarm with its stages rebuilt from the model's code, as before stages travelled as programs
CODE = ["--stages-as", "code"]
#: the fp32 swarm with spot checks off: what the anchor compares with pipelining
UNCHECKED = ["--spot-check", "0"]


@dataclass(frozen=True)
class SwarmRun:
    tokens_per_s: float
    median_step_ms: float
    cut: list[int]
    breakdown_ms: dict[str, dict[str, float]]  # stage -> part -> mean ms per step, as the summary prints them
    check_overhead: float | None  # what its spot checks cost its steps, measured within it (None: not said)
    start_cut: list[int] | None = None  # the cut it started on, where a rebalance changed it (None: ``cut``)

    @property
    def first_cut(self) -> list[int]:
        return self.cut if self.start_cut is None else self.start_cut


def swarm_run(sizes: Sizes, flags: list[str], steps: int | None = None) -> SwarmRun:
    """What a demo swarm's summary says (``steps``: other than ``sizes.steps``)."""
    return parse_run(demo_output("--peers", str(sizes.peers), "--steps", str(steps or sizes.steps), *flags))


def parse_run(out: str) -> SwarmRun:
    """A demo's output read (``swarm_run``)."""
    tokens = summary_tokens_per_s(out)
    median = re.search(r"measured ([\d.]+) ms \(median\)", out)
    cut = re.search(r"^cut \[([\d, ]*)\]$", out, re.MULTILINE)
    checks = re.search(r"steps ([+-][\d.]+)% on average against those with no check under way", out)
    moved = re.search(r"rebalanced at step \d+: .*?; cut \[([\d, ]*)\] -> ", out)
    assert tokens and median and cut, out
    return SwarmRun(
        tokens,
        float(median.group(1)),
        _ints(cut.group(1)),
        step_breakdown(out),
        round(float(checks.group(1)) / 100, 4) if checks else None,
        _ints(moved.group(1)) if moved else None,
    )


def _ints(listed: str) -> list[int]:
    return [int(x) for x in listed.split(",") if x.strip()]


def recipe_runs(sizes: Sizes, together: bool) -> dict[str, SwarmRun]:
    """``swarm_run`` of each recipe and of ``CODE``: one after another, or (``together``,
    the short mode, whose ratios are checked only for their order of magnitude) all at
    once, their start-ups overlapping (each swarm's start-up is most of an 8-step run)."""
    todo = {**RECIPES, "code": CODE}
    if together:
        with concurrent.futures.ThreadPoolExecutor(len(todo)) as pool:
            futures = {name: pool.submit(swarm_run, sizes, flags) for name, flags in todo.items()}
            runs = {name: f.result() for name, f in futures.items()}
    else:
        runs = {name: swarm_run(sizes, flags) for name, flags in todo.items()}
    for name, run in runs.items():
        logger.info("%s swarm: %s", name, run)
    return runs


def step_breakdown(summary: str) -> dict[str, dict[str, float]]:
    """The summary's step breakdown lines (``coordinator.breakdown.breakdown_lines``):
    per stage, each part's mean ms per step and the whole step's (``step``)."""
    out = {}
    for stage, step, parts in re.findall(r"^  stage (\d+) step ([\d.]+) ms[^:]*: (.*) ms$", summary, re.MULTILINE):
        row = {part: float(ms) for part, ms in re.findall(r"(\w+) ([\d.]+)(?: \([^)]*\))?(?:, |$)", parts)}
        out[stage] = {"step": float(step), **row}
    return out


def reference_run(sizes: Sizes) -> TrainResult:
    """The whole model in one process (``train --reference``): its speed, and the
    losses the anchor must reproduce."""
    return train_reference(JobSpec(steps=sizes.steps))


def loss_gap(anchor: PipeliningResult, ref: TrainResult) -> float:
    """The largest difference between the anchor's and the reference's loss at one of
    the reference's steps (the anchor may run longer): both train the same job, so a
    gap means they did not do the same work."""
    if len(anchor.losses) < len(ref.losses):
        raise SystemExit(f"the anchor reported {len(anchor.losses)} losses, the reference {len(ref.losses)}")
    return max(abs(a - r) for a, r in zip(anchor.losses, ref.losses, strict=False))


@dataclass(frozen=True)
class Pair:
    """An unchecked swarm, the anchor on its cut and the default swarm (spot checks at
    their default rate), run back to back with the unchecked one between the others."""

    swarm: SwarmRun
    anchor: PipeliningResult | None
    checked: SwarmRun

    @property
    def ratio(self) -> float | None:
        return self.anchor and self.swarm.tokens_per_s / self.anchor.tokens_per_s

    @property
    def check_cost(self) -> float:
        """The tokens/s its checked swarm lost against its unchecked one."""
        return 1 - self.checked.tokens_per_s / self.swarm.tokens_per_s


def anchor_pairs(sizes: Sizes, short: bool) -> list[Pair]:
    """``sizes.pairs`` sets of ``sizes.anchor_steps`` steps each (the anchor, the checked
    and the unchecked swarm; in turn the checked swarm first and the anchor first, the
    unchecked swarm always in the middle, next to both it is set against). Sets, since
    this machine's load drifts over minutes (the anchor alone ran at 10,853-15,200
    tokens/s within one hour; two unchecked swarms a minute apart at 8,780 and 12,327);
    that many steps, since a swarm's one-time costs (its first rebalance check plans
    for 0.7-0.9 s beside the steps, at step 25; a checker's first build of another
    stage, 20-30 ms each) took 8% of a 60-step run's machine and are spread over a
    demo's 1,200."""
    pairs: list[Pair] = []
    for i in range(sizes.pairs):
        if i % 2 == 0:
            checked = swarm_run(sizes, [], sizes.anchor_steps)
            swarm = swarm_run(sizes, UNCHECKED, sizes.anchor_steps)
            anchor = _anchor(swarm.cut, sizes.anchor_steps, short)
        else:  # the anchor first, on the cut the swarms took last (again right after, where this one's differs)
            cut = pairs[-1].swarm.cut
            anchor = _anchor(cut, sizes.anchor_steps, short)
            swarm = swarm_run(sizes, UNCHECKED, sizes.anchor_steps)
            if swarm.cut != cut:
                anchor = _anchor(swarm.cut, sizes.anchor_steps, short)
            checked = swarm_run(sizes, [], sizes.anchor_steps)
        pairs.append(Pair(swarm, anchor, checked))
        logger.info("unchecked swarm %s; pipelining %s; checked %s", swarm, anchor, checked)
    return pairs


def check_cost(pairs: list[Pair]) -> tuple[float, int]:
    """What spot checks cost: the median of the sets whose two swarms started on the same
    cut (a set on two plans measures the plans: stop 65 saw two 200-step demos a minute
    apart start on [34, 83, 88] and [34, 61, 88], from start-up readings), where at
    least half of the sets did, else of all; and how many sets it counts. The start, not
    the end: a run's checks may move it to another plan, and that cost is theirs."""
    same = [p.check_cost for p in pairs if p.checked.first_cut == p.swarm.first_cut]
    counted = same if 2 * len(same) >= len(pairs) else [p.check_cost for p in pairs]
    return statistics.median(counted), len(counted)


def _median_pair(pairs: list[Pair]) -> Pair:
    """The pair of the median ratio, the lower of the middle two where an anchor failed
    and an even number are left (the first pair where every anchor failed)."""
    measured = sorted((p for p in pairs if p.ratio is not None), key=lambda p: p.ratio or 0.0)
    return measured[(len(measured) - 1) // 2] if measured else pairs[0]


def _in_run(pairs: list[Pair]) -> float | None:
    """The median of what the checked swarms' summaries say their checks cost their steps."""
    said = [p.checked.check_overhead for p in pairs if p.checked.check_overhead is not None]
    return round(statistics.median(said), 4) if said else None


def staged_step_ms(sizes: Sizes) -> dict[str, float]:
    """Median step ms of the demo's model through 4 stages in one process, fp32 and
    bf16 (autocast on this CPU, without the network)."""
    out = {}
    for precision in ("fp32", "bf16"):
        ends: list[float] = []

        def progress(step: int, loss: float, ends: list[float] = ends) -> None:
            ends.append(time.perf_counter())

        train_staged(JobSpec(steps=sizes.steps, precision=precision), sizes.peers, progress)
        steps = sorted(b - a for a, b in itertools.pairwise(ends))
        out[precision] = 1000 * steps[len(steps) // 2]
    return out


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them autocast
    emulates bf16 and a step is many times slower than in fp32 (CI's machine: 17.6x)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


@dataclass(frozen=True)
class Transfers:
    """MB/s of each timed transfer, RAD's and TCP's, round by round."""

    rad: list[float]
    tcp: list[float]

    @property
    def ratios(self) -> list[float]:
        """Each round's RAD over TCP: its two transfers ran back to back, so a load that
        comes and goes falls on both sides of each ratio."""
        return [r / t for r, t in zip(self.rad, self.tcp, strict=True)]


class _Tcp:
    """A plain TCP connection on loopback whose server counts ``size`` bytes per message."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.done: asyncio.Queue[int] = asyncio.Queue()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                got = 0
                while got < self.size:
                    chunk = await reader.read(1 << 22)
                    if not chunk:
                        return
                    got += len(chunk)
                await self.done.put(got)
        finally:
            # Python 3.12's Server.wait_closed waits for every connection to close: an
            # open server side hung the first GPU machine's run (3.12.3, plain asyncio)
            writer.close()

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[asyncio.StreamWriter]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield writer
        finally:
            writer.close()
            await writer.wait_closed()
            server.close()
            await server.wait_closed()  # the handler has read the end of the stream and returned


async def _rad_once(a: Transport, b: Transport, blob: torch.Tensor, i: int) -> float:
    """Seconds of one signed message from ``a``'s ``send`` to a decoded tensor at ``b``."""
    start = time.perf_counter()
    await a.send(b.peer_id, Activations("bench", i, 0, 1), [blob])
    got = await b.inbox.get()
    got.values()
    return time.perf_counter() - start


async def _tcp_once(tcp: _Tcp, writer: asyncio.StreamWriter, data: bytes) -> float:
    start = time.perf_counter()
    writer.write(data)
    await writer.drain()
    await tcp.done.get()
    return time.perf_counter() - start


async def _transfers(sizes: Sizes) -> Transfers:
    """RAD (hivemind libp2p streams carrying a signed frame, sent to decoded tensor)
    against a plain TCP socket, alternating: each round times one transfer of each back
    to back, in turn RAD first and TCP first, after a round that opens the streams.
    Measured apart (all of RAD's, then all of TCP's) and each side's best kept, the two
    met different loads: on a busy machine the ratio swung from 0.849 to 0.044."""
    size, out = sizes.message, Transfers([], [])
    blob, data, tcp = torch.ones(size // 4, dtype=torch.float32), bytes(size), _Tcp(size)
    async with transport_pair("bench") as (a, b), tcp.opened() as writer:
        for i in range(sizes.repeats + 1):
            if i % 2:
                rad = await _rad_once(a, b, blob, i)
                raw = await _tcp_once(tcp, writer, data)
            else:
                raw = await _tcp_once(tcp, writer, data)
                rad = await _rad_once(a, b, blob, i)
            logger.info("round %d: rad %.3f s, tcp %.3f s", i, rad, raw)
            if i > 0:  # the first opens the streams
                out.rad.append(size / rad / 1e6)
                out.tcp.append(size / raw / 1e6)
    return out


async def _within(sizes: Sizes, seconds: float) -> Transfers | None:
    """``_transfers``, or None past ``seconds``, with where each task stood on stderr."""
    task = asyncio.ensure_future(_transfers(sizes))
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        return task.result()
    logger.error("the transfers took over %.0f s; where each task stood:", seconds)
    for t in asyncio.all_tasks():
        t.print_stack(limit=12, file=sys.stderr)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


def _event_loop_run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` on the event loop the peers' data path runs on (``uvloop``, where there is one)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _expire(signum: int, frame: Any) -> None:
    raise TimeoutError("the transfers' event loop was blocked")


def transfers(sizes: Sizes) -> Transfers | None:
    """RAD against TCP (``_transfers``); None where they do not end within
    ``TRANSFERS_TIMEOUT_S`` (the rest of the benchmark still runs). An event loop
    blocked outside asyncio (a DHT that never starts) shows every thread's stack and is
    interrupted a little later."""
    late = int(TRANSFERS_TIMEOUT_S) + 10
    faulthandler.dump_traceback_later(late)
    previous = signal.signal(signal.SIGALRM, _expire)
    signal.alarm(late + 5)
    try:
        return _event_loop_run(_within(sizes, TRANSFERS_TIMEOUT_S))
    except TimeoutError as exc:
        logger.error("%s: RAD and TCP left out", exc)
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def two_processes(sizes: Sizes) -> Transfers | None:
    """RAD against TCP with the receiver in a process of its own (``_two_process``); None
    (logged) where it fails or takes over ``TRANSFERS_TIMEOUT_S``."""
    try:
        rad, tcp = _event_loop_run(
            asyncio.wait_for(_two_process.rounds(sizes.message, sizes.repeats), TRANSFERS_TIMEOUT_S)
        )
    except Exception as exc:  # noqa: BLE001 - the rest of the benchmark still runs
        logger.error("RAD and TCP between two processes left out: %s", exc or type(exc).__name__)
        return None
    return Transfers(rad, tcp)


def _anchor(cut: list[int], steps: int, short: bool) -> PipeliningResult | None:
    """``pipelining_run``; in the full mode, a failure of it (torch 2.11's pipelining asks
    for gradients of the integer values that cross a boundary) leaves its keys null and
    the rest of the run its figures. A swarm that planned one stage (its peers each hold
    the whole model: cut ``[]``, as one set of stop 69's run did) has no pipeline to set
    against: its keys are left null too."""
    if not cut:
        why = "the swarm planned one stage (cut []): no pipeline to run torch.distributed.pipelining on"
        if short:
            raise SystemExit(why)
        logger.error("%s; this set's keys left null", why)
        return None
    try:
        anchor = pipelining_run(cut, steps)
    except SystemExit as exc:
        if short:
            raise
        logger.error("torch.distributed.pipelining failed, its keys left null: %s", str(exc).splitlines()[0])
        return None
    logger.info("pipelining: %.1f tokens/s, median step %.1f ms", anchor.tokens_per_s, anchor.median_step_ms)
    return anchor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    # each part's figures on stderr as it ends: a run cut short by a time limit keeps them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pipeline.py: %(message)s", stream=sys.stderr)
    sizes = SHORT if args.short else FULL
    logger.info("RAD against TCP: %d rounds of %d MiB", sizes.repeats + 1, sizes.message >> 20)
    moved = transfers(sizes)
    rad = statistics.median(moved.rad) if moved else None
    tcp = statistics.median(moved.tcp) if moved else None
    logger.info("rad %s MB/s, tcp %s MB/s", moved and moved.rad, moved and moved.tcp)
    apart = two_processes(sizes)
    logger.info("two processes: rad %s MB/s, tcp %s MB/s", apart and apart.rad, apart and apart.tcp)
    reference = reference_run(sizes)
    ref = reference.tokens / reference.seconds
    logger.info("reference %.1f tokens/s", ref)
    pairs = anchor_pairs(sizes, args.short)
    mid, (cost, counted) = _median_pair(pairs), check_cost(pairs)
    ratios = [p.ratio and round(p.ratio, 3) for p in pairs]  # None: that pair's anchor failed
    anchors = [p.anchor for p in pairs if p.anchor is not None]
    runs = recipe_runs(sizes, together=args.short)
    swarm = runs["fp32"].tokens_per_s
    ms = {name: run.median_step_ms for name, run in runs.items()}
    staged = staged_step_ms(sizes)
    logger.info("in one process: %s", staged)
    out: dict[str, object] = {
        "pipelining_tokens_per_s": round(statistics.median(a.tokens_per_s for a in anchors), 1) if anchors else None,
        "swarm_unchecked_tokens_per_s": round(statistics.median(p.swarm.tokens_per_s for p in pairs), 1),
        "swarm_vs_pipelining": mid.ratio and round(mid.ratio, 3),
        "swarm_vs_pipelining_runs": ratios,
        "anchor_steps": sizes.anchor_steps,
        "spot_check_cost": round(cost, 3),
        "spot_check_cost_runs": [round(p.check_cost, 3) for p in pairs],
        "spot_check_cost_sets": counted,
        "spot_check_cost_in_run": _in_run(pairs),
        "step_ms_pipelining": mid.anchor and round(mid.anchor.median_step_ms, 1),
        "pipelining_loss_gap": float(f"{max(loss_gap(a, reference) for a in anchors):.3g}") if anchors else None,
        "step_ms_unchecked": mid.swarm.median_step_ms,
        "cut": mid.swarm.cut,
        "step_breakdown_ms": mid.swarm.breakdown_ms,
        "swarm_tokens_per_s": round(swarm, 1),
        "reference_tokens_per_s": round(ref, 1),
        "swarm_vs_reference": round(swarm / ref, 3),
        "code_swarm_vs_reference": round(runs["code"].tokens_per_s / ref, 3),
        "programs_vs_code": round(swarm / runs["code"].tokens_per_s, 3),
        "step_ms_code": ms["code"],
        "rad_64mib_mb_per_s": rad and round(rad, 1),
        "tcp_64mib_mb_per_s": tcp and round(tcp, 1),
        "rad_vs_tcp": moved and round(statistics.median(moved.ratios), 3),
        "rad_vs_tcp_range": moved and [round(min(moved.ratios), 3), round(max(moved.ratios), 3)],
        "rad_two_processes_mb_per_s": apart and round(statistics.median(apart.rad), 1),
        "tcp_two_processes_mb_per_s": apart and round(statistics.median(apart.tcp), 1),
        "rad_vs_tcp_two_processes": apart and round(statistics.median(apart.ratios), 3),
        "step_ms_fp32": ms["fp32"],
        "step_ms_clip": ms["clip"],
        "step_ms_bf16": ms["bf16"],
        "clip_vs_fp32": round(ms["clip"] / ms["fp32"], 3),
        "bf16_vs_fp32": round(ms["bf16"] / ms["fp32"], 3),
        "in_process_bf16_vs_fp32": round(staged["bf16"] / staged["fp32"], 3),
        "cpu_has_bf16": cpu_has_bf16(),
    }
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
