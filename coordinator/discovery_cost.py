"""What discovery and the coordinator's control plane cost a swarm of ``n`` peers: the
one home of these formulas (pure, no networking), which ``fusionllm sim`` reports and
``benchmarks/discovery.py`` checks against a measured swarm.

Two advert layouts are priced. ``one_key``: every advert is a subkey of one DHT key,
refreshed every ``ttl / 3`` s; hivemind looks the key up before each store and every
holder answers a lookup with the whole dictionary, so the busiest holder serves
``n / period * n * advert`` bytes per second (quadratic). ``sharded``: adverts cut into
``shard_count(n)`` keys of at most ``PEERS_PER_SHARD`` peers each (``<run>:adverts/<i>``,
ruled by ``protocol.trust.run_records.SHARDED``): a store's lookup returns one shard,
each node holds a bounded number of shards, so a holder's load stays flat as the swarm
grows, and no reply exceeds one shard. The coordinator asks for at most
``POLL_RECORDS`` adverts a poll, a rotating slice of the shards (peers in the plan are
watched through their own messages, not the DHT)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from protocol.net.records import ADVERT_TTL_S, refresh_period

#: bytes one advert costs on the wire in a lookup's reply (a ~570-byte signed record plus
#: hivemind's framing), calibrated on issue 33's one-key figures: 126 kB/s at 20 peers
ADVERT_WIRE_BYTES = 630
#: nodes that hold a copy of each key, each answering lookups: hivemind's ``num_replicas``
#: is 5, but each storer stores to the 5 nearest nodes it finds, so more hold a copy
#: (measured: a latest-read of a shard met 9-11 copies at 20-80 peers)
REPLICAS = 9
#: the most peers one shard holds: its reply is at most this times ``ADVERT_WIRE_BYTES``,
#: and a holder's load is flat past it (measured: ``benchmarks/discovery.py``)
PEERS_PER_SHARD = 16
#: the most shards a run cuts its adverts into (``protocol.trust.run_records.MAX_SHARDS``)
MAX_SHARDS = 1024
#: the most peers' adverts one coordinator poll asks for (a larger swarm's shards are
#: read a slice a poll, in turn: ``coordinator.adverts``)
POLL_RECORDS = 128
#: copies of each record a coordinator poll receives: it reads the latest of each
#: shard, so every holder its lookup meets answers with its copy (measured:
#: ``benchmarks/discovery.py``'s reader bytes over the records it found)
READ_COPIES = 11.3
#: the busiest node's share of shards over the mean (a hash's imbalance, 5 copies each),
#: calibrated on ``benchmarks/discovery.py`` at 40-80 peers (112-137 kB/s) with stores
#: every ``ADVERT_REFRESH_S`` from start to start (``peer.adverts.RefreshPace``; 3.0 fitted
#: the earlier pace, 2 s after each store returned)
HOT_HOLDER_FACTOR = 4.5
#: CPU seconds the coordinator spends on one signed control message: its p2p daemon's
#: share, decode, the gate, one Ed25519 verify (~66-83 us) and the handler (measured:
#: ``benchmarks/discovery.py``'s real coordinator under synthetic heartbeats, 301 us
#: with its daemon, 228 us its Python process alone, on the loaded 2-core machine)
CONTROL_MESSAGE_CPU_S = 300e-6
#: CPU seconds the coordinator spends on one step's ``Commit`` to one planned peer: its
#: share of the frame sealed once for all, the write and its p2p daemon's share
#: (measured: ``benchmarks/control_plane.py``'s ``measure_outbound`` with
#: ``coordinator.messaging.send_each``, 169-175 us at load average 15-20 on the 2-core
#: machine, 124 us at 6-11; each sealed and sent in turn, as before: 233 and 172 us)
COMMIT_CPU_S = 175e-6
#: bytes an ``Assign`` takes per peer it names: its neighbourhood's (stages ``s - 1`` to
#: ``s + 1``: id in its stage, addresses, public key, certificate's end; measured with
#: ``coordinator.assignments`` on ``control_plane.wire_costs``' fields: 395 a peer)
ASSIGN_BYTES_PER_PEER = 395
#: bytes it takes per stage of the plan (its replica count, an empty id list, its
#: boundary in the cut, its input spec; ``wire_costs``: 57 with one tensor's spec)
ASSIGN_BYTES_PER_STAGE = 57
#: bytes of what every assignment carries alike (the job, the epoch's fields)
ASSIGN_BASE_BYTES = 420
#: CPU seconds to encode and sign an assignment, per byte (``control_plane.wire_costs``:
#: 44.6 ms for one of 3.96 MB, at load average 16; 29 ms at 8); its write is not counted
ASSIGN_CPU_S_PER_BYTE = 11.3e-9
#: the replicas a stage is priced with where a plan's shape is not given: a replica
#: serves the micro-batches ``m`` with ``m % replicas == its index``, so a stage has at
#: most its step's micro-batches (more would idle; 64 is a large step), and a plan of
#: more peers has more stages
PRICED_REPLICAS = 64
#: the largest frame header a receiver takes (``protocol.wire.encoding.MAX_HEADER_BYTES``)
HEADER_CAP_BYTES = 1 << 20
#: the largest DHT message hivemind's daemon passes (replies over it never arrive)
DAEMON_CAP_BYTES = 4 << 20


@dataclass(frozen=True)
class DiscoveryCost:
    """Per-second and per-poll figures for one swarm size."""

    n: int
    shards: int
    busiest_holder_kB_s: float  # bytes the busiest DHT node serves, per second
    holder_rpc_s: float  # lookups the busiest node answers, per second
    coordinator_kB_per_poll: float  # what one coordinator poll reads
    largest_message_kB: float  # the largest DHT reply
    coordinator_cpu: float  # CPU seconds per second the control plane costs the coordinator
    assign_kB: float = 0.0  # the plan's largest assignment (over HEADER_CAP_BYTES: the plan is refused)
    replan_cpu_s: float = 0.0  # CPU seconds a re-plan's assignments cost the coordinator

    @property
    def assign_sendable(self) -> bool:
        """Whether an assignment fits a frame's header (``HEADER_CAP_BYTES``)."""
        return self.assign_kB * 1e3 <= HEADER_CAP_BYTES

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def shard_count(n: int) -> int:
    """Shards for a swarm of ``n`` peers: a power of two, so that a re-shard splits each
    shard in two, with at most ``PEERS_PER_SHARD`` peers per shard where ``MAX_SHARDS``
    allows."""
    need = max(1, math.ceil(n / PEERS_PER_SHARD))
    return min(MAX_SHARDS, 1 << (need - 1).bit_length())


def control_cpu(
    n: int,
    planned: int,
    beat_s: float,
    step_s: float,
    standby_beat_s: float,
    replan_s: float = 0.0,
    sizes: list[int] | None = None,
) -> float:
    """The coordinator's CPU seconds per second: each planned peer's step report every
    ``step_s`` (its heartbeat too) and the step's commit to it, each standby peer's
    heartbeat every ``standby_beat_s`` (``beat_s``: the planned peers' heartbeat when no
    step is running; 0: none), and a re-plan's assignments (``replan_cpu`` of the plan's
    replica counts ``sizes``, by default ``even_plan(planned)``) every ``replan_s`` (0: none)."""
    planned = min(planned, n)
    beats = planned / beat_s if beat_s > 0 else 0.0
    reports = planned / step_s if step_s > 0 else 0.0
    standby = (n - planned) / standby_beat_s if standby_beat_s > 0 else 0.0
    replans = replan_cpu(sizes or even_plan(planned)) / replan_s if replan_s > 0 else 0.0
    return (beats + reports + standby) * CONTROL_MESSAGE_CPU_S + reports * COMMIT_CPU_S + replans


def even_plan(planned: int, replicas: int = PRICED_REPLICAS) -> list[int]:
    """Replica counts of ``planned`` peers in as few stages of at most ``replicas`` as
    hold them, spread evenly: the shape priced where a plan's own is not given."""
    k = max(1, math.ceil(planned / replicas))
    return [planned // k + (s < planned % k) for s in range(k)]


def neighbourhoods(sizes: list[int]) -> list[int]:
    """How many peers each stage's assignment names: its own stage's and its neighbours'."""
    return [sum(sizes[max(0, s - 1) : s + 2]) for s in range(len(sizes))]


def assign_bytes(named: int, stages: int) -> float:
    """One assignment that names ``named`` peers in a plan of ``stages`` stages."""
    return ASSIGN_BASE_BYTES + stages * ASSIGN_BYTES_PER_STAGE + named * ASSIGN_BYTES_PER_PEER


def largest_assign_bytes(sizes: list[int]) -> float:
    """The largest assignment of a plan with these replica counts (over
    ``HEADER_CAP_BYTES``: ``coordinator.assignments`` refuses the plan)."""
    return assign_bytes(max(neighbourhoods(sizes), default=0), len(sizes))


def replan_cpu(sizes: list[int]) -> float:
    """CPU seconds a re-plan's assignments cost the coordinator: one to each planned
    peer, each encoded and signed for it, sized by its neighbourhood (linear in the
    plan's peers for a given shape)."""
    k = len(sizes)
    return sum(n * assign_bytes(near, k) for n, near in zip(sizes, neighbourhoods(sizes))) * ASSIGN_CPU_S_PER_BYTE


def one_key(n: int, refresh_s: float, cpu: float = 0.0) -> DiscoveryCost:
    """Today's layout (every advert under one key), priced for ``n`` peers."""
    whole = n * ADVERT_WIRE_BYTES
    return DiscoveryCost(n, 1, n / refresh_s * whole / 1e3, n / refresh_s, whole / 1e3, whole / 1e3, cpu)


def sharded(n: int, refresh_s: float, cpu: float = 0.0) -> DiscoveryCost:
    """The sharded layout priced for ``n`` peers (``n`` DHT nodes hold the shards)."""
    k = shard_count(n)
    per_shard = math.ceil(n / k)
    reply = per_shard * ADVERT_WIRE_BYTES
    held = min(k, max(1.0, HOT_HOLDER_FACTOR * k * REPLICAS / max(n, 1)))  # shards on the busiest node
    rpc = held * per_shard / refresh_s
    poll = min(n, POLL_RECORDS) * ADVERT_WIRE_BYTES * READ_COPIES
    return DiscoveryCost(n, k, rpc * reply / 1e3, rpc, poll / 1e3, reply / 1e3, cpu)


def growth_exponent(ns: list[int], loads: list[float]) -> float:
    """The least-squares slope of log(load) against log(n): 1 is linear, 2 quadratic."""
    xs = [math.log(n) for n in ns]
    ys = [math.log(max(v, 1e-9)) for v in loads]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


#: seconds between a peer's advert refreshes (at ``peer.config``'s default advert ttl)
ADVERT_REFRESH_S = refresh_period(ADVERT_TTL_S)
#: seconds between a standby peer's heartbeats once planned peers' step reports are theirs
STANDBY_BEAT_S = 10.0


def swarm_cost(
    n: int, planned: int, step_s: float, replan_s: float = 0.0, sizes: list[int] | None = None
) -> DiscoveryCost:
    """The sharded layout's cost for ``n`` peers of which ``planned`` serve a plan whose
    step takes ``step_s`` (its replica counts ``sizes``, by default ``even_plan``), their
    step reports serving as their heartbeats, re-planned every ``replan_s`` (0: never;
    what ``fusionllm sim`` reports)."""
    shape = sizes or even_plan(min(planned, n))
    cost = sharded(n, ADVERT_REFRESH_S, control_cpu(n, planned, 0.0, step_s, STANDBY_BEAT_S, replan_s, shape))
    return with_assignments(cost, shape)


def with_assignments(cost: DiscoveryCost, sizes: list[int]) -> DiscoveryCost:
    """``cost`` with what the assignments of a plan with these replica counts cost."""
    return dataclasses.replace(cost, assign_kB=largest_assign_bytes(sizes) / 1e3, replan_cpu_s=replan_cpu(sizes))
