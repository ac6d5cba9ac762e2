"""The volunteer peer: joins the DHT, measures itself, advertises, and serves the
stage the coordinator assigns until the run ends."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer.bench import free_memory, measure_flops, pick_device
from peer.checks import PlanChecks
from peer.epoch import EpochRunner, ForeignCode, HeldStage, Poisoned, RunRefused
from peer.mailbox import Mailbox
from peer.throttle import Throttle
from protocol.model.job import ModelError
from protocol.model.program import DEFAULT_NAMESPACES
from protocol.net.reach import HOW_TO_BE_REACHABLE
from protocol.net.records import publish_record, read_records
from protocol.net.tasks import cancel_and_wait, honour_cancel
from protocol.net.transport import Inbound, PeerUnreachable, Transport
from protocol.trust.admission import CertificateError, check_certificate, hello_proof, issued_at, lifetime
from protocol.trust.identity import Identity, IdentityError, check_record, key_hex, public_key
from protocol.trust.run_records import RunRecords
from protocol.trust.text import clean
from protocol.wire.gate import Gate
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
    CoordinatorRecord,
    EvalActivations,
    Evict,
    Finish,
    Gradients,
    Hello,
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

#: the longest a DHT store or get may take (awaited as futures: see coordinator.swarm)

logger = logging.getLogger(__name__)

#: seconds between a serving peer's heartbeats
BEAT_S = 1.0
#: the coordinator counts as lost when it cannot be reached for this long
LOST_AFTER_S = 3.0
#: how long a peer in a private swarm waits for its admission certificate after its hello
CERT_WAIT_S = 20.0
#: the longest a peer waits for a cancelled epoch to end before it goes on without it
STOP_EPOCH_S = 10.0
#: the longest a peer waits for its DHT to tell its addresses
MADDRS_TIMEOUT_S = 5.0

__all__ = ["JoinError", "PeerConfig", "PeerNode", "RunRefused"]


class JoinError(RuntimeError):
    """The peer could not join the swarm; ``str()`` says why in one line."""


def revoked(late: float) -> str:
    """Why a peer whose admission certificate ran out leaves (one line)."""
    return (
        f"this peer's admission certificate ran out {late:.0f} s ago, and the coordinator neither renewed it "
        f"nor answered a hello within {CERT_WAIT_S:.0f} s; every peer of the swarm refuses this one now"
    )


@dataclass
class PeerConfig:
    initial_peers: list[str]
    run_id: str = "fusionllm"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)  # where others should dial it (a forwarded port)
    device: str | None = None
    advert_ttl: float = 6.0
    join_timeout: float = 30.0
    bandwidth_probe_bytes: int = 4 << 20
    link_probe_bytes: int = 1 << 20
    message_timeout: float = 600.0
    identity: str | None = None  # key file; None: a fresh key for this process only
    coordinator_grace: float = 120.0  # how long to wait for a lost coordinator to come back
    throttle: float = 1.0  # compute at this fraction of the peer's speed (peer.throttle); in (0, 1]
    throttle_file: str | None = None  # read the throttle from this file about once a second while running
    advertise_flops: float | None = None  # advertise this instead of the measured FLOP/s (a lying peer, for tests)
    coordinator_key: str | None = None  # the coordinator's Ed25519 key (hex), pinned; None: trust on first use
    allow_code: list[str] = field(default_factory=list)  # model modules (MODULE or file.py) this peer may import
    allow_ops: list[str] = field(default_factory=list)  # operator namespaces a stage program may call beyond aten
    swarm_secret: str = ""  # a private swarm's secret (hex, from its join token): proven in the hello


class PeerNode:
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dht: hivemind.DHT | None = None
        self.transport: Transport | None = None
        self.mailbox = Mailbox()
        self.audits: asyncio.Queue[Inbound] = asyncio.Queue()  # the coordinator's spot checks (peer.audit)
        self.coordinator: CoordinatorRecord | None = None
        self._foreign: dict[str, object] = {}  # key (hex) -> the other protocol version its coordinator record speaks
        self.advert: Advert | None = None
        #: this peer's addresses as its DHT last told them (see ``_visible_maddrs``)
        self.maddrs: list[str] = []
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
        self._tasks: list[asyncio.Task[Any]] = []
        self._abandoned: list[asyncio.Future[Any]] = []  # epochs that would not end when cancelled
        self.identity: Identity | None = None
        self.checks: PlanChecks | None = None
        self.coordinator_key: Any = None  # pinned at the first contact (trust on first use)
        self.certificate: dict[str, Any] | None = None  # this peer's admission certificate, renewed by the coordinator
        self._certified_at = 0.0  # time.monotonic() when the last one came
        self.control: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.epoch = -1
        self.step = 0
        self.held: HeldStage | None = None
        self.on_event: Callable[[str], None] | None = None
        self._epoch_task: asyncio.Task[None] | None = None
        #: the last epoch's answers to spot checks: they outlive a failed epoch until the coordinator's next word
        self._audit_task: asyncio.Task[None] | None = None
        self._task_epoch = -1  # the epoch the running epoch task serves
        self._reattaching = False
        self.throttle = Throttle(config.throttle, on_change=self._event)  # ThrottleError if out of (0, 1]

    # ---------------------------------------------------------------- joining
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.throttle_file:
            self.throttle.poll(cfg.throttle_file)  # the file's value, if any, counts from the benchmark on
            self._tasks.append(asyncio.create_task(self.throttle.watch(cfg.throttle_file)))
        try:
            self.identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise JoinError(str(exc)) from None
        try:
            self.dht = await asyncio.wait_for(
                loop.run_in_executor(
                    None,
                    lambda: hivemind.DHT(
                        initial_peers=cfg.initial_peers,
                        host_maddrs=cfg.host_maddrs,
                        announce_maddrs=cfg.announce_maddrs or None,
                        record_validators=self._validators(),
                        start=True,
                    ),
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
        self.coordinator_key = key
        gate.admit(self.coordinator.peer_id, key)
        self.checks = gate.expect = PlanChecks(self.coordinator.peer_id)
        self.transport.learn(self.coordinator.peer_id, self.coordinator.maddrs)
        self.transport.forwarders = {self.coordinator.peer_id}  # frames of NAT'd peers come through it
        throttle = self.throttle.value
        flops = await loop.run_in_executor(self._compute, lambda: measure_flops(self.device, throttle=throttle))
        flops = cfg.advertise_flops or flops
        try:
            # hello first: the coordinator answers probes of admitted peers only
            await self.transport.send(self.coordinator.peer_id, await self._hello_message(again=False))
            up, down = await self.transport.measure_bandwidth(self.coordinator.peer_id, cfg.bandwidth_probe_bytes)
        except (PeerUnreachable, ConnectionError, asyncio.IncompleteReadError) as exc:
            raise JoinError(
                f"the coordinator {self.coordinator.peer_id} did not admit this peer or cannot be reached ({exc}); "
                "a private swarm admits only peers joined with its --token"
            ) from None
        self.advert = Advert(
            peer_id=self.transport.peer_id,
            maddrs=self.maddrs,  # as the hello just asked them
            device=str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            flops=flops,
            memory_bytes=free_memory(self.device),
            up_mbps=up,
            down_mbps=down,
            torch_version=str(torch.__version__),
            protocol_version=PROTOCOL_VERSION,
            expires_at=0.0,
        )
        await self._certified()
        await self._publish()
        self._tasks.append(asyncio.create_task(self._refresh_adverts()))
        logger.info(
            "joined as %s: %.2f GFLOP/s, up %.0f / down %.0f Mbit/s", self.advert.peer_id, flops / 1e9, up, down
        )

    async def _find_coordinator(self) -> tuple[CoordinatorRecord, Any]:
        """The run's coordinator: the one whose key is pinned (``--coordinator-key``), or,
        unpinned, the only one claiming the run (trusted on first use, and said so)."""
        run, pinned = self.config.run_id, self.config.coordinator_key
        deadline = time.monotonic() + self.config.join_timeout
        others: set[str] = set()
        while time.monotonic() < deadline:
            records = await self._coordinator_records()
            if pinned:
                self._refuse_other_version(pinned, records)
                if pinned in records:
                    return records[pinned], public_key(pinned)
                others |= set(records)
            elif len(records) == 1:
                ((hexkey, rec),) = records.items()
                self._say(f"trusting the coordinator of run '{run}' on first use: key {hexkey} "
                          f"(pin it with --coordinator-key {hexkey})")  # fmt: skip
                return rec, public_key(hexkey)
            elif len(records) > 1:
                keys = ", ".join(k[:16] + "..." for k in sorted(records))
                raise JoinError(f"{len(records)} coordinators claim run '{run}' (keys {keys}); pass the "
                                "--coordinator-key that your coordinator printed")  # fmt: skip
            await asyncio.sleep(0.5)
        if not pinned and len(self._foreign) == 1:  # unpinned: anyone may claim the run, so only at the end
            self._refuse_other_version(next(iter(self._foreign)), {})
        ignored = f" ({len(others)} other claims of the run ignored)" if others else ""
        whose = " signed by the pinned key" if pinned else ""
        raise JoinError(
            f"no coordinator{whose} for run '{run}' in the DHT after {self.config.join_timeout:.0f} s{ignored}"
        )

    def _refuse_other_version(self, key: str, records: dict[str, CoordinatorRecord]) -> None:
        """A JoinError if the coordinator of ``key`` claims the run, fresh, only in
        another protocol version than this peer's."""
        foreign = self._foreign
        if key not in records and key in foreign:
            raise JoinError(
                f"the coordinator of run '{self.config.run_id}' speaks protocol version {clean(str(foreign[key]))[:20]}"
                f"; this peer speaks {PROTOCOL_VERSION}: install the fusionllm version the coordinator runs"
            )

    def _note_version(self, signer: str, record: dict[str, Any]) -> None:
        """Remember a signed coordinator record of this run, fresh, in another protocol
        version (forget it once the signer speaks this peer's)."""
        version = record.get("v")
        if version == PROTOCOL_VERSION:
            self._foreign.pop(signer, None)
            return
        expires = record.get("expires_at")
        fresh = isinstance(expires, (int, float)) and expires > get_dht_time()
        if fresh and record.get("run_id") == self.config.run_id:
            self._foreign[signer] = version

    async def _coordinator_records(self) -> dict[str, CoordinatorRecord]:
        """The run's fresh, validly signed coordinator records in the DHT, by key (hex).
        Each coordinator stores its record under its own key, so an outsider's claim
        cannot hide the real one."""
        assert self.dht is not None
        out = {}
        for value in (await read_records(self.dht, self.config.run_id, "coordinator")).values():
            try:
                signer = key_hex(check_record(value))
                self._note_version(signer, value)
                rec = CoordinatorRecord.from_header(value)
            except Exception as exc:
                logger.debug("ignoring a bad coordinator record: %s", exc)
                continue
            fresh = isinstance(rec, CoordinatorRecord) and rec.expires_at > get_dht_time()
            if fresh and rec.run_id == self.config.run_id:
                out[signer] = rec
        return out

    def _validators(self) -> list[RunRecords]:
        """A private swarm's DHT rule (the coordinator's key is pinned by the token)."""
        cfg = self.config
        return [RunRecords(cfg.run_id, cfg.coordinator_key)] if cfg.swarm_secret and cfg.coordinator_key else []

    async def _certified(self) -> None:
        """Wait (a private swarm: the DHT stores only adverts with one) for the admission
        certificate the coordinator sends after the hello."""
        deadline = time.monotonic() + CERT_WAIT_S
        while self.config.swarm_secret and self.certificate is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.config.swarm_secret and self.certificate is None:
            raise JoinError(f"the coordinator sent no admission certificate within {CERT_WAIT_S:.0f} s")

    def _take_certificate(self, msg: Certificate) -> None:
        """Keep this peer's renewed certificate (for its advert), and take when the
        planned peers' certificates end (the gate refuses senders past theirs)."""
        assert self.transport is not None and self.coordinator is not None
        try:  # not against this machine's clock, which may be off: its lifetime is what counts
            check_certificate(msg.cert, key_hex(self.coordinator_key), self.config.run_id, -math.inf)
        except CertificateError as exc:
            logger.warning("ignoring a certificate: %s", exc)
            return
        mine = msg.cert.get("peer_id") == self.transport.peer_id
        if mine and issued_at(msg.cert) >= issued_at(self.certificate or {}):  # never an older one
            self.certificate, self._certified_at = msg.cert, time.monotonic()
        gate = self.transport.gate
        for p, end in msg.expires.items():
            if p in gate.keys and p != self.coordinator.peer_id and math.isfinite(end):
                gate.until[p] = end

    def _take_reachability(self, msg: Reachability) -> None:
        """Say whether the coordinator could dial this peer back, and what to do if not
        (and say it in the advert too, from its next refresh on)."""
        if self.advert is not None:
            self.advert = dataclasses.replace(self.advert, reach="direct" if msg.direct else "nat")
        if msg.direct:
            self._say(f"reachable: the coordinator {clean(msg.detail)[:200]}")
            return
        port = msg.ports[0] if msg.ports else "<port>"
        self._say(
            f"behind a NAT: the coordinator {clean(msg.detail)[:300]}. This peer dials out to the peers it works "
            f"with (peers that can be dialled forward frames between two that cannot). To be reachable: "
            + HOW_TO_BE_REACHABLE.format(port=port)
        )

    async def _publish(self) -> None:
        assert self.dht is not None and self.advert is not None and self.identity is not None
        expires = get_dht_time() + self.config.advert_ttl
        ad = Advert(**{**self.advert.__dict__, "expires_at": expires, "cert": self.certificate or {}})
        await publish_record(self.dht, self.identity, self.config.run_id, "adverts", ad.peer_id, ad.header(), expires)

    async def _refresh_adverts(self) -> None:
        while True:
            await asyncio.sleep(self.config.advert_ttl / 3)
            try:
                await self._publish()
            except Exception as exc:  # the DHT may hiccup; the next refresh retries
                honour_cancel()
                logger.warning("advert refresh failed: %s", exc)

    # ---------------------------------------------------------------- messages
    async def _dispatch(self) -> None:
        """Route each inbound message: control messages to the serve loop, the rest to
        the current epoch's mailbox."""
        assert self.transport is not None
        while True:
            inbound = await self.transport.inbox.get()
            msg = inbound.message
            if isinstance(msg, (Assign, Standby)):
                if msg.epoch <= self.epoch and self.epoch >= 0:
                    logger.warning("ignoring a repeated %s of epoch %d", msg.KIND, msg.epoch)
                    continue
                self._enter_epoch(msg.epoch, msg if isinstance(msg, Assign) else None)
                self.control.put_nowait((msg.KIND, inbound))
            elif isinstance(msg, (Abort, Evict, Finish)):
                self.control.put_nowait((msg.KIND, inbound))
            elif isinstance(msg, Certificate):
                self._take_certificate(msg)
            elif isinstance(msg, Reachability):
                self._take_reachability(msg)
            elif isinstance(msg, Release):
                continue
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

    def _enter_epoch(self, epoch: int, a: Assign | None) -> None:
        """From now on frames of older epochs are refused, and this epoch's messages go
        to a fresh mailbox."""
        assert self.transport is not None and self.checks is not None
        self.epoch = self.transport.gate.epoch = epoch
        self.checks.assign = a
        self.mailbox = Mailbox()
        self.serve_audits(None)
        self.audits = asyncio.Queue()

    async def run_compute(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the stage's compute thread (one at a time, in order)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # ---------------------------------------------------------------- serving
    async def serve(self) -> int:
        """Serve plan epochs (or wait as standby) until the run finishes; returns an
        exit code. Survives new epochs, eviction and a coordinator restart."""
        assert self.transport is not None and self.coordinator is not None
        self._tasks.append(asyncio.create_task(self._watch_coordinator()))
        self._tasks.append(asyncio.create_task(self._beat()))
        if self.config.swarm_secret:
            self._tasks.append(asyncio.create_task(self._watch_certificate()))
        while True:
            getter = asyncio.ensure_future(self.control.get())
            waits: set[asyncio.Future[Any]] = {getter}
            if self._epoch_task is not None:
                waits.add(self._epoch_task)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                code = await self._epoch_ended()
                if code is not None:
                    return code
                continue
            kind, item = getter.result()
            code = await self._control(kind, item)
            if code is not None:
                return code

    async def _control(self, kind: str, item: Any) -> int | None:
        """Act on one control event; an exit code ends serving."""
        if kind == "revoked":  # leaving: nothing of the epoch is needed
            raise JoinError(item)
        if kind == "abort" and item.message.reason.startswith(NOT_ADMITTED):
            raise JoinError(f"the coordinator no longer admits this peer: {item.message.reason[len(NOT_ADMITTED) :]}")
        await self._stop_epoch()
        if kind == "assign":
            a: Assign = item.message
            self._say(
                f"epoch {a.epoch}: serving stage {a.stage} (replica {a.replica}) of {len(a.stages)} "
                f"from step {a.start_step}"
            )
            try:
                runner = EpochRunner(self, a, self.mailbox)
            except RunRefused as exc:
                self._say(f"refused the assignment: {exc}")
                await self._report_failure(f"refused the assignment: {exc}", epoch=a.epoch)
                return 2 if isinstance(exc, ForeignCode) else None  # the run's model will not change: leave
            self._epoch_task = asyncio.create_task(runner.run())
            self._task_epoch = a.epoch
        elif kind == "standby":
            self.held = None
            self._say(f"epoch {item.message.epoch}: the plan does not use this peer; waiting as standby")
        elif kind == "evict":
            self.held = self.checks.assign = None
            self._say(f"dropped from the run: {item.message.reason}; joining again as a standby peer")
            try:
                await self._hello()
            except (PeerUnreachable, asyncio.TimeoutError) as exc:  # the coordinator watch will tell
                logger.warning("could not say hello again: %s", exc)
        elif kind == "finish":
            self._say("the run is finished")
            return 0
        elif kind == "abort":
            logger.error("the coordinator aborted the run: %s", item.message.reason)
            self._say(f"the coordinator aborted the run: {item.message.reason}")
            return 1
        elif kind == "lost":
            return await self._reattach(item)
        return None

    @property
    def coordinator_fingerprint(self) -> str:
        """The first 16 hex digits of the coordinator's key: who this peer works for."""
        return key_hex(self.coordinator_key)[:16] if self.coordinator_key is not None else "unknown"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The operator namespaces this peer runs stage programs from."""
        return (*DEFAULT_NAMESPACES, *self.config.allow_ops)

    async def _epoch_ended(self) -> int | None:
        """The epoch task ended: done with the run's steps (wait for Finish), or failed
        (report it to the coordinator, who starts a new epoch); a stage this peer will
        not run ends its serving (exit code 2)."""
        task, self._epoch_task = self._epoch_task, None
        assert task is not None
        try:
            task.result()
        except ForeignCode as exc:
            self._say(f"refused the stage: {exc}")
            await self._report_failure(f"refused the stage: {exc}", epoch=self._task_epoch)
            return 2
        except PeerUnreachable as exc:
            await self._report_failure(str(exc), exc.peer_id, self._task_epoch)
        except Poisoned as exc:
            await self._report_failure(str(exc), exc.sender, self._task_epoch, poison=True, evidence=exc.evidence)
        except ModelError as exc:
            self._say(str(exc))
            await self._report_failure(str(exc), epoch=self._task_epoch, model=True)
        except (RunRefused, asyncio.TimeoutError) as exc:
            await self._report_failure(str(exc) or "timed out waiting for a message", epoch=self._task_epoch)
        except Exception as exc:  # anything else this peer cannot go on with: the coordinator re-plans
            logger.exception("the epoch failed")
            await self._report_failure(f"{type(exc).__name__}: {exc}", epoch=self._task_epoch)
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
            await self.run_compute(lambda: None)

    async def _report_failure(
        self,
        reason: str,
        suspect: str = "",
        epoch: int = -1,
        poison: bool = False,
        evidence: list[Any] | None = None,
        model: bool = False,
    ) -> None:
        assert self.transport is not None and self.coordinator is not None
        logger.error("%s", reason)
        stage = self.checks.assign.stage if self.checks and self.checks.assign else -1
        try:
            msg = PeerFailure(self.config.run_id, stage, reason, epoch, suspect, poison, model)
            await asyncio.wait_for(self.transport.send(self.coordinator.peer_id, msg, evidence), 30)
        except (PeerUnreachable, asyncio.TimeoutError):
            pass

    def _say(self, text: str) -> None:
        logger.info("%s", text)
        self._event(text)

    def _event(self, text: str) -> None:
        if self.on_event is not None:
            self.on_event(text)

    # ---------------------------------------------------------------- the coordinator
    async def _hello(self, again: bool = True) -> None:
        """Say hello again: after an eviction or a lost coordinator (``again``: no stage
        held), or to have a lapsed certificate renewed (the stage still held)."""
        assert self.transport is not None and self.coordinator is not None and self.identity is not None
        hello = await self._hello_message(again=again)
        await asyncio.wait_for(self.transport.send(self.coordinator.peer_id, hello), 5)

    async def _visible_maddrs(self) -> list[str]:
        """This peer's addresses as its DHT sees them now (relayed ones appear later),
        awaited (hivemind's own call blocks the event loop until the DHT process
        answers), or as last told if it does not answer within ``MADDRS_TIMEOUT_S``."""
        if self.dht is not None:
            ask = self.dht.run_coroutine(hivemind.DHT._get_visible_maddrs, return_future=True)
            try:
                self.maddrs = [str(m) for m in await asyncio.wait_for(ask, MADDRS_TIMEOUT_S)]
            except asyncio.TimeoutError:
                logger.warning("the DHT did not tell this peer's addresses within %.0f s", MADDRS_TIMEOUT_S)
        return self.maddrs

    async def _hello_message(self, again: bool) -> Hello:
        """Hello, with the proof that this peer holds a private swarm's secret (if given)."""
        assert self.identity is not None and self.transport is not None
        cfg, key = self.config, self.identity.public_hex
        proof = hello_proof(cfg.swarm_secret, cfg.run_id, self.transport.peer_id, key) if cfg.swarm_secret else ""
        return Hello(cfg.run_id, key, again=again, proof=proof, maddrs=await self._visible_maddrs())

    async def _beat(self) -> None:
        """Heartbeats while this peer is in the plan (also after its last step, until
        the run finishes): the coordinator's stall detector."""
        assert self.transport is not None and self.coordinator is not None and self.checks is not None
        while True:
            await asyncio.sleep(BEAT_S)
            if self.checks.assign is None or self._reattaching:
                continue
            try:
                beat = Beat(self.config.run_id, self.step, self.epoch)
                await asyncio.wait_for(self.transport.send(self.coordinator.peer_id, beat), 5)
            except (PeerUnreachable, asyncio.TimeoutError) as exc:
                honour_cancel()
                logger.debug("heartbeat failed: %s", exc)

    async def _watch_coordinator(self) -> None:
        """Report the coordinator lost once its connection is gone and cannot be made
        again for ``LOST_AFTER_S``."""
        assert self.transport is not None and self.coordinator is not None
        down_since: float | None = None
        while True:
            await asyncio.sleep(1.0)
            if self._reattaching:
                down_since = None
                continue
            cid = self.coordinator.peer_id
            try:
                if cid not in await self.transport.connected():
                    await asyncio.wait_for(self.transport.connect(cid), 2)
                down_since = None
            except Exception as exc:
                honour_cancel()
                logger.debug("the coordinator is unreachable: %s", exc)
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since >= LOST_AFTER_S:
                    self._reattaching = True
                    self.control.put_nowait(
                        ("lost", f"its connection dropped and it cannot be reached for {now - down_since:.0f} s")
                    )

    async def _watch_certificate(self) -> None:
        """A private swarm: once this peer's certificate has gone a whole lifetime without
        renewal (the coordinator not lost), say hello again: the coordinator renews it, or
        answers why it no longer admits this peer (banned, excluded: see ``_control``).
        Neither within ``CERT_WAIT_S``: leave, for every peer refuses this one now."""
        asked: float | None = None
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if self.certificate is None or self._reattaching:  # the clock starts again
                self._certified_at, asked = now, None
                continue
            late = now - self._certified_at - lifetime(self.certificate)
            if late <= 0:
                asked = None
            elif asked is None:
                asked = now
                try:
                    await self._hello(again=False)
                except Exception as exc:  # unreachable, or anything else: the wait below decides
                    honour_cancel()
                    logger.debug("could not say hello again: %s", exc)
            elif now - asked > CERT_WAIT_S:
                self.control.put_nowait(("revoked", revoked(late)))
                return

    async def _reattach(self, reason: str) -> int | None:
        """Wait up to the grace period for the coordinator's record (signed by the
        pinned key) to reappear and answer a hello; then wait for a stage again."""
        assert self.transport is not None
        grace = self.config.coordinator_grace
        self._say(f"lost the coordinator ({reason}); waiting up to {grace:.0f} s for it to come back")
        self.held = self.checks.assign = None
        self.certificate = None  # a coordinator that comes back may have its clock set back: take its next one
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                rec = await self._lookup_coordinator()
                if rec is not None:
                    self.coordinator = rec
                    assert self.checks is not None
                    self.checks.coordinator = rec.peer_id
                    self.transport.gate.admit(rec.peer_id, self.coordinator_key)
                    self.transport.learn(rec.peer_id, rec.maddrs)
                    self.transport.forget(rec.peer_id)
                    # a resumed coordinator continues the epochs, a fresh one starts again at 0
                    self.epoch = self.transport.gate.epoch = -1
                    await self._hello()
                    self._reattaching = False
                    self._say("the coordinator is back; waiting for a stage")
                    return None
            except (PeerUnreachable, asyncio.TimeoutError, ConnectionError) as exc:
                logger.debug("reattaching failed: %s", exc)
            await asyncio.sleep(1.0)
        self._say(f"the coordinator did not come back within {grace:.0f} s; leaving")
        return 1

    async def _lookup_coordinator(self) -> CoordinatorRecord | None:
        """The run's coordinator record in the DHT, if signed by the pinned key and fresh."""
        return (await self._coordinator_records()).get(key_hex(self.coordinator_key))

    async def aclose(self) -> None:
        self.serve_audits(None)
        for t in [*self._tasks, *self._abandoned, *([self._epoch_task] if self._epoch_task else [])]:
            t.cancel()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()
        self._compute.shutdown(wait=False, cancel_futures=True)
