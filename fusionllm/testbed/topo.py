"""What the testbed emulates, as pure data: a topology (a ``sim.topology`` file or one
of the testbed's presets; at most ``MAX_PEERS`` peers, as each is a process on this
machine), the address of each host on the testbed's bridge, the rate and latency of
every ordered pair, and how the topology's FLOP/s map onto this machine's cores."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coordinator.overheads import LIVE, STEP_CALLS, Overheads, slowed
from sim.topology import Topology, TopologyError, load, parse

#: each peer is a process (and a p2p daemon) on this machine
MAX_PEERS = 8
#: the testbed's bridge: the coordinator on .1, the peers from .10 on
SUBNET = "10.78.0"
COORDINATOR_IP = f"{SUBNET}.1"
#: the share of the machine's cores the throttled peers may demand together (the rest
#: is for the coordinator, the p2p daemons, encoding and signing)
CORE_BUDGET = 0.75
#: what the fastest peer of a topology delivers here, FLOP/s (one thread of this machine
#: delivers ~5-10 GFLOP/s on the default model): fixed, so that each scheduler's plan is
#: the same from run to run however busy the machine was when it was measured
TOP_FLOPS = 2e9


class TestbedError(ValueError):
    """A testbed that cannot be built or run; ``str()`` says why in one line."""


def _peer(pid: str, tflops: float, cluster: str) -> dict[str, Any]:
    return {"id": pid, "tflops": tflops, "memory_gb": 8, "cluster": cluster, "op_overhead_us": 0}


def _link(mbps: float, ms: float) -> dict[str, float]:
    return {"mbps": mbps, "latency_ms": ms}


def _two_sites(fast: tuple[str, str, int], slow: tuple[str, str, int], between_mbps: float) -> dict[str, Any]:
    """Two sites, 1 Gbit/s inside each and ``between_mbps`` between: ``fast``'s peers
    (name prefix, site, count) twice as fast as ``slow``'s."""
    (fp, fa, fn), (sp, sa, sn) = fast, slow
    peers = [_peer(f"{fp}{i}", 2.0, fa) for i in range(fn)] + [_peer(f"{sp}{i}", 1.0, sa) for i in range(sn)]
    clusters = {fa: {fa: _link(1000, 0.2), sa: _link(between_mbps, 10)}, sa: {sa: _link(1000, 0.2)}}
    return {"peers": peers, "clusters": clusters}


def two_clusters() -> dict[str, Any]:
    """4 peers in 2 clusters, 1 Gbit/s inside each and 20 Mbit/s between: a lab with one
    peer twice as fast as each of the three of a second site."""
    return _two_sites(("a", "A", 1), ("b", "B", 3), 20)


def mixed_seven() -> dict[str, Any]:
    """7 peers on three sites: a fast pair at a lab, three at a second site on 1 Gbit/s
    LAN, two homes; 100 Mbit/s between the sites and 20 Mbit/s to the homes."""
    peers = [_peer("lab0", 2.0, "lab"), _peer("lab1", 2.0, "lab")]
    peers += [_peer(f"uni{i}", 1.0, "uni") for i in range(3)] + [_peer(f"home{i}", 1.0, f"h{i}") for i in range(2)]
    clusters: dict[str, dict[str, Any]] = {
        "lab": {"lab": _link(1000, 0.2), "uni": _link(100, 10), "h0": _link(20, 15), "h1": _link(20, 15)},
        "uni": {"uni": _link(1000, 0.2), "h0": _link(20, 15), "h1": _link(20, 15)},
        "h0": {"h0": _link(1000, 0.2), "h1": _link(20, 20)},
        "h1": {"h1": _link(1000, 0.2)},
    }
    return {"peers": peers, "clusters": clusters}


def homes_seven(home_mbps: float = 10) -> dict[str, Any]:
    """``mixed-7`` with the homes on ``home_mbps`` uplinks (a home's upload is often
    10 Mbit/s): a plan that puts the homes where the pipeline's bytes cross, or makes
    every peer a replica of the whole model, pays for it. On ``mixed-7`` the estimator
    prices the best bandwidth-blind plan only 1.30x OP-Fence's; here 1.58x (and
    ``petals``, every peer a replica, 1.89x)."""
    topo = mixed_seven()
    clusters = topo["clusters"]
    for site in ("lab", "uni"):
        clusters[site]["h0"] = clusters[site]["h1"] = _link(home_mbps, 15)
    clusters["h0"]["h1"] = _link(home_mbps, 20)
    return topo


def slow_link() -> dict[str, Any]:
    """``two-clusters`` with 5 Mbit/s between the sites: every peer is used, so some
    boundary (or replica pair) crosses the slow link, and with the default model a
    micro-batch's activations take longer on it than any stage computes one (``auto``
    must put a codec there)."""
    topo = two_clusters()
    topo["clusters"]["A"]["B"] = _link(5, 10)
    return topo


def far_lab() -> dict[str, Any]:
    """8 peers on two sites 1 Mbit/s apart (a home uplink, a congested path between
    continents): a lab of two peers twice as fast as each of the six at a second site,
    1 Gbit/s inside each. No plan avoids the slow link: a pipeline's boundary between
    the sites, where a micro-batch's activations take longer than a stage computes one,
    is where ``auto`` puts a codec; a plan that puts one site's replicas beside the
    other's, or every peer a replica of the whole model, sends its gradients over it.
    (At 5 Mbit/s OP-Fence kept its boundary inside the second site once the links sent
    nothing early, and no codec paid.)"""
    return _two_sites(("lab", "lab", 2), ("site", "site", 6), 1)


PRESETS = {
    "two-clusters": two_clusters,
    "mixed-7": mixed_seven,
    "homes-7": homes_seven,
    "slow-link": slow_link,
    "far-lab": far_lab,
}


def load_topology(spec: str) -> Topology:
    """A preset by name or a topology file (``sim.topology``'s format); TestbedError in one line."""
    try:
        topo = parse(PRESETS[spec](), spec) if spec in PRESETS else load(spec) if Path(spec).is_file() else None
    except (TopologyError, OSError, ValueError) as exc:
        raise TestbedError(f"--topology {spec}: {exc}") from None
    if topo is None:
        raise TestbedError(f"--topology {spec}: no such file or preset (presets: {', '.join(PRESETS)})")
    if not 2 <= len(topo.peers) <= MAX_PEERS:
        raise TestbedError(f"--topology {spec}: {len(topo.peers)} peers; the testbed runs 2 to {MAX_PEERS}")
    return topo


def addresses(topo: Topology) -> dict[str, str]:
    """Each peer's address on the bridge, in the topology's order."""
    return {p.id: f"{SUBNET}.{10 + i}" for i, p in enumerate(topo.peers)}


def pairs(topo: Topology) -> dict[tuple[str, str], tuple[float, float]]:
    """(Mbit/s, one-way latency in ms) of every ordered pair of peers."""
    out = {}
    for a in topo.peers:
        for b in topo.peers:
            if a.id != b.id:
                link = topo.network.link(a.id, b.id)
                out[(a.id, b.id)] = (link.mbps, link.latency_s * 1e3)
    return out


def delay_table(topo: Topology, src: str) -> str:
    """``FUSIONLLM_LINK_DELAY_MS`` for peer ``src``: each other peer's address and latency."""
    ips = addresses(topo)
    rows = [f"{ips[b]}={ms:g}" for (a, b), (_, ms) in pairs(topo).items() if a == src and ms > 0]
    return ",".join(rows)


@dataclass(frozen=True)
class ComputeMap:
    """How the topology's FLOP/s became this machine's: each peer runs one thread whose
    delivered FLOP/s on the model (``base_flops``) is throttled to ``throttles[id]``,
    in proportion to its TFLOP/s; ``cores_used`` is what they demand together."""

    base_flops: float
    throttles: dict[str, float]
    cores: int
    #: the peers' optimizer took this many times ``overheads.LIVE``'s (slowed by the
    #: throttle) in the calibration run (``plans.optimizer_scale``; 1.0: not measured)
    optimizer_scale: float = 1.0
    #: a compute call's own work in seconds (``plans.fit_compute``), which the peers'
    #: throttle leaves unstretched (``join --throttle-call-ms``)
    call_s: float = 0.0

    def overheads(self, pid: str) -> Overheads:
        """Peer ``pid``'s fixed costs: a live swarm's (``overheads.LIVE``) with the
        optimizer as calibrated (the calibration run stretched its calls' own work,
        which the runs after it do not: ``STEP_CALLS`` of them come out of the fixed
        part) and stretched by its throttle (``slowed``), and a call's own work."""
        fixed = max(self.optimizer_scale * LIVE.optimizer_s - STEP_CALLS * self.call_s, 0.0)
        calibrated = replace(LIVE, optimizer_s=fixed, param_byte_s=self.optimizer_scale * LIVE.param_byte_s)
        return replace(slowed(calibrated, 1 / self.throttles[pid]), call_s=self.call_s)

    @property
    def cores_used(self) -> float:
        return sum(self.throttles.values())

    def flops(self, pid: str) -> float:
        """The FLOP/s peer ``pid`` delivers here."""
        return self.base_flops * self.throttles[pid]

    def describe(self, topo: Topology) -> str:
        """One line: the mapping and the share of the cores the peers use."""
        top = max(p.flops for p in topo.peers)
        scale = self.base_flops * max(self.throttles.values()) / top
        return (
            f"compute: {top / 1e12:g} TFLOP/s -> {self.base_flops * max(self.throttles.values()) / 1e9:.2f} GFLOP/s "
            f"(x{scale:.2g}; one thread delivers {self.base_flops / 1e9:.2f} GFLOP/s on this model, each peer "
            f"throttled to its share); the peers use {self.cores_used:.2f} of {self.cores} cores "
            f"({self.cores_used / self.cores:.0%})" + self._calibrated()
        )

    def _calibrated(self) -> str:
        call = f"; a compute call's own work {self.call_s * 1e3:.2f} ms" if self.call_s else ""
        slower = f"; the optimizer x{self.optimizer_scale:.2f} the estimator's" if self.optimizer_scale != 1 else ""
        return call + slower


def map_compute(
    topo: Topology, base_flops: float, cores: int, budget: float = CORE_BUDGET, top_flops: float = TOP_FLOPS
) -> ComputeMap:
    """Throttles in proportion to the peers' FLOP/s: the fastest delivers ``top_flops``
    (so that the plans do not follow the noise of one calibration), unless the peers
    together would then demand more than ``budget`` of ``cores``, or the fastest more
    than a whole thread: then all of them less, in the same proportion."""
    if not (base_flops > 0 and math.isfinite(base_flops)) or cores < 1:
        raise TestbedError(f"cannot map compute onto {cores} cores at {base_flops} FLOP/s")
    top = max(p.flops for p in topo.peers)
    shares = {p.id: p.flops / top for p in topo.peers}
    fastest = min(top_flops / base_flops, 1.0, budget * cores / sum(shares.values()))
    return ComputeMap(base_flops, {pid: max(s * fastest, 1e-3) for pid, s in shares.items()}, cores)
