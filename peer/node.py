"""The volunteer peer: joins the DHT, measures itself, advertises, and serves the
stage the coordinator assigns until the run ends."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer.bench import free_memory, measure_flops, pick_device
from peer.checks import PlanChecks
from peer.executor import StageExecutor
from peer.mailbox import Mailbox
from protocol import schedule as schedules
from protocol.codecs import Codec, CodecError, ErrorFeedback
from protocol.envelope import Gate
from protocol.graph import Cut, build_stage, partition, trace
from protocol.identity import Identity, IdentityError, check_record, public_key, sign_record
from protocol.job import JobSpec
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Activations,
    Advert,
    Assign,
    CoordinatorRecord,
    Finish,
    Gradients,
    Hello,
    LinkPlan,
    PeerFailure,
    Ready,
    Release,
    ReplicaGrads,
    State,
    StepDone,
    dht_key,
)
from protocol.transport import PeerUnreachable, Transport
from protocol.wire import Link

logger = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """The peer could not join the swarm; ``str()`` says why in one line."""


class RunAborted(RuntimeError):
    pass


class RunRefused(RuntimeError):
    """The assignment cannot be served (e.g. a malformed key or codec in it)."""


@dataclass
class PeerConfig:
    initial_peers: list[str]
    run_id: str = "fusionllm"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    device: str | None = None
    advert_ttl: float = 6.0
    join_timeout: float = 30.0
    bandwidth_probe_bytes: int = 4 << 20
    link_probe_bytes: int = 1 << 20
    message_timeout: float = 600.0
    identity: str | None = None  # key file; None: a fresh key for this process only


class PeerNode:
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dht: hivemind.DHT | None = None
        self.transport: Transport | None = None
        self.mailbox = Mailbox()
        self.coordinator: CoordinatorRecord | None = None
        self.advert: Advert | None = None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._tasks: list[asyncio.Task[Any]] = []
        self.identity: Identity | None = None
        self.checks: PlanChecks | None = None
        self.feedback = ErrorFeedback()

    # ---------------------------------------------------------------- joining
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        try:
            self.identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise JoinError(str(exc)) from None
        try:
            self.dht = await asyncio.wait_for(
                loop.run_in_executor(
                    None,
                    lambda: hivemind.DHT(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs, start=True),
                ),
                cfg.join_timeout,
            )
        except asyncio.TimeoutError:
            raise JoinError(
                f"could not join the DHT through {', '.join(cfg.initial_peers)} within {cfg.join_timeout:.0f} s"
            ) from None
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JoinError(f"could not join the DHT through {', '.join(cfg.initial_peers)}: {first}") from None
        gate = Gate(cfg.run_id)
        self.transport = Transport(await self.dht.replicate_p2p(), self.identity, gate)
        await self.transport.start()
        self._tasks.append(asyncio.create_task(self._dispatch()))
        self.coordinator, key = await self._find_coordinator()
        gate.admit(self.coordinator.peer_id, key)
        self.checks = gate.expect = PlanChecks(self.coordinator.peer_id)
        self.transport.learn(self.coordinator.peer_id, self.coordinator.maddrs)
        flops = await loop.run_in_executor(self._compute, measure_flops, self.device)
        try:
            up, down = await self.transport.measure_bandwidth(self.coordinator.peer_id, cfg.bandwidth_probe_bytes)
            await self.transport.send(self.coordinator.peer_id, Hello(cfg.run_id, self.identity.public_hex))
        except (PeerUnreachable, ConnectionError, asyncio.IncompleteReadError) as exc:
            raise JoinError(f"cannot reach the coordinator {self.coordinator.peer_id}: {exc}") from None
        self.advert = Advert(
            peer_id=self.transport.peer_id,
            maddrs=[str(m) for m in self.dht.get_visible_maddrs()],
            device=str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            flops=flops,
            memory_bytes=free_memory(self.device),
            up_mbps=up,
            down_mbps=down,
            torch_version=str(torch.__version__),
            protocol_version=PROTOCOL_VERSION,
            expires_at=0.0,
        )
        await self._publish()
        self._tasks.append(asyncio.create_task(self._refresh_adverts()))
        logger.info(
            "joined as %s: %.2f GFLOP/s, up %.0f / down %.0f Mbit/s", self.advert.peer_id, flops / 1e9, up, down
        )

    async def _find_coordinator(self) -> tuple[CoordinatorRecord, Any]:
        assert self.dht is not None
        key = dht_key(self.config.run_id, "coordinator")
        deadline = time.monotonic() + self.config.join_timeout
        loop = asyncio.get_running_loop()
        while time.monotonic() < deadline:
            found = await loop.run_in_executor(None, lambda: self.dht.get(key, latest=True))
            if found is not None:
                try:
                    rec = CoordinatorRecord.from_header(found.value)
                    if isinstance(rec, CoordinatorRecord):
                        return rec, check_record(found.value)
                except Exception as exc:
                    logger.warning("ignoring a bad coordinator record: %s", exc)
            await asyncio.sleep(0.5)
        raise JoinError(
            f"no coordinator for run '{self.config.run_id}' in the DHT after {self.config.join_timeout:.0f} s"
        )

    async def _publish(self) -> None:
        assert self.dht is not None and self.advert is not None and self.identity is not None
        expires = get_dht_time() + self.config.advert_ttl
        ad = Advert(**{**self.advert.__dict__, "expires_at": expires})
        record = sign_record(self.identity, ad.header())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None,
            lambda: self.dht.store(dht_key(self.config.run_id, "adverts"), record, expires, subkey=ad.peer_id),
        )

    async def _refresh_adverts(self) -> None:
        while True:
            await asyncio.sleep(self.config.advert_ttl / 3)
            try:
                await self._publish()
            except Exception as exc:  # the DHT may hiccup; the next refresh retries
                logger.warning("advert refresh failed: %s", exc)

    # ---------------------------------------------------------------- messages
    async def _dispatch(self) -> None:
        assert self.transport is not None
        while True:
            inbound = await self.transport.inbox.get()
            msg = inbound.message
            if isinstance(msg, Abort):
                self.mailbox.fail(RunAborted(msg.reason))
            elif isinstance(msg, Assign):
                self.mailbox.put("assign", inbound)
            elif isinstance(msg, LinkPlan):
                self.mailbox.put("links", inbound)
            elif isinstance(msg, Finish):
                self.mailbox.put("finish", inbound)
            elif isinstance(msg, Release):
                self.mailbox.put("release", inbound)
            elif isinstance(msg, Activations):
                self.mailbox.put(("act", msg.step, msg.mb), inbound)
            elif isinstance(msg, Gradients):
                self.mailbox.put(("grad", msg.step, msg.mb), inbound)
            elif isinstance(msg, ReplicaGrads):
                self.mailbox.put(("rgrad", msg.step, msg.replica), inbound)
            else:
                logger.warning("unexpected %s from %s", msg.KIND, inbound.sender)

    async def _run_compute(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # ---------------------------------------------------------------- serving
    async def serve(self) -> int:
        """Wait for an assignment, train until the run finishes; returns an exit code."""
        assert self.transport is not None and self.coordinator is not None
        inbound = await self.mailbox.get("assign", timeout=self.config.message_timeout)
        a: Assign = inbound.message
        try:
            return await self._train(a)
        except RunAborted as exc:
            logger.error("the coordinator aborted the run: %s", exc)
            return 1
        except (PeerUnreachable, RunRefused) as exc:
            logger.error("%s", exc)
            await self._report_failure(a, str(exc))
            return 1

    async def _report_failure(self, a: Assign, reason: str) -> None:
        assert self.transport is not None and self.coordinator is not None
        try:
            await self.transport.send(self.coordinator.peer_id, PeerFailure(a.run_id, a.stage, reason))
        except PeerUnreachable:
            pass

    async def _train(self, a: Assign) -> int:
        assert self.transport is not None and self.coordinator is not None
        assert self.checks is not None
        tp = self.transport
        for pid, addrs in a.maddrs.items():
            tp.learn(pid, addrs)
        try:
            for pid, hex_key in a.keys.items():
                if pid != tp.peer_id:
                    tp.gate.admit(pid, public_key(hex_key))
        except IdentityError as exc:
            raise RunRefused(f"the assignment holds a bad key: {exc}") from None
        job = JobSpec(**a.job)
        cut = Cut(tuple(a.cut))
        k, s, r = cut.num_stages, a.stage, a.replica
        start = time.perf_counter()
        replicas = a.stages[s]
        my_mbs = [m for m in range(job.micro_batches) if m % len(replicas) == r]
        self.checks.my_mbs = frozenset(my_mbs)
        self.checks.assign = a
        rates = list(a.link_mbps)  # per boundary; a link is paced the same both ways
        if s < min(k - 1, len(rates)):
            for pid in a.stages[s + 1]:
                tp.set_rate(pid, rates[s])
        if 0 < s <= len(rates):
            for pid in a.stages[s - 1]:
                tp.set_rate(pid, rates[s - 1])

        def build() -> StageExecutor:
            model = job.build_model()
            module = build_stage(partition(trace(model), cut), s).to(self.device)
            return StageExecutor(module, job.lr, s == k - 1)

        ex = await self._run_compute(build)
        build_s = time.perf_counter() - start
        next_mbps = {}
        for pid in a.stages[s + 1] if s < k - 1 else []:
            next_mbps[pid], _ = await tp.measure_bandwidth(pid, self.config.link_probe_bytes, down=False)
        await tp.send(self.coordinator.peer_id, Ready(a.run_id, s, r, build_s, next_mbps))
        plan_msg = (await self.mailbox.get("links", self.config.message_timeout)).message
        try:
            codecs = [Codec.from_json(c) for c in plan_msg.codecs]
        except CodecError as exc:
            raise RunRefused(f"the link plan names a bad codec: {exc}") from None
        if len(codecs) != k - 1:
            raise RunRefused(f"the link plan has {len(codecs)} codecs for {k - 1} boundaries")
        self.checks.codecs = codecs
        # stochastic rounding of gradients: seeded by run, stage and replica (reproducible)
        rounding = torch.Generator().manual_seed(job.seed * 1_000_003 + s * 1009 + r)
        uniform = len({len(p) for p in a.stages}) == 1
        plan = schedules.make(a.schedule if uniform else "gpipe", k, len(my_mbs))[s]
        timeout = self.config.message_timeout
        for step in range(job.steps):
            self.checks.step = step
            sends: list[asyncio.Task[int]] = []
            losses: dict[str, float] = {}
            compute_s = 0.0
            for kind, i in plan:
                mb = my_mbs[i]
                if kind == "F":
                    inb = await self.mailbox.get(("act", step, mb), timeout)
                    values = inb.frame.values(self.device)
                    t0 = time.perf_counter()
                    out = await self._run_compute(ex.forward, mb, values)
                    compute_s += time.perf_counter() - t0
                    if s == k - 1:
                        losses[str(mb)] = float(out)
                    else:
                        dest = a.stages[s + 1][mb % len(a.stages[s + 1])]
                        msg = Activations(a.run_id, step, mb, s + 1)
                        sends.append(asyncio.create_task(tp.send(dest, msg, list(out), Link(codecs[s].forward))))
                else:
                    grad_out = None
                    if s < k - 1:
                        inb = await self.mailbox.get(("grad", step, mb), timeout)
                        grad_out = inb.frame.values(self.device)
                    t0 = time.perf_counter()
                    grads = await self._run_compute(ex.backward, mb, grad_out, job.micro_batches)
                    compute_s += time.perf_counter() - t0
                    if s > 0:
                        dest = a.stages[s - 1][mb % len(a.stages[s - 1])]
                        link = Link(codecs[s - 1].backward, self.feedback, dest, rounding)
                        sends.append(
                            asyncio.create_task(tp.send(dest, Gradients(a.run_id, step, mb, s - 1), grads, link))
                        )
            if len(replicas) > 1:
                await self._average_replicas(a, ex, step, timeout)
            await self._run_compute(ex.step)
            for t in sends:
                await t
            await tp.send(
                self.coordinator.peer_id,
                StepDone(a.run_id, step, s, r, losses, compute_s, dict(tp.bytes_sent), dict(tp.raw_sent)),
            )
        inb = await self.mailbox.get("finish", timeout)
        if inb.message.send_state and r == 0:
            state = ex.module.state_dict()
            names = sorted(state)
            await tp.send(self.coordinator.peer_id, State(a.run_id, s, names), [state[n] for n in names])
        # Leaving now could cut the state off inside the daemons; wait for the coordinator to confirm.
        try:
            await self.mailbox.get("release", 60.0)
        except asyncio.TimeoutError:
            logger.warning("the coordinator did not confirm the end of the run; leaving anyway")
        return 0

    async def _average_replicas(self, a: Assign, ex: StageExecutor, step: int, timeout: float) -> None:
        """Sum the replicas' gradients (each is already divided by the total micro-batch
        count) in replica order, so every replica applies the same update."""
        assert self.transport is not None
        s, r = a.stage, a.replica
        params = dict(ex.module.named_parameters())
        names = sorted(n for n, p in params.items() if p.grad is not None)
        mine = [params[n].grad for n in names]
        for other, pid in enumerate(a.stages[s]):
            if other != r:
                await self.transport.send(pid, ReplicaGrads(a.run_id, step, s, r, names), mine)
        total: dict[str, torch.Tensor] = {}
        for other in range(len(a.stages[s])):
            if other == r:
                got = dict(zip(names, mine, strict=True))
            else:
                inb = await self.mailbox.get(("rgrad", step, other), timeout)
                got = dict(zip(inb.message.names, inb.frame.values(self.device), strict=True))
            for n, g in got.items():
                total[n] = g.clone() if n not in total else total[n] + g
        for n, g in total.items():
            params[n].grad = g

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()
        self._compute.shutdown(wait=False, cancel_futures=True)
