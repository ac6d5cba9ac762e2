"""Topologies shipped with the package (``fusionllm sim --topology NAME``).

Three testbeds of 16 GPUs each, 48 in all, like the FusionLLM paper's mix of
data-centre and consumer GPUs on links from 8 Mbit/s to 10 Gbit/s. GPU figures
are sustained mixed-precision training throughput (not datasheet peaks):
A100 120 TFLOP/s 80 GB, V100 60/32, RTX 4090 80/24, RTX 3090 35/24, T4 20/16.

- ``testbed1``: two data centres, 8 A100 and 8 V100, 10 Gbit/s inside each,
  1 Gbit/s (20 ms) between them.
- ``testbed2``: four sites of four mixed consumer GPUs, 1 Gbit/s inside a site,
  50-200 Mbit/s (30-80 ms) between sites.
- ``testbed3``: a lab of 8 RTX 3090 on 10 Gbit/s and 8 home GPUs, each behind its
  own 8-100 Mbit/s uplink (20-120 ms).
- ``lab-crowd``: a lab of 8 A100 on 10 Gbit/s holding two thirds of the FLOP/s,
  and a crowd of 12 home GPUs (RTX 4090, 3090, T4), each behind its own 20-100
  Mbit/s uplink (30-120 ms), 10-50 Mbit/s between homes.
- ``three-regions``: 6 RTX 4090 (1 Gbit/s), 4 V100 (10 Gbit/s) and 8 T4 (1 Gbit/s)
  in three regions, 50-300 Mbit/s (60-150 ms) between them.
- ``homes-30``: 30 home GPUs (RTX 4090, 3090, T4), each its own cluster, 10-100
  Mbit/s (20-80 ms) between homes, and four pairs of neighbours on one fibre
  measured at 1 Gbit/s (2 ms): the held-out shape where the best plan is a pair
  of homes no cluster holds.
- ``internet-1k`` / ``internet-10k``: 1,000 / 10,000 volunteers in 25 / 100
  regions (seeded): 200-1000 Mbit/s inside a region, 8-200 Mbit/s between
  regions, falling with distance.
"""

from __future__ import annotations

import random
from typing import Any

from sim.topology import Topology, parse

GPUS = {"a100": (120.0, 80), "v100": (60.0, 32), "4090": (80.0, 24), "3090": (35.0, 24), "t4": (20.0, 16)}
PRESETS = ("testbed1", "testbed2", "testbed3", "lab-crowd", "three-regions", "homes-30", "internet-1k", "internet-10k")
#: mixed bandwidth: where OP-Fence must win
MIXED = ("testbed1", "testbed2", "testbed3", "lab-crowd", "three-regions", "homes-30")


def _peer(pid: str, gpu: str, cluster: str) -> dict[str, Any]:
    tflops, mem = GPUS[gpu]
    return {"id": pid, "tflops": tflops, "memory_gb": mem, "cluster": cluster}


def _link(mbps: float, ms: float) -> dict[str, float]:
    return {"mbps": mbps, "latency_ms": ms}


def testbed1() -> dict[str, Any]:
    peers = [_peer(f"a{i}", "a100", "dc1") for i in range(8)] + [_peer(f"v{i}", "v100", "dc2") for i in range(8)]
    clusters = {"dc1": {"dc1": _link(10000, 0.1), "dc2": _link(1000, 20)}, "dc2": {"dc2": _link(10000, 0.1)}}
    return {"peers": peers, "clusters": clusters}


def testbed2() -> dict[str, Any]:
    rng = random.Random(2)
    sites = ["s1", "s2", "s3", "s4"]
    kinds = ["4090", "3090", "3090", "t4"]
    peers = [_peer(f"{s}g{i}", kinds[(i + j) % 4], s) for j, s in enumerate(sites) for i in range(4)]
    clusters: dict[str, dict[str, Any]] = {s: {s: _link(1000, 0.5)} for s in sites}
    for i, a in enumerate(sites):
        for b in sites[i + 1 :]:
            clusters[a][b] = _link(rng.choice([50, 100, 200]), rng.choice([30, 50, 80]))
    return {"peers": peers, "clusters": clusters}


def _lab_and_homes(
    seed: int, lab_gpu: str, homes: int, uplinks: tuple[list[int], list[int]], between: list[int]
) -> dict[str, Any]:
    """8 GPUs of one kind in a lab on 10 Gbit/s, and ``homes`` home GPUs each in its own
    cluster: uplinks to the lab drawn from (Mbit/s, ms), links between homes from
    ``between`` Mbit/s (40-120 ms)."""
    rng = random.Random(seed)
    peers = [_peer(f"lab{i}", lab_gpu, "lab") for i in range(8)]
    names = [f"home{i}" for i in range(homes)]
    peers += [_peer(h, ["4090", "3090", "t4"][i % 3], h) for i, h in enumerate(names)]
    clusters: dict[str, dict[str, Any]] = {"lab": {"lab": _link(10000, 0.1)}}
    for i, h in enumerate(names):
        clusters[h] = {h: _link(10000, 0.0)}
        clusters["lab"][h] = _link(rng.choice(uplinks[0]), rng.choice(uplinks[1]))
        for g in names[i + 1 :]:
            clusters[h][g] = _link(rng.choice(between), rng.choice([40, 80, 120]))
    return {"peers": peers, "clusters": clusters}


def testbed3() -> dict[str, Any]:
    return _lab_and_homes(3, "3090", 8, ([8, 20, 50, 100], [20, 40, 80]), [8, 20, 50])


def lab_crowd() -> dict[str, Any]:
    return _lab_and_homes(4, "a100", 12, ([20, 50, 100], [30, 60, 120]), [10, 20, 50])


def three_regions() -> dict[str, Any]:
    peers = [_peer(f"eu{i}", "4090", "eu") for i in range(6)]
    peers += [_peer(f"us{i}", "v100", "us") for i in range(4)]
    peers += [_peer(f"ap{i}", "t4", "ap") for i in range(8)]
    clusters = {
        "eu": {"eu": _link(1000, 0.5), "us": _link(300, 60), "ap": _link(50, 150)},
        "us": {"us": _link(10000, 0.1), "ap": _link(100, 110)},
        "ap": {"ap": _link(1000, 0.5)},
    }
    return {"peers": peers, "clusters": clusters}


def homes(count: int, fibre_pairs: int, seed: int) -> dict[str, Any]:
    """``count`` home GPUs, each its own cluster, 10-100 Mbit/s (20-80 ms) between
    them, and ``fibre_pairs`` disjoint pairs of neighbours measured at 1 Gbit/s (2 ms)."""
    rng = random.Random(seed)
    names = [f"home{i}" for i in range(count)]
    peers = [_peer(h, rng.choice(["4090", "3090", "3090", "t4"]), h) for h in names]
    clusters: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(names):
        clusters[a] = {a: _link(10000, 0.0)}
        for b in names[i + 1 :]:
            clusters[a][b] = _link(rng.choice([10, 20, 50, 100]), rng.choice([20, 40, 80]))
    paired = rng.sample(names, 2 * fibre_pairs)
    links = [{"src": a, "dst": b, **_link(1000, 2)} for a, b in zip(paired[::2], paired[1::2])]
    return {"peers": peers, "clusters": clusters, "links": links}


def internet(num_peers: int, regions: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(regions)]
    where = {r: (rng.random(), rng.random()) for r in names}
    weights = [rng.uniform(0.2, 1.0) for _ in names]
    peers = []
    for i in range(num_peers):
        region = rng.choices(names, weights)[0]
        peers.append(_peer(f"p{i}", rng.choice(list(GPUS)), region))
    clusters: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(names):
        clusters[a] = {a: _link(rng.choice([200, 500, 1000]), 2)}
        for b in names[i + 1 :]:
            d = ((where[a][0] - where[b][0]) ** 2 + (where[a][1] - where[b][1]) ** 2) ** 0.5
            clusters[a][b] = _link(round(max(8.0, 200 * (1 - d / 1.42) ** 2), 1), round(10 + 150 * d, 1))
    used = {p["cluster"] for p in peers}
    clusters = {a: {b: v for b, v in row.items() if b in used} for a, row in clusters.items() if a in used}
    return {"peers": peers, "clusters": clusters}


def preset(name: str) -> Topology:
    builders = {
        "testbed1": testbed1,
        "testbed2": testbed2,
        "testbed3": testbed3,
        "lab-crowd": lab_crowd,
        "three-regions": three_regions,
        "homes-30": lambda: homes(30, 4, 30),
        "internet-1k": lambda: internet(1000, 25, 1),
        "internet-10k": lambda: internet(10000, 100, 2),
    }
    if name not in builders:
        raise KeyError(name)
    return parse(builders[name](), name)
