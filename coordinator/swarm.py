"""The coordinator of a swarm run: hosts (or joins) the DHT, reads the peers'
adverts, assigns stages, feeds micro-batches, watches for dead peers, and
gathers the trained weights."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from coordinator.assign import Assignment, assign
from coordinator.links import boundary_specs, choose_codecs, float_bytes
from coordinator.opdag import build_opdag
from coordinator.status import StatusBoard
from coordinator.web import StatusServer
from protocol.codecs import Codec
from protocol.envelope import Envelope, Gate, Reject, Rejected, match_values
from protocol.identity import Identity, IdentityError, check_record, key_hex, sign_record
from protocol.job import JobSpec, split_batch
from protocol.messages import (
    Abort,
    Activations,
    Advert,
    Assign,
    CoordinatorRecord,
    Finish,
    Hello,
    LinkPlan,
    Message,
    PeerFailure,
    Ready,
    Release,
    State,
    StepDone,
    dht_key,
)
from protocol.transport import PeerUnreachable, Transport
from protocol.wire import encode_values

#: what peers may send the coordinator
_FROM_PEERS = ("hello", "ready", "done", "state", "failure")

logger = logging.getLogger(__name__)


class SwarmError(RuntimeError):
    """The run cannot go on; ``str()`` says why in one line."""


@dataclass
class CoordinatorConfig:
    job: JobSpec
    run_id: str = "fusionllm"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    initial_peers: list[str] = field(default_factory=list)
    min_peers: int = 1
    num_stages: int | None = None
    schedule: str = "1f1b"
    peer_wait_s: float = 120.0
    step_timeout_s: float = 300.0
    record_ttl: float = 10.0
    identity: str | None = None  # key file; None: a fresh key for this process only
    compression: str = "none"  # none, fp16, bf16, int8, int4 (every link), adatopk or auto (per link, from bandwidth)
    topk_fraction: float | None = None  # pin AdaTopK's kept fraction on the links that need compressing
    lowrank_rank: int | None = None  # pin auto's rank on the links that get low-rank activations
    link_mbps: list[float] = field(default_factory=list)  # pace each stage boundary's link (loopback demos)
    status: bool = True  # serve the status page, /api/v1/state and /metrics
    status_host: str = "127.0.0.1"
    status_port: int | None = None  # None: 8470, or any free port if that is taken


@dataclass
class StepReport:
    step: int
    loss: float
    seconds: float
    tokens: int


@dataclass
class RunSummary:
    losses: list[float]
    seconds: float
    tokens: int
    assignment: Assignment
    adverts: dict[str, Advert]
    link_bytes: dict[str, int]  # "src->dst" -> bytes
    state: dict[str, torch.Tensor]
    links: list[LinkReport] = field(default_factory=list)  # per stage boundary
    estimate: dict[str, Any] = field(default_factory=dict)  # the estimator's prediction next to what ran


@dataclass
class LinkReport:
    """One stage boundary: its codec, measured bandwidth and traffic (both ways)."""

    boundary: int
    codec: str
    mbps: float
    wire_bytes: int
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.wire_bytes, 1)


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.dht: hivemind.DHT | None = None
        self.transport: Transport | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.adverts: dict[str, Advert] = {}
        self.identity: Identity | None = None
        self.gate = Gate(config.run_id)
        self.gate.accept_hello = True
        self.gate.expect = self._expect
        self.board = StatusBoard(config.run_id, config.job.steps)
        self.gate.listeners.append(self.board.reject)
        self.status: StatusServer | None = None

    def _expect(self, env: Envelope, message: Message, sender: str) -> None:
        if env.kind not in _FROM_PEERS:
            raise Rejected(Reject.UNEXPECTED, f"peers do not send the coordinator '{env.kind}'")

    async def start(self) -> None:
        """Raises SwarmError (one line) when the identity file cannot be used."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            self.identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise SwarmError(str(exc)) from None
        if cfg.status:
            self.status = StatusServer(self.board, cfg.status_host, cfg.status_port)
            try:
                await self.status.start()
            except OSError as exc:
                self.status = None
                raise SwarmError(str(exc)) from None
        self.dht = await loop.run_in_executor(
            None,
            lambda: hivemind.DHT(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs, start=True),
        )
        self.transport = Transport(await self.dht.replicate_p2p(), self.identity, self.gate)
        await self.transport.start()
        await self._publish_record()
        self._tasks.append(asyncio.create_task(self._refresh_record()))

    @property
    def visible_maddrs(self) -> list[str]:
        assert self.dht is not None
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def join_command(self) -> str:
        run = "" if self.config.run_id == "fusionllm" else f" --run {self.config.run_id}"
        return "fusionllm join --initial-peers " + " ".join(self.visible_maddrs) + run

    async def _publish_record(self) -> None:
        assert self.dht is not None and self.transport is not None and self.identity is not None
        expires = get_dht_time() + self.config.record_ttl
        rec = CoordinatorRecord(self.transport.peer_id, self.visible_maddrs, self.config.run_id, expires)
        record = sign_record(self.identity, rec.header())
        key = dht_key(self.config.run_id, "coordinator")
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.dht.store(key, record, expires))

    async def _refresh_record(self) -> None:
        while True:
            await asyncio.sleep(self.config.record_ttl / 3)
            try:
                await self._publish_record()
            except Exception as exc:
                logger.warning("coordinator record refresh failed: %s", exc)

    async def live_adverts(self) -> dict[str, Advert]:
        """The adverts in the DHT that have not expired, are signed, and whose key the
        peer bound to its libp2p id with its hello, by peer id."""
        assert self.dht is not None
        key = dht_key(self.config.run_id, "adverts")
        found = await asyncio.get_running_loop().run_in_executor(None, lambda: self.dht.get(key, latest=True))
        out: dict[str, Advert] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        now = get_dht_time()
        for subkey, item in found.value.items():
            try:
                ad = Advert.from_header(item.value)
                key = check_record(item.value)
            except Exception as exc:
                logger.warning("ignoring a bad advert under %r: %s", subkey, exc)
                continue
            if not isinstance(ad, Advert):
                logger.warning("ignoring a %s record under %r among the adverts", ad.KIND, subkey)
                continue
            bound = self.gate.keys.get(ad.peer_id)
            if bound is None or key_hex(bound) != key_hex(key):
                continue  # no hello yet (or from another key): not admitted
            if ad.expires_at > now and ad.peer_id == subkey:
                out[ad.peer_id] = ad
        self.board.saw_adverts(out)
        return out

    async def _watch_adverts(self) -> None:
        """Keep the status board's peers fresh while training (joins, leaves, health)."""
        while True:
            await asyncio.sleep(2.0)
            try:
                await self.live_adverts()
            except Exception as exc:  # the DHT may hiccup; the next poll retries
                logger.debug("advert poll failed: %s", exc)

    async def wait_for_peers(self, on_change: Callable[[int], None] | None = None) -> dict[str, Advert]:
        cfg = self.config
        deadline = time.monotonic() + cfg.peer_wait_s
        seen = -1
        while True:
            ads = await self.live_adverts()
            if len(ads) != seen:
                seen = len(ads)
                if on_change:
                    on_change(seen)
            if len(ads) >= cfg.min_peers:
                return ads
            if time.monotonic() > deadline:
                raise SwarmError(f"only {len(ads)} of {cfg.min_peers} peers joined within {cfg.peer_wait_s:.0f} s")
            await asyncio.sleep(0.5)

    async def _next(self, kinds: tuple[type[Message], ...], timeout: float, peers: set[str]) -> Any:
        """The next message of ``kinds``; meanwhile watch the awaited ``peers``' adverts."""
        assert self.transport is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SwarmError(f"no progress for {timeout:.0f} s (waiting for {len(peers)} peers)")
            try:
                inbound = await asyncio.wait_for(self.transport.inbox.get(), min(left, 2.0))
            except asyncio.TimeoutError:
                live = await self.live_adverts()
                gone = sorted(p for p in peers if p not in live)
                if gone:
                    raise SwarmError(
                        "peer " + ", ".join(f"{p} ({self._where(p)})" for p in gone) + " vanished: its advert "
                        "expired; the run stops (recovering from a lost peer is not built yet)"
                    ) from None
                continue
            msg = inbound.message
            self.board.heard_from(inbound.sender)
            if isinstance(msg, Hello):
                continue  # a late joiner's key binding (the gate already did it)
            if isinstance(msg, PeerFailure) and self._assigned(inbound.sender):
                raise SwarmError(f"peer {inbound.sender} ({self._where(inbound.sender)}) failed: {msg.reason}")
            # only the peers awaited now may answer: an admitted peer outside the plan cannot
            # slip in a step's losses or a stage's weights
            if (
                isinstance(msg, kinds)
                and getattr(msg, "run_id", None) == self.config.run_id
                and inbound.sender in peers
            ):
                return inbound
            logger.warning("ignoring an unexpected %s from %s", msg.KIND, inbound.sender)

    def _assigned(self, peer_id: str) -> bool:
        plan = getattr(self, "_assignment", None)
        return plan is not None and any(peer_id in group for group in plan.stages)

    def _where(self, peer_id: str) -> str:
        try:
            s, r = self._assignment.stage_of(peer_id)
            return f"stage {s}, replica {r}"
        except (AttributeError, KeyError):
            return "not assigned"

    async def run(
        self,
        model: torch.nn.Module,
        on_step: Callable[[StepReport], None] | None = None,
        on_peers: Callable[[int], None] | None = None,
    ) -> RunSummary:
        """Train ``model``'s job on the swarm; returns the losses and the trained state."""
        assert self.transport is not None
        cfg, job, tp = self.config, self.config.job, self.transport
        self.adverts = await self.wait_for_peers(on_peers)
        self._tasks.append(asyncio.create_task(self._watch_adverts()))
        example = job.first_micro_batch()
        dag = build_opdag(model, example)
        try:
            self._assignment = plan = assign(dag, list(self.adverts.values()), cfg.num_stages, job.micro_batches)
        except ValueError as exc:
            raise SwarmError(f"cannot plan the run: {exc}") from None
        k = plan.cut.num_stages
        specs = boundary_specs(model, plan.cut, example)
        self.board.set_plan(
            [op.flops for op in dag.ops],
            dag.stage_costs(plan.cut),
            plan.cut.to_list(),
            dag.boundary_bytes(plan.cut),
            plan.stages,
        )
        peers = {p for group in plan.stages for p in group}
        maddrs = {p: self.adverts[p].maddrs for p in peers}
        keys = {p: key_hex(self.gate.keys[p]) for p in peers}
        for p in peers:
            tp.learn(p, maddrs[p])
        job_fields = dataclasses.asdict(job)
        link_reports: list[LinkReport] = []
        link_bytes: dict[str, dict[str, int]] = {}
        raw_bytes: dict[str, dict[str, int]] = {}
        try:
            if cfg.link_mbps and len(cfg.link_mbps) != k - 1:
                raise SwarmError(f"--link-mbps gives {len(cfg.link_mbps)} rates; the plan has {k - 1} stage boundaries")
            for s, group in enumerate(plan.stages):
                for r, p in enumerate(group):
                    a = Assign(cfg.run_id, s, r, job_fields, plan.cut.to_list(), plan.stages, maddrs, cfg.schedule)
                    a = dataclasses.replace(a, keys=keys, specs=specs, link_mbps=list(cfg.link_mbps))
                    await tp.send(p, a)
            pending = set(peers)
            measured: dict[str, dict[str, float]] = {}
            while pending:
                inbound = await self._next((Ready,), cfg.step_timeout_s, pending)
                pending.discard(inbound.sender)
                measured[inbound.sender] = inbound.message.next_mbps
            codecs, mbps = self._choose_codecs(dag, plan, specs, measured)
            link_reports = [LinkReport(b, str(c), mbps[b], 0, 0) for b, c in enumerate(codecs)]
            self.board.set_links([str(c) for c in codecs], mbps)
            for p in peers:
                await tp.send(p, LinkPlan(cfg.run_id, [c.to_json() for c in codecs]))
            losses: list[float] = []
            step_seconds: list[float] = []
            compute: dict[str, list[float]] = {p: [] for p in peers}
            tokens = 0
            start = time.perf_counter()
            for step, batch in enumerate(itertools.islice(job.batches(), job.steps)):
                t0 = time.perf_counter()
                mbs = split_batch(batch, job.micro_batches)
                for m, mb in enumerate(mbs):
                    try:
                        match_values(encode_values(list(mb))[0], specs[0], None)
                    except Rejected as exc:
                        raise SwarmError(f"step {step}, micro-batch {m} does not fit the plan: {exc.detail}") from None
                first = plan.stages[0]
                for m, mb in enumerate(mbs):
                    await tp.send(first[m % len(first)], Activations(cfg.run_id, step, m, 0), list(mb))
                pending = set(peers)
                step_losses: dict[str, float] = {}
                while pending:
                    inbound = await self._next((StepDone,), cfg.step_timeout_s, pending)
                    if inbound.message.step != step:
                        continue
                    pending.discard(inbound.sender)
                    if inbound.sender in plan.stages[-1]:  # only the last stage computes the loss
                        step_losses.update(inbound.message.losses)
                    compute[inbound.sender].append(inbound.message.compute_s)
                    link_bytes[inbound.sender] = inbound.message.bytes_sent
                    raw_bytes[inbound.sender] = inbound.message.raw_sent
                if len(step_losses) != len(mbs):
                    raise SwarmError(f"step {step}: got {len(step_losses)} losses for {len(mbs)} micro-batches")
                losses.append(sum(step_losses.values()) / len(mbs))
                step_seconds.append(time.perf_counter() - t0)
                tokens += batch[0].numel()
                traffic = _traffic(plan, link_bytes, raw_bytes)
                self.board.step_done(step, losses[-1], time.perf_counter() - t0, batch[0].numel(), traffic)
                if on_step:
                    on_step(StepReport(step, losses[-1], time.perf_counter() - t0, batch[0].numel()))
            seconds = time.perf_counter() - start
            for p in peers:
                await tp.send(p, Finish(cfg.run_id))
            state: dict[str, torch.Tensor] = {}
            pending = {group[0] for group in plan.stages}
            while pending:
                inbound = await self._next((State,), cfg.step_timeout_s, pending)
                pending.discard(inbound.sender)
                state.update(zip(inbound.message.names, inbound.frame.values(), strict=True))
            for p in peers:
                await tp.send(p, Release(cfg.run_id))
        except PeerUnreachable as exc:
            self.board.finish(False, str(exc))
            await self._abort(peers, str(exc))
            raise SwarmError(str(exc)) from None
        except SwarmError as exc:
            self.board.finish(False, str(exc))
            await self._abort(peers, str(exc))
            raise
        self.board.finish(True, f"{len(losses)} steps in {seconds:.0f} s")
        links = {f"{src[-6:]}->{dst[-6:]}": n for src, sent in link_bytes.items() for dst, n in sent.items()}
        for report, (wire, raw) in zip(link_reports, _traffic(plan, link_bytes, raw_bytes), strict=True):
            report.wire_bytes, report.raw_bytes = wire, raw
        estimate = _estimate(plan, compute, step_seconds, job.micro_batches)
        return RunSummary(losses, seconds, tokens, plan, self.adverts, links, state, link_reports, estimate)

    def _choose_codecs(
        self, dag: Any, plan: Assignment, specs: list[list[Any]], measured: dict[str, dict[str, float]]
    ) -> tuple[list[Codec], list[float]]:
        """Per boundary: the slowest measured link between its two stages against the
        estimated compute time of each stage (3x forward FLOPs on its slowest peer)."""
        cfg = self.config
        mbps = [
            min(measured.get(p, {}).get(q, 1e-3) for p in plan.stages[b] for q in plan.stages[b + 1])
            for b in range(len(plan.stages) - 1)
        ]
        costs = dag.stage_costs(plan.cut)
        seconds = [
            3 * c["flops"] / max(min(self.adverts[p].flops for p in group), 1.0)
            for c, group in zip(costs, plan.stages, strict=True)
        ]
        edge_bytes = [float_bytes(spec) for spec in specs[1:]]
        codecs = choose_codecs(
            edge_bytes, mbps, seconds, cfg.compression, cfg.topk_fraction, specs[1:], rank=cfg.lowrank_rank
        )
        for b, c in enumerate(codecs):
            logger.info("boundary %d: %.1f Mbit/s, %d bytes per micro-batch -> %s", b, mbps[b], edge_bytes[b], c)
        return codecs, mbps

    async def _abort(self, peers: set[str], reason: str) -> None:
        assert self.transport is not None
        for p in peers:
            try:
                await asyncio.wait_for(self.transport.send(p, Abort(self.config.run_id, reason)), 3)
            except (PeerUnreachable, asyncio.TimeoutError):
                pass

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.status is not None:
            await self.status.aclose()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()


def _traffic(
    plan: Assignment, wire: dict[str, dict[str, int]], raw: dict[str, dict[str, int]]
) -> list[tuple[int, int]]:
    """(wire, raw) bytes so far across each stage boundary, both directions, from the
    peers' cumulative per-destination counts."""
    stage_of = {p: s for s, group in enumerate(plan.stages) for p in group}
    out = [[0, 0] for _ in range(len(plan.stages) - 1)]
    for src, sent in wire.items():
        for dst, n in sent.items():
            if dst in stage_of and src in stage_of and abs(stage_of[dst] - stage_of[src]) == 1:
                b = min(stage_of[src], stage_of[dst])
                out[b][0] += n
                out[b][1] += raw.get(src, {}).get(dst, n)
    return [(w, r) for w, r in out]


def _estimate(plan: Assignment, compute: dict[str, list[float]], step_seconds: list[float], mbs: int) -> dict[str, Any]:
    """The estimator's predicted step and per-stage times next to the measured ones
    (medians over the steps; a stage's time per micro-batch is its peers' forward
    plus backward compute divided by the micro-batches each handled)."""
    if plan.plan is None or not step_seconds:
        return {}
    stages = []
    for s, group in enumerate(plan.stages):
        per_mb = [
            statistics.median(compute[p]) / max(len(range(r, mbs, len(group))), 1)
            for r, p in enumerate(group)
            if compute.get(p)
        ]
        stages.append(
            {
                "stage": s,
                "predicted_ms": round(plan.plan.stage_s[s] * 1e3, 3),
                "measured_ms": round(statistics.median(per_mb) * 1e3, 3) if per_mb else None,
            }
        )
    return {
        "predicted_step_s": round(plan.plan.iteration_s, 5),
        "measured_step_s": round(statistics.median(step_seconds), 5),
        "stages": stages,
    }
