"""The volunteer peer: joins the DHT, measures itself, advertises, and serves the
stage the coordinator assigns until the run ends.

``PeerNode`` is the shell: it builds the network (DHT, transport: ``peer.joining``),
routes each inbound message, and runs the serve loop across epochs. Its parts own their
state: ``peer.link.CoordinatorLink`` (finding the coordinator, hello, heartbeats,
watching, reattaching), ``peer.admission.Credentials`` (a private swarm's proof and
certificate), ``peer.adverts.Adverts`` (publishing and refreshing the advert),
``peer.epoch.EpochRunner`` (one plan epoch) and ``peer.spotcheck`` (its spot checks)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import hivemind
import torch

from peer.admission import Credentials
from peer.adverts import Adverts
from peer.bench import free_memory, measure_flops, pick_device
from peer.checks import PlanChecks
from peer.compute import Compute
from peer.config import JoinError, PeerConfig
from peer.epoch import EpochEnv, EpochRunner, Poisoned
from peer.joining import TransportFactory, dht_transport, join_dht
from peer.link import CoordinatorLink
from peer.machine import host_digest, machine_cores
from peer.mailbox import Mailbox
from peer.probing import LinkProber
from peer.stage import ForeignCode, HeldStage, RunRefused
from peer.throttle import Throttle
from protocol.model.job import ModelError
from protocol.model.program import DEFAULT_NAMESPACES
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.tasks import cancel_and_wait, unless_set
from protocol.net.transport import Inbound, PeerUnreachable, Transport
from protocol.trust.identity import Identity, IdentityError, key_hex
from protocol.wire.gate import Gate
from protocol.wire.link_probes import ProbeLink
from protocol.wire.messages import (
    NOT_ADMITTED,
    PROTOCOL_VERSION,
    Abort,
    Activations,
    Advert,
    Assign,
    Audit,
    Beat,
    Certificate,
    Commit,
    EvalActivations,
    Evict,
    Finish,
    Gradients,
    LinkPlan,
    PeerFailure,
    Reachability,
    Recheck,
    Release,
    ReplicaGrads,
    StageProgram,
    StageState,
    Standby,
)
from protocol.wire.reassign import Reassign
from protocol.wire.schema import MessageError

logger = logging.getLogger(__name__)

#: the longest a peer waits for a cancelled epoch to end before it goes on without it
STOP_EPOCH_S = 10.0

__all__ = ["PeerNode", "TransportFactory"]


class PeerNode:
    def __init__(
        self, config: PeerConfig, *, clock: Clock = SYSTEM_CLOCK, transport: TransportFactory = dht_transport
    ) -> None:
        self.config = config
        self.clock = clock
        self._make_transport = transport
        self.device = pick_device(config.device)
        self.throttle = Throttle(config.throttle, on_change=self._event, call_s=config.throttle_call_s)
        self.compute = Compute(self.device, self.throttle)
        self.credentials = Credentials(config, clock)
        self.dht: hivemind.DHT | None = None
        self.transport: Transport | None = None
        self.link: CoordinatorLink | None = None  # once the DHT and the transport are up
        self.adverts: Adverts | None = None
        self.prober: LinkProber | None = None  # the coordinator's probe requests (once the transport is up)
        self.identity: Identity | None = None
        self.checks: PlanChecks | None = None
        self.mailbox = Mailbox()
        self.audits: asyncio.Queue[Inbound] = asyncio.Queue()  # the coordinator's spot checks (peer.spotcheck)
        self.control: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        #: the coordinator said the run ended (Finish or Abort): a reattach under way stops waiting
        self.ended = asyncio.Event()
        self.epoch = -1
        self.step = 0
        self.held: HeldStage | None = None
        self.on_event: Callable[[str], None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._abandoned: list[asyncio.Future[Any]] = []  # epochs that would not end when cancelled
        self._epoch_task: asyncio.Task[None] | None = None
        #: the last epoch's answers to spot checks: they outlive a failed epoch until the coordinator's next word
        self._audit_task: asyncio.Task[None] | None = None
        self._task_epoch = -1  # the epoch the running epoch task serves

    # ---------------------------------------------------------------- joining
    async def start(self) -> None:
        cfg = self.config
        if cfg.throttle_file:
            self.throttle.poll(cfg.throttle_file)  # the file's value, if any, counts from the benchmark on
            self._tasks.append(asyncio.create_task(self.throttle.watch(cfg.throttle_file, clock=self.clock)))
        try:
            self.identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise JoinError(str(exc)) from None
        self.dht = await join_dht(cfg, self.credentials.validators())
        gate = Gate(cfg.run_id)
        self.transport = await self._make_transport(self.dht, self.identity, gate)
        self.transport.direct.allowed = cfg.data_path == "direct"
        self.link = link = CoordinatorLink(
            cfg, self.dht, self.transport, self.identity, self.credentials, self.say, self.clock
        )
        self.adverts = Adverts(
            cfg.run_id,
            cfg.advert_ttl,
            self.dht,
            self.identity,
            self.credentials,
            self.say,
            self.clock,
            shards=lambda: link.shards,  # under its shard of the run's adverts, as the coordinator's record says
        )
        self.prober = LinkProber(self.transport, cfg.run_id, lambda: link.peer_id, cfg.link_probe_bytes, self.clock)
        await self.transport.start()
        self._tasks += [asyncio.create_task(self._dispatch()), asyncio.create_task(self.prober.serve())]
        await self.link.find()
        self.checks = gate.expect = PlanChecks(self.link.peer_id)
        throttle = self.throttle.value
        flops = await self.compute.run(lambda: measure_flops(self.device, throttle=throttle))
        flops = cfg.advertise_flops or flops
        up, down = await self.link.greet()
        self.adverts.advert = Advert(
            peer_id=self.transport.peer_id,
            maddrs=self.link.maddrs,  # as the hello just asked them
            device=str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            flops=flops,
            memory_bytes=free_memory(self.device),
            up_mbps=up,
            down_mbps=down,
            torch_version=str(torch.__version__),
            protocol_version=PROTOCOL_VERSION,
            expires_at=0.0,
            host=host_digest(cfg.run_id),  # peers on one machine share its cores (coordinator.host_share)
            cores=torch.get_num_threads() if self.device.type == "cpu" else 0,
            host_cores=machine_cores(),
        )
        await self.credentials.wait()
        await self.adverts.publish()
        self._tasks.append(asyncio.create_task(self.adverts.refresh()))
        logger.info(
            "joined as %s: %.2f GFLOP/s, up %.0f / down %.0f Mbit/s", self.transport.peer_id, flops / 1e9, up, down
        )

    @property
    def advert(self) -> Advert | None:
        """What this peer advertises (None before it joined)."""
        return self.adverts.advert if self.adverts is not None else None

    @property
    def coordinator_fingerprint(self) -> str:
        """The first 16 hex digits of the coordinator's key: who this peer works for."""
        return self.link.fingerprint if self.link is not None else "unknown"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The operator namespaces this peer runs stage programs from."""
        return (*DEFAULT_NAMESPACES, *self.config.allow_ops)

    # ---------------------------------------------------------------- messages
    async def _dispatch(self) -> None:
        """Route each inbound message: control messages to the serve loop, the rest to
        the current epoch's mailbox."""
        assert self.transport is not None
        while True:
            inbound = await self.transport.inbox.get()
            self._route(inbound)

    def _route(self, inbound: Inbound) -> None:
        msg = inbound.message
        if isinstance(msg, Reassign):
            whole = self._reassigned(msg)
            if whole is None:
                return
            inbound, msg = dataclasses.replace(inbound, message=whole), whole
        if isinstance(msg, (Assign, Standby)):
            if msg.epoch <= self.epoch and self.epoch >= 0:
                logger.warning("ignoring a repeated %s of epoch %d", msg.KIND, msg.epoch)
                return
            self._enter_epoch(msg.epoch, msg if isinstance(msg, Assign) else None)
            self.control.put_nowait((msg.KIND, inbound))
        elif isinstance(msg, (Abort, Evict, Finish)):
            if not isinstance(msg, Evict):
                self.ended.set()
            self.control.put_nowait((msg.KIND, inbound))
        elif isinstance(msg, Certificate):
            assert self.transport is not None and self.link is not None
            self.credentials.take(
                msg, key_hex(self.link.key), self.transport.peer_id, self.link.peer_id, self.transport.gate
            )
        elif isinstance(msg, Reachability):
            assert self.adverts is not None
            self.adverts.take_reachability(msg)
        elif isinstance(msg, Release):
            return
        elif isinstance(msg, ProbeLink):  # of no epoch: asked before a plan is committed
            assert self.prober is not None
            self.prober.take(msg)
        elif getattr(msg, "epoch", self.epoch) != self.epoch:
            logger.info("dropping a %s of epoch %d (this peer is at %d)", msg.KIND, msg.epoch, self.epoch)
        elif isinstance(msg, (LinkPlan, StageState, StageProgram)):
            self.mailbox.put(msg.KIND, inbound)
        elif isinstance(msg, Commit):
            self.mailbox.put(("commit", msg.step), inbound)
        elif isinstance(msg, EvalActivations):  # before Activations: a kind of it
            self.mailbox.put(("evalact", msg.step, msg.mb), inbound)
        elif isinstance(msg, Activations):
            self.mailbox.put(("act", msg.step, msg.mb), inbound)
        elif isinstance(msg, Gradients):
            self.mailbox.put(("grad", msg.step, msg.mb), inbound)
        elif isinstance(msg, ReplicaGrads):
            self.mailbox.put(("rgrad", msg.step, msg.mb), inbound)
        elif isinstance(msg, (Audit, Recheck)):
            self.audits.put_nowait(inbound)
        else:
            logger.warning("unexpected %s from %s", msg.KIND, inbound.sender)

    def _reassigned(self, msg: Reassign) -> Assign | None:
        """The assignment a ``Reassign`` describes, built on the one this peer holds; None for
        a repeat, and for one that does not build on it (the whole is asked for: ``Resend``)."""
        assert self.link is not None
        if msg.epoch <= self.epoch and self.epoch >= 0:
            logger.warning("ignoring a repeated reassign of epoch %d", msg.epoch)
            return None
        held = self.checks.assign if self.checks is not None else None
        try:
            if held is None:
                raise MessageError("this peer holds no assignment")
            return msg.apply(held)
        except MessageError as exc:
            logger.info("asking for the whole assignment of epoch %d: %s", msg.epoch, exc)
            self._tasks.append(asyncio.create_task(self.link.ask_whole(msg.run_id, msg.epoch)))
            return None

    def _enter_epoch(self, epoch: int, a: Assign | None) -> None:
        """From now on frames of older epochs are refused, and this epoch's messages go
        to a fresh mailbox."""
        assert self.transport is not None and self.checks is not None
        self.epoch = self.transport.gate.epoch = epoch
        self.checks.assign = a
        self.mailbox = Mailbox()
        self.serve_audits(None)
        self.audits = asyncio.Queue()

    # ---------------------------------------------------------------- serving
    async def serve(self) -> int:
        """Serve plan epochs (or wait as standby) until the run finishes; returns an
        exit code. Survives new epochs, eviction and a coordinator restart."""
        link = self.link
        assert link is not None
        self._tasks.append(asyncio.create_task(link.watch(self._lost)))
        self._tasks.append(asyncio.create_task(link.beat(self._beat)))
        if self.credentials.private:
            watch = self.credentials.watch(self._renew, lambda: link.reattaching, self._revoke)
            self._tasks.append(asyncio.create_task(watch))
        while True:
            getter = asyncio.ensure_future(self.control.get())
            waits: set[asyncio.Future[Any]] = {getter}
            if self._epoch_task is not None:
                waits.add(self._epoch_task)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
            # both at once: the epoch's end first (its failure is reported, a refusal to run its code ends serving)
            code = await self._epoch_ended() if self._epoch_task in done else None
            if code is None and getter in done:
                code = await self._control(*getter.result())
            if code is not None:
                return code

    def _beat(self) -> Beat | None:
        """This peer's heartbeat while it is in the plan (also after its last step, until
        the run finishes); None while it is not."""
        if self.checks is None or self.checks.assign is None:
            return None
        return Beat(self.config.run_id, self.step, self.epoch)

    def _lost(self, reason: str) -> None:
        self.control.put_nowait(("lost", reason))

    def _revoke(self, reason: str) -> None:
        self.control.put_nowait(("revoked", reason))

    async def _renew(self) -> None:
        """Say hello again, the stage still held: the coordinator renews the certificate."""
        assert self.link is not None
        await self.link.hello(again=False)

    async def _control(self, kind: str, item: Any) -> int | None:
        """Act on one control event; an exit code ends serving."""
        if kind == "revoked":  # leaving: nothing of the epoch is needed
            raise JoinError(item)
        if kind == "abort" and item.message.reason.startswith(NOT_ADMITTED):
            raise JoinError(f"the coordinator no longer admits this peer: {item.message.reason[len(NOT_ADMITTED) :]}")
        if kind == "evict" and self._overtaken(item.message):  # leave the newer epoch's runner be
            return None
        await self._stop_epoch()
        if kind == "assign":
            return await self._assigned(item.message)
        if kind == "standby":
            self.held = None
            self.say(f"epoch {item.message.epoch}: the plan does not use this peer; waiting as standby")
        elif kind == "evict":
            assert self.checks is not None and self.link is not None
            if self._overtaken(item.message):  # routed while the last epoch stopped: its Assign is next
                return None
            self.held = self.checks.assign = None
            self.say(f"dropped from the run: {item.message.reason}; joining again as a standby peer")
            try:
                await self.link.hello()
            except (PeerUnreachable, asyncio.TimeoutError) as exc:  # the coordinator watch will tell
                logger.warning("could not say hello again: %s", exc)
        elif kind == "finish":
            self.say("the run is finished")
            return 0
        elif kind == "abort":
            logger.error("the coordinator aborted the run: %s", item.message.reason)
            self.say(f"the coordinator aborted the run: {item.message.reason}")
            return 1
        elif kind == "lost":
            return await self._reattach(item)
        return None

    def _overtaken(self, evict: Evict) -> bool:
        """An Assign of an epoch after the eviction's was routed: the coordinator took this
        peer back, and the eviction is void (a hello again would drop it from that plan)."""
        a = self.checks.assign if self.checks is not None else None
        if a is None or a.epoch <= evict.epoch:
            return False
        logger.info("epoch %d's assignment overtook the eviction of epoch %d", a.epoch, evict.epoch)
        return True

    async def _assigned(self, a: Assign) -> int | None:
        """Start serving an assignment's epoch (or refuse it: exit code 2 if this peer
        can never serve the run). An assignment overtaken while the loop stopped the last
        epoch (a newer Assign or Standby was routed: its own control item is next) is
        not served: the mailbox and checks now belong to the newer epoch."""
        if a.epoch != self.epoch:
            logger.info("not serving epoch %d: the coordinator moved on to epoch %d meanwhile", a.epoch, self.epoch)
            return None
        self.say(
            f"epoch {a.epoch}: serving stage {a.stage} (replica {a.replica}) of {len(a.stages)} "
            f"from step {a.start_step}"
        )
        try:
            runner = EpochRunner(self, self._epoch_env(), a, self.mailbox)
        except RunRefused as exc:
            self.say(f"refused the assignment: {exc}")
            await self._report_failure(f"refused the assignment: {exc}", epoch=a.epoch)
            return 2 if isinstance(exc, ForeignCode) else None  # the run's model will not change: leave
        self._epoch_task = asyncio.create_task(runner.run())
        self._task_epoch = a.epoch
        return None

    def _epoch_env(self) -> EpochEnv:
        assert self.transport is not None and self.link is not None and self.checks is not None
        advert = self.advert
        return EpochEnv(
            config=self.config,
            transport=self.transport,
            coordinator=self.link.peer_id,
            coordinator_key=self.link.key,
            checks=self.checks,
            compute=self.compute,
            audits=self.audits,
            namespaces=self.namespaces,
            memory_bytes=advert.memory_bytes if advert is not None else None,
            up_mbps=advert.up_mbps if advert is not None else 0.0,
        )

    async def _epoch_ended(self) -> int | None:
        """The epoch task ended: done with the run's steps (wait for Finish), or failed
        (report it to the coordinator, who starts a new epoch); a stage this peer will
        not run ends its serving (exit code 2)."""
        task, self._epoch_task = self._epoch_task, None
        assert task is not None
        epoch = self._task_epoch
        try:
            task.result()
        except ForeignCode as exc:
            self.say(f"refused the stage: {exc}")
            await self._report_failure(f"refused the stage: {exc}", epoch=epoch)
            return 2
        except PeerUnreachable as exc:
            await self._report_failure(str(exc), exc.peer_id, epoch)
        except Poisoned as exc:
            await self._report_failure(str(exc), exc.sender, epoch, poison=True, evidence=exc.evidence)
        except ModelError as exc:
            self.say(str(exc))
            await self._report_failure(str(exc), epoch=epoch, model=True)
        except (RunRefused, asyncio.TimeoutError) as exc:
            await self._report_failure(str(exc) or "timed out waiting for a message", epoch=epoch)
        except Exception as exc:  # anything else this peer cannot go on with: the coordinator re-plans
            logger.exception("the epoch failed")
            await self._report_failure(f"{type(exc).__name__}: {exc}", epoch=epoch)
        return None

    def serve_audits(self, task: asyncio.Task[None] | None) -> None:
        """``task`` answers the coordinator's spot checks from now on (None: no one)."""
        if self._audit_task is not None:
            self._audit_task.cancel()
        self._audit_task = task

    async def _stop_epoch(self) -> None:
        """Cancel the running epoch and its spot-check answers, and wait for its compute
        to finish (the stage's state is then consistent: see EpochRunner._reconcile)."""
        self.serve_audits(None)
        task, self._epoch_task = self._epoch_task, None
        if task is not None:
            if not await cancel_and_wait(task, STOP_EPOCH_S):
                logger.warning("the cancelled epoch did not end within %.0f s; going on without it", STOP_EPOCH_S)
                self.held = None  # it may still change the stage: the next plan must not keep it
                self._abandoned.append(task)
            await self.compute.run(lambda: None)

    async def _report_failure(
        self,
        reason: str,
        suspect: str = "",
        epoch: int = -1,
        poison: bool = False,
        evidence: list[Any] | None = None,
        model: bool = False,
    ) -> None:
        assert self.link is not None
        logger.error("%s", reason)
        stage = self.checks.assign.stage if self.checks and self.checks.assign else -1
        failure = PeerFailure(self.config.run_id, stage, reason, epoch, suspect, poison, model)
        await self.link.report(failure, evidence)

    async def _reattach(self, reason: str) -> int | None:
        """Wait up to the grace period for the coordinator to come back (its record
        signed by the pinned key, answering a hello); then wait for a stage again. The
        run's end notice (``finish``, ``abort``) stops the wait at once."""
        assert self.checks is not None and self.link is not None and self.transport is not None
        grace = self.config.coordinator_grace
        self.say(f"lost the coordinator ({reason}); waiting up to {grace:.0f} s for it to come back")
        self.held = self.checks.assign = None
        self.credentials.forget()
        back = await unless_set(self.link.reattach(grace, self._rejoined), self.ended, STOP_EPOCH_S)
        if back is None:  # the run ended meanwhile: its notice is next in the control queue
            return None
        if not back:
            self.say(f"the coordinator did not come back within {grace:.0f} s; leaving")
            return 1
        self.say("the coordinator is back; waiting for a stage")
        return None

    def _rejoined(self, coordinator: str) -> None:
        """The coordinator is back as ``coordinator``: a resumed one continues the epochs,
        a fresh one starts again at 0."""
        assert self.checks is not None and self.transport is not None
        self.checks.coordinator = coordinator
        self.epoch = self.transport.gate.epoch = -1

    def say(self, text: str) -> None:
        """Tell the volunteer (logged, and to ``on_event``)."""
        logger.info("%s", text)
        self._event(text)

    def _event(self, text: str) -> None:
        if self.on_event is not None:
            self.on_event(text)

    async def aclose(self) -> None:
        self.serve_audits(None)
        for t in [*self._tasks, *self._abandoned, *([self._epoch_task] if self._epoch_task else [])]:
            t.cancel()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()
        self.compute.shutdown()
