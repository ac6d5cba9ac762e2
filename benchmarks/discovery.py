"""Discovery's cost on loopback: N advertising hivemind ``DHTNode``s and one reader (the
coordinator's node), under the live sharded layout (``<run>:adverts/<i>``, as many
shards as ``discovery_cost.shard_count(N)``, each node under ``shard_of`` its id) and,
for comparison, the old one-key layout. Each node stores a signed ~570-byte advert at
a peer's pace (``peer.adverts.RefreshPace``: ``REFRESH_S`` from one store's start to
the next, each copy living ``TTL_S`` from when it is expected to land); the reader
polls every key once a second with the coordinator's own read
(``protocol.net.records.read_node``: the latest of each shard, one lookup).
Measured per N: poll time (p50), completeness (the least over the polls of the adverts
the coordinator counts, found by this poll or by an earlier one and not yet expired,
over N, after one read uncounted: a coordinator polls from its start;
``lookup_completeness_min``: found by the poll's lookup alone), the busiest node's
bytes served by ``rpc_find`` per second, the bytes of the replies the reader
received per poll, how long the stores took (``store_p50_s``, ``store_max_s``) and the
longest a node's advert had expired when its next copy was stored
(``advert_lapse_max_s``: 0 when every advert stayed alive); beside them the
formulas' figures (``formula_busiest_holder_kB_s``), and the formulas' projections
for 1,000 and 10,000.

One swarm per layout is grown through the sizes, as a swarm grows: at each size the
new nodes join and the earlier ones move their advert to its shard of the new count,
as peers follow a re-shard (starting 150 p2p daemons for 10+20+40+80 fresh swarms took
most of the run). The advertising nodes run in worker processes of
``NODES_PER_WORKER`` (each node with its own p2p daemon), the reader in this one: with
all 80 in the reader's event loop it was starved, and its polls found half the adverts
or none. Polls start once every node's first store at the size was taken (and, where
nodes of a later worker joined after an earlier one's stores, one refresh later).
``coordinator_cpu_per_1k_peers`` comes from a real coordinator process under a
synthetic load of signed heartbeats (``benchmarks/control_plane.py``) and from a real
transport sending a step's commits (``commit_cpu_s_per_message``; each sealed and sent
in turn, as before: ``commit_in_turn_cpu_s_per_message``), at the rates of 1,000
peers; ``wire_10k``: one commit's and one assignment's size and sealing at 10,000.

    python benchmarks/discovery.py [--short] [--layout both|sharded|one_key] [--n 40 80]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.dht.node import DHTNode  # noqa: E402
from hivemind.dht.protocol import DHTProtocol  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from benchmarks import control_plane  # noqa: E402
from coordinator import discovery_cost as dc  # noqa: E402
from peer.adverts import RefreshPace  # noqa: E402
from protocol.net.records import read_node  # noqa: E402
from protocol.trust.identity import Identity, check_record, sign_record  # noqa: E402
from protocol.trust.run_records import record_subkey, shard_name, shard_of  # noqa: E402
from protocol.wire.messages import PROTOCOL_VERSION, Advert, dht_key  # noqa: E402

REFRESH_S = dc.ADVERT_REFRESH_S
STEP_S = 5.0  # the step the projections assume: each planned peer's step report is its heartbeat
TTL_S = 3 * REFRESH_S  # an advert's lifetime (peer.config's advert ttl), from when its copy lands
POLL_S = 1.0
RUN = "bench"
#: the longest every node's first store may take before the polls start
STORED_WITHIN_S = 60.0
#: advertising nodes per worker process: the reader polls from the main process (80
#: nodes in the reader's own event loop starved it: its polls found half the adverts,
#: or none, and at 80 the nodes' bootstrap pings to it went unanswered)
NODES_PER_WORKER = 20
#: nodes started at once (each starts a p2p daemon), and how long a daemon may take
#: to start (a loaded machine takes longer than hivemind's default 15 s)
START_BATCH = 5
P2P_ARGS = {"startup_timeout": 60.0}
logger = logging.getLogger("discovery")
SERVED: dict[bytes, int] = defaultdict(int)  # node id -> bytes its rpc_find replies carried
READ: dict[str, int] = defaultdict(int)  # requester's peer id -> bytes of rpc_find replies it was sent
STORES: list[float] = []  # seconds each store took, while the polls run
LAPSES: list[float] = []  # seconds a node's last copy had expired when its next one was stored, while the polls run


def _count_served() -> None:
    """Wrap ``DHTProtocol.rpc_find`` to add each reply's size to its node's count and
    to its requester's."""
    original = DHTProtocol.rpc_find

    @functools.wraps(original)
    async def rpc_find(self: DHTProtocol, request, context):  # type: ignore[no-untyped-def]
        reply = await original(self, request, context)
        SERVED[self.node_id.to_bytes()] += reply.ByteSize()
        READ[str(context.remote_id)] += reply.ByteSize()
        return reply

    DHTProtocol.rpc_find = rpc_find  # type: ignore[method-assign]


def _names(layout: str, n: int) -> list[str]:
    """The run's advert keys (names) under ``layout`` for ``n`` peers."""
    return ["adverts"] if layout == "one_key" else [shard_name("adverts", i) for i in range(dc.shard_count(n))]


def _advert(who: Identity, peer_id: str, expires: float) -> dict[str, object]:
    """A signed advert of the live swarm's size (~570 bytes)."""
    maddrs = [f"/ip4/127.0.0.1/tcp/{40000 + i}/p2p/{peer_id}" for i in range(2)]
    ad = Advert(peer_id, maddrs, "cpu", 1e12, 8 << 30, 100.0, 100.0, "2.4.0", PROTOCOL_VERSION, expires)
    return sign_record(who, {**ad.header(), "run_id": RUN})


async def _advertise(
    node: DHTNode, who: Identity, names: list[str], stored: asyncio.Event, stop: asyncio.Event
) -> None:
    """Store this node's advert under its shard at ``peer.adverts.RefreshPace``'s pace
    (what a peer does), noting how long each store took and, while the polls run, how
    long its last copy had expired when the next one was stored (``LAPSES``)."""
    peer_id = str(node.peer_id)
    name = "adverts" if names == ["adverts"] else shard_name("adverts", shard_of(peer_id, len(names)))
    subkey = record_subkey("adverts", who.public_hex, peer_id)
    pace, alive_until = RefreshPace(TTL_S), None
    while not stop.is_set():
        started, expires = time.monotonic(), get_dht_time() + pace.lifetime()
        ok = await node.store(dht_key(RUN, name), _advert(who, peer_id, expires), expires, subkey=subkey)
        took = time.monotonic() - started
        pace.stored(took)
        if ok:
            stored.set()  # (a loaded machine's first stores may time out: none took it)
            if SERVED:  # counting: the polls are on
                STORES.append(took)
                if alive_until is not None:
                    LAPSES.append(max(0.0, get_dht_time() - alive_until))
            alive_until = expires
        try:
            await asyncio.wait_for(stop.wait(), pace.wait(took))
        except asyncio.TimeoutError:
            pass


def _worker(conn: Connection) -> None:
    """A process of advertising nodes, told by ``conn`` where the reader is, how many
    nodes to have and under which keys, when to count and when to stop; it answers its
    counts."""
    try:
        asyncio.run(_work(conn))
    finally:
        conn.close()


async def _recv(conn: Connection, within: float) -> Any:
    """The next thing ``conn`` says, awaited off the event loop; RuntimeError if nothing within ``within`` s."""
    got = await asyncio.get_running_loop().run_in_executor(None, lambda: conn.recv() if conn.poll(within) else None)
    if got is None:
        raise RuntimeError(f"no word from the other process within {within:.0f} s")
    return got


async def _node(initial: list[str], tries: int = 3) -> DHTNode:
    """A node bootstrapped from ``initial``, tried again where none of them answered its
    ping in time (a loaded machine's daemon may not)."""
    for attempt in range(tries):
        try:
            return await DHTNode.create(initial_peers=initial, cache_locally=False, **P2P_ARGS)
        except RuntimeError as exc:
            if "bootstrap failed" not in str(exc) or attempt == tries - 1:
                raise
            logger.info("a node's bootstrap failed (%s); again", exc)
    raise AssertionError("unreachable")


class _Advertisers:
    """A worker's nodes and their advert loops (one ``stop`` for the loops of a round)."""

    def __init__(self) -> None:
        self.nodes: list[DHTNode] = []
        self.keys: list[Identity] = []  # each node's signing key, kept as it moves shards
        self.tasks: list[asyncio.Task[None]] = []
        self.stop = asyncio.Event()

    async def grow(self, maddrs: list[str], count: int, names: list[str]) -> None:
        """Have ``count`` nodes, each advertising under its shard of ``names`` (a grown
        swarm's new count: its old nodes move, as peers follow a re-shard), every one
        stored once."""
        while len(self.nodes) < count:
            batch = min(START_BATCH, count - len(self.nodes))
            self.nodes += await asyncio.gather(*(_node(maddrs) for _ in range(batch)))
        self.keys += [Identity.generate() for _ in range(len(self.nodes) - len(self.keys))]
        await self.halt()
        self.stop, stored = asyncio.Event(), [asyncio.Event() for _ in self.nodes]
        self.tasks = [
            asyncio.create_task(_advertise(node, who, names, ev, self.stop))
            for node, who, ev in zip(self.nodes, self.keys, stored)
        ]
        # every advert stored once before the polls count (a loaded machine's first stores are slow)
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in stored)), STORED_WITHIN_S)

    async def halt(self) -> None:
        """End the advert loops once their stores under way end (a cancelled store leaves
        hivemind's lookup tasks pending: "Task was destroyed but it is pending!")."""
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def aclose(self) -> None:
        await self.halt()
        await asyncio.gather(*(node.shutdown() for node in self.nodes), return_exceptions=True)


async def _work(conn: Connection) -> None:
    maddrs, reader_id = await _recv(conn, 600)
    ads = _Advertisers()
    try:
        while True:
            what, *args = await _recv(conn, 3600)
            if what == "grow":
                await ads.grow(maddrs, *args)
                conn.send("stored")
            elif what == "go":
                for counts in (SERVED, READ, STORES, LAPSES):
                    counts.clear()
            elif what == "stop":
                conn.send((list(SERVED.values()), READ.get(reader_id, 0), list(STORES), max(LAPSES, default=0.0)))
            else:
                return
    finally:
        await ads.aclose()


def _shares(n: int) -> list[int]:
    """Nodes per worker for a swarm of ``n``: workers filled to ``NODES_PER_WORKER`` in
    turn (a grown swarm adds nodes to the last worker, then new workers)."""
    return [min(NODES_PER_WORKER, n - i) for i in range(0, n, NODES_PER_WORKER)]


def _measure(ns: list[int], layout: str, seconds: float) -> list[dict[str, float]]:
    """One swarm grown through each size of ``ns`` (ascending), its advertising nodes in
    worker processes (``NODES_PER_WORKER`` each), polled from this one at each size."""
    ctx, procs, pipes = multiprocessing.get_context("fork"), [], []

    def add_worker() -> Connection:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(theirs,), daemon=True)
        proc.start()
        theirs.close()
        procs.append(proc)
        pipes.append(mine)
        return mine

    try:
        return asyncio.run(_grow_and_poll(add_worker, pipes, sorted(ns), layout, seconds))
    finally:
        for conn in pipes:
            try:
                conn.send(("end",))
            except OSError:
                pass
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


async def _grow_and_poll(
    add_worker: Any, pipes: list[Connection], ns: list[int], layout: str, seconds: float
) -> list[dict[str, float]]:
    """The reader: grows the swarm to each size of ``ns`` and polls it."""
    reader = await DHTNode.create(cache_locally=False, **P2P_ARGS)
    rows = []
    try:
        maddrs = [str(a) for a in await reader.get_visible_maddrs()]
        for n in ns:
            names, t0, shares = _names(layout, n), time.monotonic(), _shares(n)
            for w, count in enumerate(shares):  # a worker at a time: 80 bootstraps at once went unanswered
                if w == len(pipes):
                    add_worker().send((maddrs, str(reader.peer_id)))
                pipes[w].send(("grow", count, names))
                await _recv(pipes[w], 3 * STORED_WITHIN_S)
            stored_s = time.monotonic() - t0
            if len(shares) > 1:
                # nodes of a later worker joined after an earlier worker's stores: one more refresh of
                # every advert (nodes that joined after a store are nearer some keys than their holders,
                # and until the next refresh a lookup met them first and missed adverts). In one worker,
                # every store of the size came after every join
                await asyncio.sleep(REFRESH_S + 1.0)
            rows.append({**await _poll(reader, pipes, n, names, seconds), "first_stores_s": stored_s})
    finally:
        await reader.shutdown()
    return rows


async def _poll(reader: DHTNode, pipes: list[Connection], n: int, names: list[str], seconds: float) -> dict[str, float]:
    """Polls every key of ``names`` once a second for ``seconds``; the round's figures."""
    keys = [dht_key(RUN, name) for name in names]
    SERVED.clear()
    for conn in pipes:
        conn.send(("go",))
    # the coordinator polls from its start: its count always has the poll before (one read here)
    seen = {k: float(v.get("expires_at", 0.0)) for k, v in (await read_node(reader, keys)).items()}
    polls, found, kept, t0 = [], [], [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        start = time.monotonic()
        got = await read_node(reader, keys)
        polls.append(time.monotonic() - start)
        found.append(len(got) / n)
        seen.update({k: float(v.get("expires_at", 0.0)) for k, v in got.items()})
        now = get_dht_time()
        kept.append(min(n, sum(1 for e in seen.values() if e > now)) / n)  # as the coordinator's book counts
        banned = sum(1 for _ in reader.blacklist.banned_peers.items())
        logger.info("poll %d: %d of %d adverts in %.3f s (%d banned)", len(polls), len(got), n, polls[-1], banned)
        await asyncio.sleep(max(0.0, POLL_S - polls[-1]))
    elapsed = time.monotonic() - t0
    for conn in pipes:
        conn.send(("stop",))
    counts = await asyncio.gather(*(_recv(conn, 60) for conn in pipes))
    served = [*SERVED.values(), *(v for node_counts, _, _, _ in counts for v in node_counts)]
    stores = sorted(t for _, _, took, _ in counts for t in took) or [0.0]
    return {
        "poll_p50_s": statistics.median(polls),
        "completeness_min": min(kept),
        "lookup_completeness_min": min(found),
        "busiest_holder_kB_s": max(served, default=0) / elapsed / 1e3,
        "coordinator_kB_per_poll": sum(read for _, read, _, _ in counts) / len(polls) / 1e3,
        "store_p50_s": stores[len(stores) // 2],
        "store_max_s": stores[-1],
        "advert_lapse_max_s": max(lapse for _, _, _, lapse in counts),
    }


def _signature_cpu_per_1k() -> float:
    """CPU seconds to check 1,000 signed records (a heartbeat's or step report's size)."""
    who = Identity.generate()
    record = sign_record(who, {"kind": "beat", "run_id": "bench", "peer_id": "peer-1", "step": 1})
    start = time.process_time()
    for _ in range(1000):
        check_record(record)
    return time.process_time() - start


def _control_plane(short: bool, coordinator: control_plane.Coordinator) -> dict[str, object]:
    """The coordinator's CPU per control message under a synthetic load
    (``benchmarks.control_plane``), at the rates of 1,000 peers: with each planned
    peer's step reports as its heartbeat (what ``peer.link`` does), and with a
    heartbeat a second besides (before)."""
    peers, rate, seconds = (2, 40.0, 2.0) if short else (16, 20.0, 10.0)
    got = coordinator.measure(peers, rate, seconds)
    per_message = got["coordinator_tree_cpu_s_per_message"]
    sent = control_plane.measure_outbound(peers, rate, seconds / 2 if short else seconds)
    per_commit = sent["commit_send_each_cpu_s"]
    commits = 1000 / STEP_S  # a step's commit to each planned peer
    inbound = dc.control_cpu(1000, 1000, 0.0, STEP_S, dc.STANDBY_BEAT_S) - commits * dc.COMMIT_CPU_S
    beating = dc.control_cpu(1000, 1000, 1.0, STEP_S, dc.STANDBY_BEAT_S) - commits * dc.COMMIT_CPU_S
    reports_only, beats = inbound / dc.CONTROL_MESSAGE_CPU_S, beating / dc.CONTROL_MESSAGE_CPU_S
    verify_1k = _signature_cpu_per_1k()
    return {
        "coordinator_cpu_per_1k_peers": round(reports_only * per_message + commits * per_commit, 4),
        "coordinator_cpu_per_1k_peers_beating": round(beats * per_message + commits * per_commit, 4),
        "coordinator_cpu_s_per_message": round(per_message, 6),
        "coordinator_python_cpu_s_per_message": round(got["coordinator_cpu_s_per_message"], 6),
        "formula_cpu_s_per_message": dc.CONTROL_MESSAGE_CPU_S,
        "control_messages": got["control_messages"],
        "commit_cpu_s_per_message": round(per_commit, 6),
        "commit_python_cpu_s_per_message": round(sent["commit_send_each_python_cpu_s"], 6),
        "commit_in_turn_cpu_s_per_message": round(sent["commit_in_turn_cpu_s"], 6),
        "formula_commit_cpu_s": dc.COMMIT_CPU_S,
        "commits_sent": sent["commits_send_each"] + sent["commits_in_turn"],
        "wire_10k": control_plane.wire_costs(10_000),
        "signature_check_cpu_s_per_1k": round(verify_1k, 4),
    }


def _layout(layout: str, ns: list[int], seconds: float) -> dict[str, object]:
    """One layout measured at each of ``ns``, with its formula's figures beside."""
    rows = _measure(ns, layout, seconds)
    out: dict[str, object] = {k: [round(r[k], 4) for r in rows] for k in rows[0]}
    loads = [r["busiest_holder_kB_s"] for r in rows]
    out["holder_growth_exponent"] = round(dc.growth_exponent(ns, loads), 3)
    model = dc.one_key if layout == "one_key" else dc.sharded
    out["formula_busiest_holder_kB_s"] = [round(model(n, REFRESH_S).busiest_holder_kB_s, 2) for n in ns]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="N = 10, 20 only, brief polls, the sharded layout only")
    ap.add_argument("--layout", choices=["sharded", "one_key", "both"], default="both")
    ap.add_argument("--n", type=int, nargs="+", help="the swarm sizes (default: 10 20 40 80; short: 10 20)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logger.setLevel(logging.INFO if os.environ.get("DISCOVERY_VERBOSE") else logging.ERROR)
    _count_served()
    ns, seconds = ([10, 20], 2.0) if args.short else ([10, 20, 40, 80], 10.0)
    ns = sorted(args.n or ns)
    main_layout = "one_key" if args.layout == "one_key" else "sharded"
    # the control plane's coordinator starts now, its start beside the swarms' (it idles, waiting for peers)
    wall, t0, coordinator = {}, time.monotonic(), control_plane.Coordinator()
    try:
        out: dict[str, object] = {"layout": main_layout, "n": ns, **_layout(main_layout, ns, seconds)}
        wall[main_layout], t0 = time.monotonic() - t0, time.monotonic()
        if args.layout == "both" and not args.short:
            out["one_key"] = _layout("one_key", ns, seconds)
            wall["one_key"], t0 = time.monotonic() - t0, time.monotonic()
    except BaseException:
        coordinator.close()
        raise
    out.update(_control_plane(args.short, coordinator))
    wall["control_plane"] = time.monotonic() - t0
    out["wall_s"] = {k: round(v, 1) for k, v in wall.items()}  # where the run's time went
    out["projected"] = {str(m): dc.swarm_cost(m, m, STEP_S).as_dict() for m in (1000, 10_000)}
    out["projected_one_key"] = {str(m): dc.one_key(m, REFRESH_S).as_dict() for m in (1000, 10_000)}
    out["short"] = args.short
    print(json.dumps(out))


if __name__ == "__main__":
    main()
