"""Discovery's cost on loopback: N advertising hivemind ``DHTNode``s and one reader (the
coordinator's node), under today's one-key layout or the sharded one
(``coordinator.discovery_cost``). Each node stores a ~570-byte advert under its
subkey every ``REFRESH_S``; the reader polls every key once a second. Measured per N:
poll time (p50), completeness (adverts found / live, the least of the polls), the
busiest node's bytes served by ``rpc_find`` per second, the reader's bytes per poll.
Projections for 1,000 and 10,000 peers come from the formulas, whose one-key
figures are checked against these measurements.

All nodes run in this one process (each with its own p2p daemon): on a 2-core machine
80 nodes saturate it, as issue 33 saw. ``coordinator_cpu_per_1k_peers`` is measured
here as the CPU of checking 1,000 signed records (the control plane's dominant
per-message cost) at the rates of ``discovery_cost.control_cpu``, not against a
real coordinator process (left to do).

    python benchmarks/discovery.py [--short] [--layout sharded|one_key]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.dht.node import DHTNode  # noqa: E402
from hivemind.dht.protocol import DHTProtocol  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from coordinator import discovery_cost as dc  # noqa: E402
from protocol.trust.identity import Identity, check_record, sign_record  # noqa: E402

REFRESH_S = dc.ADVERT_REFRESH_S
STEP_S = 5.0  # the step the projections assume: each planned peer's step report is its heartbeat
TTL_S = 6.0
POLL_S = 1.0
SERVED: dict[bytes, int] = defaultdict(int)  # node id -> bytes its rpc_find replies carried


def _count_served() -> None:
    """Wrap ``DHTProtocol.rpc_find`` to add each reply's size to its node's count."""
    original = DHTProtocol.rpc_find

    @functools.wraps(original)
    async def rpc_find(self: DHTProtocol, request, context):  # type: ignore[no-untyped-def]
        reply = await original(self, request, context)
        SERVED[self.node_id.to_bytes()] += reply.ByteSize()
        return reply

    DHTProtocol.rpc_find = rpc_find  # type: ignore[method-assign]


def _keys(layout: str, n: int) -> list[str]:
    return ["bench:adverts"] if layout == "one_key" else [f"bench:adverts/{i}" for i in range(dc.shard_count(n))]


async def _advertise(node: DHTNode, keys: list[str], i: int, stop: asyncio.Event) -> None:
    advert = {"peer": i, "maddrs": ["/ip4/127.0.0.1/tcp/0"] * 6, "pad": "x" * 330}
    key = keys[i % len(keys)]
    while not stop.is_set():
        await node.store(key, advert, get_dht_time() + TTL_S, subkey=f"peer-{i}")
        try:
            await asyncio.wait_for(stop.wait(), REFRESH_S)
        except asyncio.TimeoutError:
            pass


async def _measure(n: int, layout: str, seconds: float) -> dict[str, float]:
    reader = await DHTNode.create(cache_locally=False)
    maddrs = [str(a) for a in await reader.get_visible_maddrs()]
    nodes = [await DHTNode.create(initial_peers=maddrs, cache_locally=False) for _ in range(n)]
    keys, stop = _keys(layout, n), asyncio.Event()
    tasks = [asyncio.create_task(_advertise(node, keys, i, stop)) for i, node in enumerate(nodes)]
    await asyncio.sleep(REFRESH_S + 0.5)  # every advert stored once
    SERVED.clear()
    polls, found, sizes, t0 = [], [], [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        start = time.monotonic()
        got = await reader.get_many(keys, sufficient_expiration_time=float("inf"))
        polls.append(time.monotonic() - start)
        values = [v.value for v in got.values() if v is not None and isinstance(v.value, dict)]
        found.append(sum(len(v) for v in values) / n)
        sizes.append(sum(len(str(item.value)) for v in values for item in v.values()))
        await asyncio.sleep(max(0.0, POLL_S - polls[-1]))
    elapsed = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(node.shutdown() for node in [reader, *nodes]), return_exceptions=True)
    return {
        "poll_p50_s": statistics.median(polls),
        "completeness_min": min(found),
        "busiest_holder_kB_s": max(SERVED.values(), default=0) / elapsed / 1e3,
        "coordinator_kB_per_poll": statistics.median(sizes) / 1e3,
    }


def _signature_cpu_per_1k() -> float:
    """CPU seconds to check 1,000 signed records (a heartbeat's or step report's size)."""
    who = Identity.generate()
    record = sign_record(who, {"kind": "beat", "run_id": "bench", "peer_id": "peer-1", "step": 1})
    start = time.process_time()
    for _ in range(1000):
        check_record(record)
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="N = 10, 20 only, brief polls")
    ap.add_argument("--layout", choices=["sharded", "one_key"], default="sharded")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    _count_served()
    ns, seconds = ([10, 20], 2.5) if args.short else ([10, 20, 40, 80], 10.0)
    rows = [asyncio.run(_measure(n, args.layout, seconds)) for n in ns]
    out: dict[str, object] = {"layout": args.layout, "n": ns}
    for k in rows[0]:
        out[k] = [round(r[k], 4) for r in rows]
    loads = [r["busiest_holder_kB_s"] for r in rows]
    out["holder_growth_exponent"] = round(dc.growth_exponent(ns, loads), 3)
    verify_1k = _signature_cpu_per_1k()
    # per 1,000 peers: step reports as heartbeats (a 5 s step), standby beats every 10 s
    rate_1k = dc.control_cpu(1000, 1000, 0.0, STEP_S, dc.STANDBY_BEAT_S) / dc.CONTROL_MESSAGE_CPU_S
    out["coordinator_cpu_per_1k_peers"] = round(rate_1k * verify_1k / 1000, 4)
    out["signature_check_cpu_s_per_1k"] = round(verify_1k, 4)
    out["projected"] = {
        str(m): dc.sharded(m, REFRESH_S, dc.control_cpu(m, m, 0.0, 5.0, 10.0)).as_dict() for m in (1000, 10_000)
    }
    out["projected_one_key"] = {str(m): dc.one_key(m, REFRESH_S).as_dict() for m in (1000, 10_000)}
    out["short"] = args.short
    print(json.dumps(out))


if __name__ == "__main__":
    main()
