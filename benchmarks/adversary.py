"""What hostile peers and outsiders cost an honest swarm, measured in one run.
Prints one JSON object:

- ``flood_throughput_ratio``: training tokens/s while an outsider floods the
  coordinator with frames it was never admitted to send, over tokens/s without
  (goal >= 0.9). ``flood_sustained_throughput_ratio``: the same while the outsider
  floods for the whole window (it is muted, disconnected and redials: its streams
  are closed unread, but the p2p daemon still decrypts what each one pushes).
- ``max_rss_mb_under_alloc_attack``: the receiving process's highest RSS while an
  admitted sender claims a 4 GiB payload, asks 256 MiB probes back and sends lane
  parts no head claims, next to ``idle_rss_mb`` before (goal <= 2x idle).
- ``probe_amplification``: the most bytes any probe drew back per byte sent
  (unadmitted, over-asking and honest probes; goal <= 1).
- ``spot_check_overhead``: in a replicated swarm with the default ``--spot-check``,
  the share of steps in which checks ran times how much longer (median) they took
  than those in which none did (``protocol.trust.spotcheck.step_overhead``; the median
  of the runs'; goal <= 0.05).
  Checked and clean steps are drawn at random among each other in one run, so the
  plan, the peers and the machine are the same for both.
  ``spot_check_overhead_runs`` compares whole runs instead: the median step time
  with checks over that of the same swarm started without, runs alternated; two
  runs can differ by more than the checks cost (their plans, measured anew, can
  differ). ``spot_check_step_ms_off``/``_on`` are the medians of those runs'
  median step times; ``spot_check_overhead_tokens`` is 1 - tokens/s with over
  tokens/s without, over whole runs (warm-up and every slow step in them).
  ``spot_check_compute_share``: the peers' own count of their compute on spot checks (weight copies kept, re-executions,
  a rebuilt stage's weights loaded) over their compute on training, in the runs
  with checks: free of run-to-run noise, and what the checks cost where the
  peers have no idle time (as here: 4 peers and a coordinator on 2 cores).
- ``cheater_caught_within_steps``: the step at which a replica corrupting 10% of
  its micro-batches (finite noise) was excluded by spot checks at the default
  rate (goal <= 20); ``cheater_survival_20_steps`` is the formula's chance that
  such a cheater passes 20 steps (``protocol.trust.spotcheck.survival``), and
  ``gradient_cheater_survival_20_steps`` that of one corrupting only its gradients
  in 10% of its micro-batches, which only the backward checks (``BACKWARD_SHARE``
  of them) see.

- ``status_flood_ratio``: steps/s of a 2-peer swarm while an outsider floods its
  status page (2,500 requests/s offered, pipelined on raw sockets from the last CPU;
  ``status_flood_requests_per_s`` answered) over the same run's clean windows around
  it (goal >= 0.9). ``hello_flood_coordinator_cpu_per_1k``: the coordinator's
  CPU-seconds (``/proc``), over its clean windows' rate, per 1,000 signed hellos an
  outsider without the token sent a private swarm from the last CPU (goal <= 0.05);
  ``hello_flood_rejections_counted``: those the gate read and refused (the rest were
  refused unread once it was muted). Both from ``tests/helloflood.py``.
- ``public_shadow_store_trains``: whether a public run trains with an outsider's
  regular value under each of its DHT keys, stored before the peers join.
  ``public_junk_flood_ratio``: steps/s while an outsider stores 10,000 junk and
  10,000 wrongly signed subkeys under the adverts key, over the same run's clean
  windows (goal >= 0.9), with ``public_junk_flood_rss_growth_mb`` (the
  coordinator's, goal <= 50) and ``public_junk_flood_log_lines_per_min`` (its lines
  about refused records; ``tests/dht_attacks.py``)

``--short`` runs each smaller, for the test suite: one flood of each kind in 2 s
windows (frames, status page, hellos, junk records; a flood's own window lasts as long
as the flood if longer), measured once however busy the machine is; the three floods
on a public swarm (frames, status page, junk records) share one swarm, each flood
still between clean windows of its own (the full mode starts one for each); 2 claims
and 4 over-asking probes (8 and 16), each attack's write given 3 s (10), and a probe
read for 1 s past its whole answer (until the answerer closes); one pair of 50-step
spot-check runs (five of 300); a cheater run of 15 steps of 32 micro-batches (60 of
64). Both modes end the cheater's run
once it is excluded. The short mode runs the parts that time nothing side by side, once
the timed ones are done: the cheater's run (a step count) beside the allocation attacks
and probes (bytes, and the benchmark's own RSS) and then the shadowing store's swarm
(whether it trains); the full mode runs every part alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from p2p import claiming, transport_pair  # noqa: E402

from protocol.net.probe import BW_PROTOCOL  # noqa: E402
from protocol.net.transport import _LANE_HEAD, LANE_PROTOCOL, MAX_WAITING_PARTS, MSG_PROTOCOL, PeerUnreachable  # noqa: E402
from protocol.trust.spot_rate import DEFAULT_SPOT_CHECK  # noqa: E402
from protocol.trust.spotcheck import BACKWARD_SHARE, MIN_CLEAN_STEPS, survival  # noqa: E402
from protocol.wire.encoding import write_frame  # noqa: E402
from tests.conftest import demo_output  # noqa: E402
from tests.swarmproc import SMALL, Swarm, join_together, summary_tokens_per_s  # noqa: E402

CHEAT_FRACTION = 0.1


# ---------------------------------------------------------------- memory and probes
async def _probe(a: object, peer: str, up: int, down: int, short: bool) -> tuple[int, int]:
    """One raw probe: (bytes sent, bytes that came back), read until the answerer closes
    or sends nothing for 15 s. ``short``: for 1 s once the acknowledgement and the
    ``down`` bytes asked have come (an honest answer then lingers, open, for the prober
    to close it: ``PROBE_LINGER_S``, 5 s)."""
    reader, writer = await a._open(peer, BW_PROTOCOL)  # type: ignore[attr-defined]
    await write_frame(writer, {"down_bytes": down}, [torch.zeros(up, dtype=torch.uint8)])
    got = 0
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 1 if short and got > down else 15):
            got += len(chunk)
    except (asyncio.TimeoutError, ConnectionError):
        pass
    writer.close()
    return up, got


async def _refused(write: Any, short: bool) -> None:
    """An attack's write; the receiver may cut the stream, or leave it unread (TCP holds
    the attacker back: its own unpaid claim holds up its later payloads): both defend.
    Given 10 s (``short``: 3 s; an allocation on a claim would show in milliseconds)."""
    try:
        await asyncio.wait_for(write, 3 if short else 10)
    except (PeerUnreachable, asyncio.TimeoutError):
        pass


async def _attacks(short: bool) -> dict[str, float]:
    me = psutil.Process()
    async with transport_pair("r") as (a, b):
        await asyncio.sleep(0.5)
        idle = me.memory_info().rss
        peak = idle
        sealer = a.sealer
        for _ in range(2 if short else 8):  # 4 GiB claimed, 1 MiB sent, each
            claim = [claiming(sealer, 4 << 30), bytes(1 << 20)]
            await _refused(a._write("claim", b.peer_id, MSG_PROTOCOL, claim), short)
            peak = max(peak, me.memory_info().rss)
        parts = [_LANE_HEAD.pack(1000 + i, 0, 1 << 20) + bytes(1 << 20) for i in range(MAX_WAITING_PARTS * 4)]
        await _refused(a._write("orphans", b.peer_id, LANE_PROTOCOL, parts), short)
        await asyncio.sleep(0.5)
        peak = max(peak, me.memory_info().rss)
        ratios = []
        for up, down in [(1 << 10, 256 << 20)] * (4 if short else 16) + [(1 << 20, 1 << 20)]:
            sent, got = await _probe(a, b.peer_id, up, down, short)  # admitted: over-asking, then honest
            ratios.append(got / sent)
            peak = max(peak, me.memory_info().rss)
        b.gate.keys.pop(a.peer_id, None)
        sent, got = await _probe(a, b.peer_id, 1 << 10, 256 << 20, short)  # not admitted
        ratios.append(got / sent)
        peak = max(peak, me.memory_info().rss)
    return {
        "idle_rss_mb": round(idle / 2**20, 1),
        "max_rss_mb_under_alloc_attack": round(peak / 2**20, 1),
        "probe_amplification": round(max(ratios), 3),
    }


# ---------------------------------------------------------------- swarms
def _demo(flags: list[str], steps: int) -> tuple[float, float, float, float | None]:
    """(median step ms, tokens/s over the whole run, the peers' compute on spot checks
    over their compute on training, what the checks cost its steps on average against the
    run's steps without any) of a demo swarm with ``flags``."""
    out = demo_output("--steps", str(steps), *SMALL, *flags)
    median = re.search(r"measured ([\d.]+) ms \(median\)", out)  # the estimator's line: the measured step
    rate = summary_tokens_per_s(out)
    share = re.search(r"([\d.]+)% of the peers' training compute", out)
    cost = re.search(r"steps ([+-][\d.]+)% on average against those with no check", out)
    assert median and rate and share, out
    in_run = float(cost.group(1)) / 100 if cost else None
    return float(median.group(1)), rate, float(share.group(1)) / 100, in_run


def spot_check_overhead(short: bool) -> dict[str, float]:
    """A replicated swarm (4 peers on 2 stages) with spot checks: what they cost its
    steps against those without any; and the same swarm without checks,
    runs alternated: the median step's overhead across runs, the medians of the runs'
    median step times, and the overhead in tokens/s over whole runs (warm-up
    included, and every slow step)."""
    steps, rounds = (50, 1) if short else (300, 5)
    base = ["--peers", "4", "--stages", "2", "--micro-batches", "8", "--data-args", "batch_size=16"]
    on, off = [], []
    for _ in range(rounds):
        off.append(_demo([*base, "--spot-check", "0"], steps))
        on.append(_demo([*base, "--spot-check", str(DEFAULT_SPOT_CHECK)], steps))
    ms_off, ms_on = (statistics.median(run[0] for run in runs) for runs in (off, on))
    rate_off, rate_on = (statistics.median(run[1] for run in runs) for runs in (off, on))
    in_run = [run[3] for run in on if run[3] is not None]
    if not in_run:
        raise SystemExit(f"no run of {steps} steps had {MIN_CLEAN_STEPS} steps without a spot check")
    return {
        "spot_check_overhead": round(statistics.median(in_run), 3),
        "spot_check_overhead_runs": round(ms_on / ms_off - 1.0, 3),
        "spot_check_step_ms_off": round(ms_off, 2),
        "spot_check_step_ms_on": round(ms_on, 2),
        "spot_check_overhead_tokens": round(max(0.0, 1.0 - rate_on / rate_off), 3),
        "spot_check_compute_share": round(statistics.median(run[2] for run in on), 3),
    }


def cheater_caught(short: bool) -> tuple[int, float, float]:
    """(the step at which a noisy cheat was excluded, or steps + 1 if never; its
    survival chance over 20 steps by the formula; that of a cheat only in gradients,
    which only the backward checks see) in a swarm of one stage on two honest
    replicas and the cheat, at the default spot-check rate."""
    steps, mbs = (15, 32) if short else (60, 64)
    batches = ["--micro-batches", str(mbs), "--data-args", f"batch_size={mbs}"]
    args = ["--steps", str(steps), "--seed", "0", *SMALL, *batches, "--min-peers", "3", "--stages", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        swarm = Swarm(Path(tmp), args, peers=0)
        try:
            cheater = swarm.add_hostile("noisy", "x.key", {"FUSIONLLM_CHEAT_FRACTION": str(CHEAT_FRACTION)})
            join_together(swarm, [[], []])
            try:  # its exclusion ends the measurement: the run's later steps are not waited for
                swarm.coord.wait_line(rf"peer {cheater} .*failed: excluded: ", 600)
            except AssertionError:  # the run ended, and the cheater was never excluded
                assert swarm.coord.popen.poll() is not None, "the cheater's run did not end within 600 s"
            out = swarm.coord.output
        finally:
            swarm.close()
    alive = survival(CHEAT_FRACTION, DEFAULT_SPOT_CHECK, round(mbs / 3), 20)
    gradients_only = survival(CHEAT_FRACTION, DEFAULT_SPOT_CHECK * BACKWARD_SHARE, round(mbs / 3), 20)
    return _step_excluded(out, cheater) or steps + 1, alive, gradients_only


def _step_excluded(out: str, peer: str) -> int | None:
    """The step of the spot check after which ``peer`` was excluded (the coordinator's
    lines: a spot check's finding, then the exclusion)."""
    step = None
    for line in out.splitlines():
        found = re.search(r"spot check of step (\d+)", line)
        if found:
            step = int(found.group(1))
        elif re.search(rf"peer {peer} .*failed: excluded: ", line):
            return None if step is None else step + 1  # steps are counted from 0
    return None


START = time.monotonic()


def _part(name: str) -> None:
    """Say on stderr which part starts (a run that hangs then shows where)."""
    print(f"adversary: {name} (at {time.monotonic() - START:.0f} s)", file=sys.stderr, flush=True)


def public_floods(short: bool) -> dict[str, object]:
    """The floods on a public training swarm (frames, its status page, junk DHT records)
    and (the full mode) the outsider's shadowing store. ``short``: the three floods share
    one swarm (its clean windows are measured around each flood all the same; the junk
    flood last, as its records stay in the DHT); the full mode starts one swarm for each."""
    from flooder import on_own_target

    if short:  # its shadowing store runs beside the cheater's run (``side_by_side``)
        _part("a public swarm, for three floods")
        return on_own_target(_floods)
    from dht_attacks import public_shadow_store_trains

    out = _floods(None)
    _part("an outsider's shadowing DHT store")
    out["public_shadow_store_trains"] = public_shadow_store_trains(short)
    return out


def _floods(shared: Any) -> dict[str, object]:
    """The figures of the three floods, on ``shared`` (a ``FloodTarget``: short) or each
    on a swarm of its own (``None``: the full mode)."""
    from dht_attacks import public_junk_flood
    from flooder import flood_ratios
    from helloflood import status_flood_ratio

    short = shared is not None
    _part("a flood, then a sustained flood")
    burst, sustained = flood_ratios(short, shared)
    out: dict[str, object] = {"flood_throughput_ratio": round(burst, 3)}
    out["flood_sustained_throughput_ratio"] = round(sustained, 3)
    _part("a status-page flood")
    out.update(status_flood_ratio(short, shared))
    _part("an outsider's junk DHT records")  # tests/dht_attacks.py
    out.update(public_junk_flood(short, shared))
    return out


def side_by_side(out: dict[str, object]) -> tuple[int, float, float]:
    """(``--short``) The parts that time nothing, at once: the cheater's run (its figure
    is the step of its exclusion) on a thread, and beside it the allocation attacks and
    probes (bytes and this process's RSS; the swarm's processes are others) and the
    shadowing store's swarm (whether it trains to its end); ``cheater_caught``'s figures."""
    from dht_attacks import public_shadow_store_trains

    with ThreadPoolExecutor(1) as pool:
        _part("a cheater, beside the allocation attacks and the shadowing DHT store")
        cheater = pool.submit(cheater_caught, True)
        out.update(asyncio.run(_attacks(True)))
        out["public_shadow_store_trains"] = public_shadow_store_trains(True)
        return cheater.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="smaller runs, for the test suite")
    short = ap.parse_args().short
    from helloflood import hello_flood_cpu

    out = public_floods(short)
    _part("a hello flood on a private swarm")
    out.update(hello_flood_cpu(short))
    if not short:
        _part("allocation attacks and probes")
        out.update(asyncio.run(_attacks(short)))
    t0 = time.perf_counter()
    _part("spot-check overhead")
    out.update(spot_check_overhead(short))
    if short:
        step, alive, gradients_only = side_by_side(out)
    else:
        _part("a cheater")
        step, alive, gradients_only = cheater_caught(short)
    _part("done")
    out["cheater_caught_within_steps"] = step
    out["cheater_survival_20_steps"] = round(alive, 4)
    out["gradient_cheater_survival_20_steps"] = round(gradients_only, 4)
    out["spot_check_rate"] = DEFAULT_SPOT_CHECK
    out["swarm_s"] = round(time.perf_counter() - t0, 1)
    if short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
