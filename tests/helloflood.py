"""An outsider without the join token saying hello to a private swarm's coordinator as
fast as it can (issue 35), and what the status-page and hello floods cost.

``python -m tests.helloflood --initial-peers MADDR [--run RUN] [--seconds S] [--cpus
LIST] [--go-file F]`` starts a hivemind P2P node with an identity nobody admitted,
prints ``ready``, waits for ``F`` if given, then writes signed hellos (each with a
fresh sequence number, no proof) on streams to the coordinator for ``S`` seconds,
reopening a stream whenever one is closed on it; prints one JSON line: hellos written,
streams opened and refused, seconds.

:func:`status_flood_ratio` and :func:`hello_flood_cpu` are ``benchmarks/adversary.py``'s
``status_flood_ratio`` and ``hello_flood_coordinator_cpu_per_1k``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

#: requests a second the status flood offers (the goal's floor is 2,000), and its floods
#: in the full mode (each between clean windows)
STATUS_RATE = 2500.0
STATUS_ROUNDS = 3


async def hellos(maddrs: list[str], run_id: str, seconds: float, go_file: str) -> dict[str, Any]:
    from hivemind.p2p import P2P, PeerID

    from protocol.net.addrs import peer_id_of
    from protocol.net.transport import MSG_PROTOCOL
    from protocol.trust.identity import Identity
    from protocol.wire.envelope import Sealer
    from protocol.wire.messages import Hello

    target = peer_id_of(maddrs[0])
    assert target is not None, f"no /p2p/ peer id in {maddrs[0]}"
    p2p = await P2P.create(initial_peers=maddrs)
    me = Identity.generate()
    sealer = Sealer(me, p2p.peer_id.to_base58())
    batch = [sealer.seal(Hello(run_id, me.public_hex), [], [])[0] for _ in range(2_000)]
    tally = {"sent": 0, "streams": 0, "refused": 0}
    print("ready", flush=True)
    while go_file and not os.path.exists(go_file):
        await asyncio.sleep(0.01)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(target), MSG_PROTOCOL), 5
            )
        except Exception:
            tally["refused"] += 1
            await asyncio.sleep(0.05)
            continue
        tally["streams"] += 1
        try:
            while time.monotonic() - start < seconds and not reader.at_eof():
                at = tally["sent"] % len(batch)  # repeats after 2,000: refused all the same
                writer.writelines(batch[at : at + 20])
                await asyncio.wait_for(writer.drain(), 1.0)
                tally["sent"] += 20
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
    await p2p.shutdown()
    return {**tally, "seconds": round(time.monotonic() - start, 2)}


def _cpu_s(pid: int) -> float:
    """CPU-seconds (user and system) process ``pid`` used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _go(tmp: Path, name: str) -> Path:
    return tmp / f"go-{name}-{time.monotonic_ns()}"


def status_flood_ratio(short: bool, target: Any = None) -> dict[str, float]:
    """Steps/s of a 2-peer swarm (``target``, a :class:`tests.flooder.FloodTarget`, or
    one of its own) while an outsider floods its status page (``STATUS_RATE``
    requests/s written whether answered or not, from the last CPU) over steps/s in the
    clean windows between the floods (clean, flood, clean, ... clean: ``STATUS_ROUNDS``
    floods, one with ``short``: one window pair reads within about 15% of 1.0 with no
    flood at all); and the requests written and answered a second."""
    from tests.flooder import on_own_target

    if target is None:
        return on_own_target(lambda own: status_flood_ratio(short, own))
    cleans, floods, tallies = _status_windows(target, *((2.0, 1) if short else (10.0, STATUS_ROUNDS)))
    coord = target.swarm.coord
    lines, times = list(coord.lines), list(coord.times)
    clean = sum(w.rate(lines, times) for w in cleans) / len(cleans)
    flooded = sum(w.rate(lines, times) for w in floods) / len(floods)
    return {
        "status_flood_ratio": round(flooded / clean, 3),
        "status_flood_requests_per_s": min(t["written_per_s"] for t in tallies),
        "status_flood_answers_per_s": max(t["answers_per_s"] for t in tallies),
        "status_flood_clean_steps_per_s": round(clean, 2),
    }


def _status_windows(target: Any, seconds: float, rounds: int) -> tuple[list[Any], list[Any], list[dict[str, Any]]]:
    """Clean, flood, clean, ... clean windows of ``seconds`` on ``target``'s swarm, each
    flood from a status flooder of its own: (clean windows, flood windows, the floods' tallies)."""
    from tests.flooder import _clean, _Window
    from tests.swarmproc import Proc

    cleans, floods, tallies = [_clean(seconds)], [], []
    for _ in range(rounds):
        go = _go(target.tmp, "status")
        args = [target.swarm.url, "--rate", str(STATUS_RATE), "--seconds", str(seconds), "--go-file", str(go)]
        flooder = Proc(*args, *target.cpu_arg, module="tests.statusflood")
        target.swarm.procs.append(flooder)
        flooder.wait_line("^ready$", 30)
        go.touch()
        floods.append(_Window())
        tallies.append(json.loads(flooder.wait_line(r"^\{.*\}$", seconds + 30).group(0)))
        floods[-1].end(floods[-1].start + seconds)
        cleans.append(_clean(seconds))
    return cleans, floods, tallies


def hello_flood_cpu(short: bool) -> dict[str, float]:
    """Coordinator CPU-seconds per 1,000 hellos an outsider without the token sent a
    private 2-peer training swarm (the flooder on the last CPU), over what its CPU use
    was in the clean windows around the flood."""
    from tests.flooder import FloodTarget
    from tests.swarmproc import Proc, api

    seconds = 2.0 if short else 10.0
    with tempfile.TemporaryDirectory() as tmp:
        target = _private_target(Path(tmp), FloodTarget)
        try:
            swarm, pid = target.swarm, target.swarm.coord.popen.pid
            go = _go(Path(tmp), "hello")
            token = swarm.join_args[swarm.join_args.index("--token") + 1]
            args = ["--token", token, "--seconds", str(seconds), "--go-file", str(go), *target.cpu_arg]
            flooder = Proc(*args, module="tests.helloflood")
            swarm.procs.append(flooder)
            flooder.wait_line("^ready$", 60)
            spans = []
            for flood in (False, True, False):
                rejected = sum(api(swarm.url)["rejected"].values())
                cpu, t0 = _cpu_s(pid), time.monotonic()
                if flood:
                    go.touch()
                    tally = json.loads(flooder.wait_line(r"^\{.*\}$", seconds + 60).group(0))
                else:
                    time.sleep(seconds)
                took = time.monotonic() - t0
                time.sleep(1.1)  # the page's snapshot catches up
                spans.append((_cpu_s(pid) - cpu, took, sum(api(swarm.url)["rejected"].values()) - rejected))
        finally:
            target.close()
    clean_rate = (spans[0][0] / spans[0][1] + spans[2][0] / spans[2][1]) / 2
    extra = max(0.0, spans[1][0] - clean_rate * spans[1][1])
    return {
        "hello_flood_coordinator_cpu_per_1k": round(extra / max(tally["sent"], 1) * 1000, 4),
        "hello_flood_hellos_per_s": round(tally["sent"] / max(tally["seconds"], 1e-9), 1),
        "hello_flood_rejections_counted": spans[1][2],
    }


def _private_target(tmp: Path, cls: Any) -> Any:
    """A FloodTarget whose swarm is private (only the token's holders are admitted)."""
    from tests import swarmproc

    original = swarmproc.Swarm

    class PrivateSwarm(original):  # type: ignore[misc, valid-type]
        def __init__(self, tmp: Any, args: list[str], peers: int, env: dict[str, str] | None = None) -> None:
            super().__init__(tmp, [*args, "--private"], peers, env)

    swarmproc.Swarm = PrivateSwarm  # type: ignore[misc]
    try:
        return cls(tmp)
    finally:
        swarmproc.Swarm = original  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token", required=True, help="the private swarm's join token (its addresses and run)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--cpus", default="")
    ap.add_argument("--go-file", default="")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from protocol.trust.admission import parse_token

    token = parse_token(args.token)  # the flooder uses its addresses and run, never its secret
    print(json.dumps(asyncio.run(hellos(token.maddrs, token.run, args.seconds, args.go_file))), flush=True)


if __name__ == "__main__":
    main()
