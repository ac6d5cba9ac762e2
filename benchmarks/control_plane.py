"""The coordinator's control plane under a synthetic load (issue 33): a real coordinator
process (``fusionllm coordinator``, waiting for more peers than will come, so that it
only takes their messages) and ``peers`` lightweight peers in this process, each a
libp2p node with its own key that says hello and then sends signed heartbeats at
``rate`` per second. The coordinator's CPU-seconds (its Python process, and with its
p2p daemon and DHT process) come from /proc over a quiet window and a loaded one of
the same length; their difference over the messages sent is the CPU one control
message costs, which ``discovery_cost.control_cpu``'s rates turn into CPU per 1,000
peers. (A heartbeat and a step report cost the coordinator alike: one small signed
frame, decoded, gated and verified.)

The outbound side (``measure_outbound``): a real ``Transport`` in this process (its
p2p daemon beside it) sends a step's ``Commit`` to ``peers`` sinks in a worker process
(libp2p nodes that drop what they read), ``rate`` steps a second, as the coordinator
did (each sealed and sent in turn) and as it does (``coordinator.messaging.send_each``:
in parallel, one frame sealed for all); this process's and its daemon's CPU over each
window, less a quiet window's, per commit, and the median time from a step's first
send to its last write (``commit_<way>_fanout_ms``: what the last peer's commit
waits). ``wire_costs`` prices one ``Commit`` and one ``Assign`` for a plan of ``n``
peers: bytes and the time to seal them."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
from hivemind.p2p import P2P

from coordinator.assignments import assignments, header_bytes, reassignments
from coordinator.discovery_cost import even_plan
from coordinator.messaging import send_each
from protocol.net.transport import MSG_PROTOCOL, Transport
from protocol.trust.identity import Identity
from protocol.wire.encoding import MAX_HEADER_BYTES
from protocol.wire.envelope import Sealer
from protocol.wire.gate import Gate
from protocol.wire.messages import Assign, Beat, Commit, Hello
from tests.swarmproc import Proc

RUN = "control-bench"
#: the coordinator's model: the smallest (it never plans; its size only sets start-up time)
MODEL = ["--model-args", "n_layer=2,n_embd=64,n_head=4"]
#: the longest the coordinator may take to print its join line
START_S = 120.0

logger = logging.getLogger(__name__)


def _cpu_s(pid: int) -> tuple[float, float]:
    """User plus system CPU-seconds so far of process ``pid`` and of it with its children."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    times = []
    for p in procs:
        try:
            t = p.cpu_times()
            times.append(t.user + t.system)
        except psutil.Error:
            times.append(0.0)
    return times[0], sum(times)


class Coordinator:
    """A coordinator that waits for peers forever, started at once (its start may
    overlap other work) and measured by ``measure``, which ends it; ``close`` ends it
    where ``measure`` never ran."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        args = ["--run", RUN, "--min-peers", "100000", "--peer-wait", "3600", "--port", "0", "--status-port", "0"]
        self.proc = Proc("coordinator", *args, "--identity", str(tmp / "c.key"), "--run-dir", str(tmp / "run"), *MODEL)

    def measure(self, peers: int, rate: float, seconds: float) -> dict[str, float]:
        """The coordinator's CPU per control message, measured (see the module's text)."""
        try:
            maddr = self.proc.wait_line(r"--initial-peers (\S+)", START_S).group(1)  # its maddr, with /p2p/<id>
            return asyncio.run(_load(maddr, peers, rate, seconds, self.proc.popen.pid))
        finally:
            self.close()

    def close(self) -> None:
        self.proc.kill_all()  # with its DHT process and p2p daemons
        self._tmp.cleanup()


async def _peer(maddr: str) -> tuple[Transport, str]:
    """A lightweight peer that said hello to the coordinator at ``maddr``."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    who = Identity.generate()
    tp = Transport(p2p, who, Gate(RUN))
    await tp.start()
    coordinator = maddr.rsplit("/p2p/", 1)[1]
    tp.learn(coordinator, [maddr])
    mine = [str(m) for m in await p2p.get_visible_maddrs()]
    await tp.send(coordinator, Hello(RUN, who.public_hex, maddrs=mine))
    return tp, coordinator


async def _load(maddr: str, peers: int, rate: float, seconds: float, pid: int) -> dict[str, float]:
    """The coordinator's CPU-seconds (process ``pid``, and with its children) over a
    quiet window and a loaded one (``seconds`` each), and the heartbeats sent."""
    made = await asyncio.gather(*(_peer(maddr) for _ in range(peers)))
    await asyncio.sleep(min(3.0, seconds))  # the hellos taken, the dial-backs done
    t0 = _cpu_s(pid)
    await asyncio.sleep(seconds)
    t1 = _cpu_s(pid)
    sent = [0]

    async def beat(tp: Transport, coordinator: str) -> None:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            await tp.send(coordinator, Beat(RUN, sent[0], 0))
            sent[0] += 1
            await asyncio.sleep(1.0 / rate)

    await asyncio.gather(*(beat(tp, c) for tp, c in made))
    t2 = _cpu_s(pid)
    for tp, _ in made:
        await tp.aclose()
        await tp.p2p.shutdown()
    n = max(sent[0], 1)
    return {
        "control_messages": sent[0],
        "coordinator_cpu_s_per_message": max(0.0, (t2[0] - t1[0]) - (t1[0] - t0[0])) / n,
        "coordinator_tree_cpu_s_per_message": max(0.0, (t2[1] - t1[1]) - (t1[1] - t0[1])) / n,
        "coordinator_quiet_cpu": (t1[0] - t0[0]) / seconds,
    }


def measure(peers: int, rate: float, seconds: float) -> dict[str, float]:
    """The coordinator's CPU per control message, measured (see the module's text)."""
    return Coordinator().measure(peers, rate, seconds)


def measure_outbound(peers: int, rate: float, seconds: float) -> dict[str, float]:
    """The coordinator's CPU per commit sent, in turn and each sealed (before) and with
    ``send_each`` (now), measured (see the module's text)."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sinks, args=(peers, theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        if not mine.poll(START_S):
            raise RuntimeError(f"the sinks did not start within {START_S:.0f} s")
        return asyncio.run(_send_commits(mine.recv(), rate, seconds))
    finally:
        mine.send("end")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _sinks(count: int, conn: Connection) -> None:
    """A worker of ``count`` libp2p nodes that read and drop every frame sent to them
    (the peers' side, not measured); it answers their ids and addresses, then waits
    for word to end."""

    async def drop(_info: Any, reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass

    async def run() -> None:
        nodes = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(count)]
        for node in nodes:
            await node.add_binary_stream_handler(MSG_PROTOCOL, drop)
        conn.send([(n.peer_id.to_base58(), [str(m) for m in await n.get_visible_maddrs()]) for n in nodes])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for node in nodes:
            await node.shutdown()

    try:
        asyncio.run(run())
    finally:
        conn.close()


async def _send_commits(sinks: list[tuple[str, list[str]]], rate: float, seconds: float) -> dict[str, float]:
    """This process's CPU (and with its p2p daemon) over a quiet window and a window of
    each way of sending a step's commits to ``sinks``, ``rate`` steps a second."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    tp = Transport(p2p, Identity.generate(), Gate(RUN))
    try:
        for peer, maddrs in sinks:
            tp.learn(peer, maddrs)
        peers = [peer for peer, _ in sinks]
        daemon = p2p._child.pid  # the daemon's CPU is the coordinator's too
        await send_each(tp, dict.fromkeys(peers, Commit(RUN, 0)), START_S, len(peers))  # the streams opened
        await asyncio.sleep(min(3.0, seconds))  # the daemon settles (0.4 CPU-s in 4 s when measured at once)
        quiet = [await _idle(daemon, seconds)]
        out: dict[str, float] = {}
        for way in ("in_turn", "send_each"):
            t0, (sent, fanout) = _own_cpu_s(daemon), await _steps(tp, peers, rate, seconds, way)
            out[f"commits_{way}"], used = sent, _cpu_delta(t0, _own_cpu_s(daemon))
            out[f"commit_{way}_fanout_ms"] = round(fanout * 1e3, 3)
            out[f"_{way}_py"], out[f"_{way}_all"] = used
        quiet.append(await _idle(daemon, seconds))
        base = min(quiet, key=lambda q: q[1])  # the quieter of the windows before and after
        out["outbound_quiet_cpu"] = base[1] / seconds
        for way in ("in_turn", "send_each"):
            sent = max(out[f"commits_{way}"], 1)
            out[f"commit_{way}_python_cpu_s"] = max(0.0, out.pop(f"_{way}_py") - base[0]) / sent
            out[f"commit_{way}_cpu_s"] = max(0.0, out.pop(f"_{way}_all") - base[1]) / sent
        return out
    finally:
        await tp.aclose()
        await p2p.shutdown()


async def _steps(tp: Transport, peers: list[str], rate: float, seconds: float, way: str) -> tuple[int, float]:
    """Send a step's commits to every peer ``rate`` times a second for ``seconds`` (a
    third of them keeping the step's weights, as a spot-checked stage's peers do); the
    commits sent, and the median seconds from a step's first send to its last write
    to the daemon."""
    start, step, sent, fanouts = time.monotonic(), 0, 0, []
    while time.monotonic() - start < seconds:
        plain = Commit(RUN, step, 1, False, 0.97, False, 65536.0)
        kept = dataclasses.replace(plain, audit=True)
        sends = {p: kept if i % 3 == 0 else plain for i, p in enumerate(peers)}
        t0 = time.perf_counter()
        if way == "in_turn":
            for p, msg in sends.items():  # each built and sealed for its peer, bounded (``Mailbox.send``)
                await asyncio.wait_for(tp.send(p, dataclasses.replace(msg)), START_S)
        else:
            missed = await send_each(tp, sends, START_S, 64)
            if missed:
                raise RuntimeError(f"commits not taken: {missed}")
        fanouts.append(time.perf_counter() - t0)
        sent, step = sent + len(sends), step + 1
        await asyncio.sleep(max(0.0, start + step / rate - time.monotonic()))
    return sent, statistics.median(fanouts)


async def _idle(daemon: int, seconds: float) -> tuple[float, float]:
    """This process's CPU-seconds (and with its daemon's) over ``seconds`` of sending nothing."""
    t0 = _own_cpu_s(daemon)
    await asyncio.sleep(seconds)
    return _cpu_delta(t0, _own_cpu_s(daemon))


def _own_cpu_s(daemon: int) -> tuple[float, float]:
    """This process's CPU-seconds so far, and with its p2p daemon's (process ``daemon``)."""
    mine = time.process_time()
    try:
        t = psutil.Process(daemon).cpu_times()
        return mine, mine + t.user + t.system
    except psutil.Error:
        return mine, mine


def _cpu_delta(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return b[0] - a[0], b[1] - a[1]


def wire_costs(n: int, repeat: int = 1000) -> dict[str, float]:
    """One ``Commit``'s signed head (bytes, microseconds to build and seal), and the
    ``Assign`` of a peer in the middle of a plan of ``n`` peers shaped as
    ``discovery_cost.even_plan`` (stages of at most 64 replicas; bytes, whether it fits
    ``MAX_HEADER_BYTES``, milliseconds to encode and sign, and every planned peer's
    together: what a re-plan sends)."""
    who = Identity.generate()
    sealer = Sealer(who, _peer_id(0))
    t0 = time.process_time()
    for step in range(repeat):
        head, _ = sealer.seal(Commit(RUN, step, 1, False, 0.97, False, 65536.0, 0, step % 2 == 0), [], [])
    commit_us = (time.process_time() - t0) / repeat * 1e6
    stages, assigns = _assigns(n)
    assign = assigns[stages[len(stages) // 2][0]]
    t0 = time.process_time()
    data = json.dumps(assign.header(), separators=(",", ":")).encode()
    who.sign(data)
    assign_ms = (time.process_time() - t0) * 1e3
    return {
        "commit_bytes": len(head),
        "commit_seal_us": round(commit_us, 1),
        "stages": len(stages),
        "assign_bytes": len(data),
        "assign_fits": len(data) <= MAX_HEADER_BYTES,
        "assign_seal_ms": round(assign_ms, 2),
        # a stage's replicas' assignments differ by their replica number alone
        "assign_bytes_per_replan": sum(len(g) * header_bytes(assigns[g[0]]) for g in stages),
        **_replan_by_changes(n, stages, assigns),
    }


def _replan_by_changes(n: int, stages: list[list[str]], held: dict[str, Assign]) -> dict[str, Any]:
    """What the next epoch sends (``reassignments``) when one peer of the middle stage
    was replaced by a standby peer: the peers of its neighbourhood get their changed
    ids, addresses and keys, every other peer only the epoch's own fields; and the time
    the coordinator takes to work that out (seconds of CPU)."""
    replaced = stages[len(stages) // 2][0]
    _, new = _assigns(n, epoch=held[replaced].epoch + 1, swap=replaced)
    t0 = time.process_time()
    outgoing = reassignments(new, held)
    diff_s = time.process_time() - t0
    sizes = [header_bytes(m) for m in outgoing.values()]
    far = outgoing[stages[0][0]]
    return {
        "replan_bytes_one_replaced": sum(sizes),
        "replan_whole_assignments": sum(isinstance(m, Assign) for m in outgoing.values()),
        "reassign_bytes_far_peer": header_bytes(far),
        "reassign_diff_cpu_s": round(diff_s, 3),
    }


def _peer_id(i: int) -> str:
    """A libp2p peer id's length (52 characters, as ``12D3KooW...``)."""
    return f"12D3KooW{i:044d}"


def _assigns(n: int, epoch: int = 3, swap: str = "") -> tuple[list[list[str]], dict[str, Assign]]:
    """A plan of ``n`` peers (``even_plan``) and every planned peer's assignment, with
    the fields the coordinator fills (``coordinator.dispatch._assign_msgs``), for plan
    ``epoch`` (its first step 400 steps an epoch); peer ``swap`` replaced by a new one."""
    ids = iter([_peer_id(i) for i in range(n)])
    stages = [[next(ids) for _ in range(size)] for size in even_plan(n)]
    stages = [[_peer_id(n) if p == swap else p for p in g] for g in stages]
    k = len(stages)
    peers = [p for g in stages for p in g]
    maddrs = {p: [f"/ip4/198.51.{i % 250}.{i % 200}/tcp/{30000 + i % 30000}/p2p/{p}"] for i, p in enumerate(peers)}
    shared = {
        "run_id": RUN,
        "job": {"model": "gpt", "model_args": "n_layer=48,n_embd=1600,n_head=25", "steps": 100000, "micro_batches": 64},
        "cut": [6 * (s + 1) for s in range(k - 1)],
        "specs": [[{"shape": [8, 1024, 1600], "dtype": "float32"}] for _ in range(k)],
        "link_mbps": [0.0] * (k - 1),
        "epoch": epoch,
        "start_step": 400 * epoch,
    }
    keys = {p: hashlib.sha256(p.encode()).hexdigest() for p in peers}  # the same peer's in every epoch
    certs = {p: 1.8e9 + i for i, p in enumerate(peers)}
    return stages, assignments(stages, shared, maddrs, keys, certs, set(peers[::10]))


def main() -> None:
    """The outbound side alone (``discovery.py`` runs it with the inbound side): one JSON object."""
    import argparse

    ap = argparse.ArgumentParser(description="the coordinator's outbound control plane: commits and assignments")
    ap.add_argument("--short", action="store_true", help="2 sinks for 1 s a window (the full mode: 16 for 10 s)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    peers, seconds = (2, 1.0) if args.short else (16, 10.0)
    out: dict[str, Any] = measure_outbound(peers, 40.0 if args.short else 20.0, seconds)
    out.update({f"wire_{n}": wire_costs(n) for n in (1000, 10_000)})
    out["short"] = args.short
    print(json.dumps(out))


if __name__ == "__main__":
    main()
