"""Topology files and presets: peers (TFLOP/s, memory, cluster) and the bandwidth
and latency between and within clusters, with per-pair overrides.

File format (JSON)::

    {"peers": [{"id": "a1", "tflops": 35.0, "memory_gb": 24, "cluster": "A", "op_overhead_us": 10}, ...],
     "clusters": {"A": {"A": {"mbps": 10000, "latency_ms": 0.1},
                        "B": {"mbps": 100, "latency_ms": 40}}, ...},
     "links": [{"src": "a1", "dst": "b3", "mbps": 8, "latency_ms": 120}]}

``clusters`` is symmetric unless both directions are given; ``links`` overrides
single pairs (both directions); ``op_overhead_us`` (optional) is a peer's fixed cost
per operator kernel (``coordinator.estimator.OP_OVERHEAD_S`` when absent). Every
error names the field it is in.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.netmodel import OP_OVERHEAD_S, Network, PeerProfile


class TopologyError(ValueError):
    """A topology file that cannot be used; ``str()`` names the field."""


@dataclass
class Topology:
    peers: list[PeerProfile]
    network: Network
    name: str = ""

    def probes(self, per_peer: int = 3, seed: int = 0) -> dict[tuple[str, str], tuple[float, float]]:
        """What peers would measure probing ``per_peer`` random others each."""
        rng = random.Random(seed)
        ids = [p.id for p in self.peers]
        out: dict[tuple[str, str], tuple[float, float]] = {}
        for a in ids:
            for b in rng.sample(ids, min(per_peer + 1, len(ids))):
                if a != b:
                    link = self.network.link(a, b)
                    out[(a, b)] = (link.mbps, link.latency_s)
        return out


def _num(obj: dict[str, Any], key: str, where: str, minimum: float = 0.0) -> float:
    if key not in obj:
        raise TopologyError(f"{where}: missing '{key}'")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= minimum or v != v or v == float("inf"):
        raise TopologyError(f"{where}.{key}: {v!r} is not a number >= {minimum:g}")
    return float(v)


def parse(data: Any, name: str = "") -> Topology:
    """A topology from its JSON value; raises TopologyError naming the bad field."""
    if not isinstance(data, dict):
        raise TopologyError("the topology must be a JSON object")
    peers = _peers(data.get("peers"))
    clusters = _clusters(data.get("clusters", {}), {p.cluster for p in peers})
    overrides = _links(data.get("links", []), {p.id for p in peers})
    cluster_of = {p.id: p.cluster for p in peers}
    network = Network(cluster_of, clusters, overrides, measured=set(overrides), default=_slowest(clusters))
    return Topology(peers, network, name)


def _peers(peers_raw: Any) -> list[PeerProfile]:
    """The ``peers`` list: each one's id, cluster, TFLOP/s, memory and kernel overhead."""
    if not isinstance(peers_raw, list) or not peers_raw:
        raise TopologyError("peers: must be a non-empty list")
    peers: list[PeerProfile] = []
    seen: set[str] = set()
    for i, p in enumerate(peers_raw):
        where = f"peers[{i}]"
        if not isinstance(p, dict):
            raise TopologyError(f"{where}: must be an object")
        pid = p.get("id")
        if not isinstance(pid, str) or not pid:
            raise TopologyError(f"{where}.id: must be a non-empty string")
        if pid in seen:
            raise TopologyError(f"{where}.id: '{pid}' appears twice")
        seen.add(pid)
        cluster = p.get("cluster", pid)
        if not isinstance(cluster, str):
            raise TopologyError(f"{where}.cluster: must be a string")
        tflops = _num(p, "tflops", where, 1e-6)
        memory = _num(p, "memory_gb", where, 0.0)
        overhead = _num(p, "op_overhead_us", where, 0.0) / 1e6 if "op_overhead_us" in p else OP_OVERHEAD_S
        peers.append(PeerProfile(pid, tflops * 1e12, int(memory * 2**30), cluster, overhead))
    return peers


def _clusters(clusters_raw: Any, known: set[str]) -> dict[tuple[str, str], tuple[float, float]]:
    """The ``clusters`` matrix: (Mbit/s, latency s) per pair, both ways unless both are given."""
    if not isinstance(clusters_raw, dict):
        raise TopologyError("clusters: must be an object of objects")
    clusters: dict[tuple[str, str], tuple[float, float]] = {}
    for a, row in clusters_raw.items():
        if not isinstance(row, dict):
            raise TopologyError(f"clusters.{a}: must be an object")
        for b, link in row.items():
            where = f"clusters.{a}.{b}"
            if not isinstance(link, dict):
                raise TopologyError(f"{where}: must be an object with mbps and latency_ms")
            value = (_num(link, "mbps", where, 1e-6), _num(link, "latency_ms", where, 0.0) / 1000)
            clusters[(a, b)] = value
            clusters.setdefault((b, a), value)
    for a, b in clusters:
        for c in (a, b):
            if c not in known:
                raise TopologyError(f"clusters.{a}.{b}: no peer is in cluster '{c}'")
    return clusters


def _links(links_raw: Any, seen: set[str]) -> dict[tuple[str, str], tuple[float, float]]:
    """The ``links`` list: single pairs of peers that override their clusters' link."""
    overrides: dict[tuple[str, str], tuple[float, float]] = {}
    if not isinstance(links_raw, list):
        raise TopologyError("links: must be a list")
    for i, link in enumerate(links_raw):
        where = f"links[{i}]"
        if not isinstance(link, dict):
            raise TopologyError(f"{where}: must be an object")
        for end in ("src", "dst"):
            if link.get(end) not in seen:
                raise TopologyError(f"{where}.{end}: no peer '{link.get(end)}'")
        overrides[(link["src"], link["dst"])] = (
            _num(link, "mbps", where, 1e-6),
            _num(link, "latency_ms", where) / 1000,
        )
    return overrides


def _slowest(clusters: dict[tuple[str, str], tuple[float, float]]) -> tuple[float, float]:
    """Pairs of clusters the file leaves out get its slowest link."""
    if not clusters:
        return (100.0, 0.05)
    return min(clusters.values(), key=lambda v: v[0])


def load(path: str | Path) -> Topology:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise TopologyError(f"cannot read {p}: {exc.strerror}") from None
    except ValueError as exc:
        raise TopologyError(f"{p} is not JSON: {exc}") from None
    return parse(data, p.stem)
