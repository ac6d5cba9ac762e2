"""The coordinator of a swarm run: hosts (or joins) the DHT, reads the peers'
adverts, assigns stages, feeds micro-batches, watches for dead peers, and
gathers the trained weights."""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from coordinator.assign import Assignment
from coordinator.checkpoint import DB_NAME, CheckpointError, RunDir, default_run_dir
from coordinator.config import CoordinatorConfig
from coordinator.links import choose_codecs, float_bytes
from coordinator.outcome import LinkReport, RunSummary, StepReport, SwarmError
from coordinator.private import SECRET_FILE, Admission
from coordinator.run import Driver
from coordinator.runstate import BANNED, EXCLUDED, RunState
from coordinator.status import StatusBoard
from coordinator.web import StatusServer
from protocol.net.ports import PortTaken, check_listen_ports
from protocol.net.reach import DIAL_BACK_TIMEOUT_S, dial_back, observed_ip, tcp_ports
from protocol.net.records import publish_record, read_records
from protocol.net.tasks import cancel_all, honour_cancel
from protocol.net.transport import Inbound, PeerUnreachable, Transport
from protocol.trust.admission import issue_certificate, renewal_period, renewal_send_s
from protocol.trust.advert_check import advert_problem
from protocol.trust.identity import Identity, IdentityError, check_record, key_hex
from protocol.trust.run_records import RunRecords
from protocol.trust.spotcheck import step_overhead
from protocol.wire.codecs import Codec
from protocol.wire.envelope import Envelope
from protocol.wire.gate import Gate
from protocol.wire.messages import (
    NOT_ADMITTED,
    Abort,
    Advert,
    Certificate,
    CoordinatorRecord,
    Evidence,
    Message,
    Reachability,
    Verdict,
    kinds_from,
)
from protocol.wire.reject import Reject, Rejected

CLOSE_WAIT_S = 5.0  # how long closing waits for the coordinator's own background tasks to end
#: what peers may send the coordinator
_FROM_PEERS = kinds_from("peer")
logger = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.dht: hivemind.DHT | None = None
        self.transport: Transport | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._certifying: set[asyncio.Task[None]] = set()
        self.adverts: dict[str, Advert] = {}
        self.identity: Identity | None = None
        self.gate = Gate(config.run_id)
        self.gate.accept_hello = True
        self.gate.expect = self._expect
        self.board = StatusBoard(config.run_id, config.job.steps)
        self.gate.listeners.append(self.board.reject)
        self.status: StatusServer | None = None
        self.run_dir: RunDir | None = None
        self.driver: Driver | None = None
        self.admission: Admission | None = None
        self.private = config.private
        self._told: dict[str, float] = {}  # refused senders -> when they were told why
        self.reached: dict[str, bool] = {}  # admitted peer -> whether it could be dialled back (protocol.net.reach)
        self._hello_ports: dict[str, list[int]] = {}  # the ports its hello said it listens on
        self._telling: set[asyncio.Task[None]] = set()
        self._refused: dict[str, str] = {}  # peer -> why its advert is ignored (said once)
        self.banned: set[str] = set()  # peers the host banned during this run (each lost for that reason)

    def _expect(self, env: Envelope, message: Message, sender: str) -> None:
        """Checked before a payload is read: peers send only their kinds, and only a
        planned peer's stage state carries tensors, no larger than the model's whole
        state with its optimizer's (so an admitted peer cannot make us hold more)."""
        if env.kind not in _FROM_PEERS:
            raise Rejected(Reject.UNEXPECTED, f"peers do not send the coordinator '{env.kind}'")
        if env.payload_bytes == 0:
            return
        driver = self.driver
        # tensors ride only on a stage's state and on evidence of poison (the offending signed frame)
        carries = env.kind == "state" or (env.kind == "failure" and bool(env.body.get("poison")))
        carries = carries or (env.kind == "evidence" and driver is not None and sender in driver.auditing)
        if not carries or driver is None or sender not in driver.st.planned:
            raise Rejected(Reject.OVERSIZED, f"a {env.payload_bytes}-byte payload on '{env.kind}' from {sender}")
        if env.payload_bytes > driver.max_payload_bytes:
            raise Rejected(
                Reject.OVERSIZED, f"{env.kind} of {env.payload_bytes} bytes, over {driver.max_payload_bytes}"
            )

    async def start(self) -> None:
        """Raises SwarmError (one line) when the identity file, the run directory or
        the status page's port cannot be used."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            self.identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise SwarmError(str(exc)) from None
        self.run_dir = self._open_run_dir()
        # a resumed private swarm stays private (its secret is in the run directory)
        self.private = cfg.private or (self.run_dir.path / SECRET_FILE).exists()
        self.admission = Admission(self.run_dir.path, cfg.run_id, self.private)
        self.gate.admission = self._admit
        host_maddrs, initial_peers = self._addresses()
        if cfg.status:
            self.status = StatusServer(self.board, cfg.status_host, cfg.status_port)
            try:
                await self.status.start()
            except OSError as exc:
                self.status = None
                raise SwarmError(str(exc)) from None
        identity_path = self.run_dir.path / "p2p.key"  # the same libp2p id after a restart
        if not identity_path.exists():
            P2P.generate_identity(str(identity_path))
        self.dht = await loop.run_in_executor(
            None,
            lambda: hivemind.DHT(
                initial_peers=initial_peers,
                host_maddrs=host_maddrs,
                identity_path=str(identity_path),
                record_validators=[RunRecords(cfg.run_id, self.identity.public_hex)] if self.private else [],
                start=True,
            ),
        )
        self.transport = Transport(await self.dht.replicate_p2p(), self.identity, self.gate)
        self.transport.lane_ok = self._lane_ok
        self.transport.relay_ok = self._relay_ok
        self.transport.divert = self._divert
        self.gate.on_admit.append(lambda peer: self._certifying.add(asyncio.create_task(self._certify([peer]))))
        self.gate.on_admit.append(lambda peer: self._certifying.add(asyncio.create_task(self._dial_back(peer))))
        await self.transport.start()
        self._tasks.append(asyncio.create_task(self._renew_certificates()))
        self.run_dir.set_meta("ports", _tcp_ports(self.visible_maddrs))
        self.run_dir.set_meta("join", {"key": self.identity.public_hex, "maddrs": self.visible_maddrs})
        await self._publish_record()
        self._tasks.append(asyncio.create_task(self._refresh_record()))

    def _open_run_dir(self) -> RunDir:
        """The run directory: new (refusing one that holds another run's checkpoints) or,
        with ``resume``, the one of the same run and job."""
        cfg = self.config
        # by default a new folder per start, so a new run never meets an old one's checkpoints
        started = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        path = Path(cfg.run_dir).expanduser() if cfg.run_dir else default_run_dir(cfg.run_id) / started
        if cfg.resume and not (path / DB_NAME).is_file():
            raise SwarmError(f"--resume {path}: no run there (no {DB_NAME})")
        run_dir = RunDir(path)
        try:
            run_dir.open()
        except (OSError, CheckpointError) as exc:
            raise SwarmError(f"cannot use the run directory {path}: {exc}") from None
        job, run_id = run_dir.get_meta("job"), run_dir.get_meta("run_id")
        if cfg.resume:
            if run_id != cfg.run_id or job != cfg.job_fields():
                raise SwarmError(
                    f"--resume {path}: that run is '{run_id}' with job {job}; start the coordinator with the same "
                    "--run and job flags as the first time"
                )
        elif run_dir.latest() is not None:
            raise SwarmError(
                f"the run directory {path} already holds run '{run_id}' (checkpoint of step {run_dir.latest().step}); "
                f"continue it with --resume {path}, or choose another --run-dir"
            )
        run_dir.set_meta("run_id", cfg.run_id)
        run_dir.set_meta("job", cfg.job_fields())
        return run_dir

    def _addresses(self) -> tuple[list[str], list[str]]:
        """Where to listen and whom to bootstrap from: on resume, the previous ports
        (where free, so printed join commands stay valid) and the recorded peers."""
        cfg = self.config
        if not cfg.resume or self.run_dir is None:
            return cfg.host_maddrs, cfg.initial_peers
        ports = self.run_dir.get_meta("ports", [])
        host = list(cfg.host_maddrs)
        if len(ports) == 1:
            reused = [m.replace("/tcp/0", f"/tcp/{ports[0]}") for m in host]
            try:
                check_listen_ports(reused)
                host = reused
            except PortTaken as exc:
                logger.warning("cannot listen where the run did before: %s", exc)
        peers = [m for maddrs in self.run_dir.get_meta("peers", {}).values() for m in maddrs if "/p2p/" in m]
        return host, [*cfg.initial_peers, *peers]

    @property
    def visible_maddrs(self) -> list[str]:
        assert self.dht is not None
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def join_command(self) -> str:
        """What a volunteer pastes: where to join and the coordinator's key, or, in a
        private swarm, one token holding both and the swarm's secret."""
        assert self.identity is not None and self.admission is not None
        if self.private:
            return f"fusionllm join --token {self.admission.token(self.identity.public_hex, self.visible_maddrs)}"
        run = "" if self.config.run_id == "fusionllm" else f" --run {self.config.run_id}"
        pin = f" --coordinator-key {self.identity.public_hex}"
        return "fusionllm join --initial-peers " + " ".join(self.visible_maddrs) + run + pin

    async def _publish_record(self) -> None:
        assert self.dht is not None and self.transport is not None and self.identity is not None
        expires = get_dht_time() + self.config.record_ttl
        rec = CoordinatorRecord(self.transport.peer_id, self.visible_maddrs, self.config.run_id, expires)
        subkey = self.identity.public_hex  # under its own key: another's claim of the run cannot hide it
        await publish_record(self.dht, self.identity, self.config.run_id, "coordinator", subkey, rec.header(), expires)

    async def _refresh_record(self) -> None:
        while True:
            await asyncio.sleep(self.config.record_ttl / 3)
            try:
                await self._publish_record()
            except Exception as exc:
                honour_cancel()
                logger.warning("coordinator record refresh failed: %s", exc)

    async def live_adverts(self) -> dict[str, Advert]:
        """The adverts in the DHT that have not expired, are signed, and whose key the
        peer bound to its libp2p id with its hello, by peer id."""
        assert self.dht is not None
        out: dict[str, Advert] = {}
        now = get_dht_time()
        for subkey, value in (await read_records(self.dht, self.config.run_id, "adverts")).items():
            try:
                ad = Advert.from_header(value)
                key = check_record(value)
            except Exception as exc:
                logger.warning("ignoring a bad advert under %r: %s", subkey, exc)
                continue
            if not isinstance(ad, Advert):
                logger.warning("ignoring a %s record under %r among the adverts", ad.KIND, subkey)
                continue
            bound = self.gate.keys.get(ad.peer_id)
            if bound is None or key_hex(bound) != key_hex(key) or ad.peer_id not in self.reached:
                continue  # no hello yet (or from another key): not admitted; or not yet dialled back
            if ad.expires_at <= now or ad.peer_id != subkey:
                continue
            problem = advert_problem(ad)
            if problem:
                self._refuse_advert(ad.peer_id, problem)
                continue
            out[ad.peer_id] = ad
        self.board.saw_adverts(out)
        return out

    def _refuse_advert(self, peer_id: str, problem: str) -> None:
        """A bad advert is left out of planning; said once per peer and problem."""
        if self._refused.get(peer_id) == problem:
            return
        self._refused[peer_id] = problem
        logger.warning("ignoring the advert of %s: %s", peer_id, problem)
        self.board.reject(peer_id, Reject.BAD_ADVERT.value, problem)

    def keep_adverts(self, live: dict[str, Advert], planned: set[str]) -> None:
        """Take the ``live`` adverts; ``planned`` peers keep their last one through a DHT hiccup."""
        self.adverts = {**{p: a for p, a in self.adverts.items() if p in planned}, **live}

    async def _watch_adverts(self) -> None:
        """Keep the status board's peers fresh while training (joins, leaves, health)."""
        while True:
            await asyncio.sleep(2.0)
            try:
                live = await self.live_adverts()
            except Exception as exc:  # the DHT may hiccup; the next poll retries
                honour_cancel()
                logger.debug("advert poll failed: %s", exc)
                continue
            st = self.driver.st if self.driver is not None else None
            await self._enforce_bans()
            self.keep_adverts(live, st.planned if st is not None else set())  # joiners: rebalance candidates
            if st is not None and st.plan is not None:  # joined mid-run: standby until a re-plan takes it in
                for p in set(live) - st.planned - set(st.lost):
                    if self.board.peers.get(p, {}).get("state") == "joined":
                        self.board.peer_state(p, "standby")

    def _admit(self, sender: str, hello: dict[str, Any]) -> str:
        """Why a hello's sender is not admitted: excluded from this run (for what it
        sent), banned, or no proof of a private swarm's secret."""
        st = self.driver.st if self.driver is not None else None
        why_excluded = ""
        if st is not None and st.lost.get(sender, "").startswith(EXCLUDED):
            why_excluded = f"{sender} was {st.lost[sender][:200]}"
        assert self.admission is not None
        why = self.admission.check(sender, hello) if not why_excluded else why_excluded
        if why:
            self._tell_refused(sender, why)
        else:
            said = hello.get("maddrs")
            self._hello_ports[sender] = tcp_ports(
                [m for m in said[:16] if isinstance(m, str)] if isinstance(said, list) else []
            )
        return why

    async def _dial_back(self, peer: str) -> None:
        """Whether ``peer`` can be dialled (``protocol.net.reach``): at the address its
        connection comes from, at the ports it listens on. Said on the page and to it."""
        assert self.transport is not None
        ports = self._hello_ports.pop(peer, [])
        try:
            infos = await asyncio.wait_for(self.transport.p2p.list_peers(), DIAL_BACK_TIMEOUT_S)
        except Exception as exc:  # the daemon may hiccup: then no address is known
            logger.debug("could not list connections: %s", exc)
            infos = []
        seen = [str(a) for info in infos if info.peer_id.to_base58() == peer for a in info.addrs]
        reach = await dial_back(observed_ip([a for a in seen if "p2p-circuit" not in a]), ports)  # not a relay's
        self.reached[peer] = reach.direct
        (self.transport.dials_in.discard if reach.direct else self.transport.dials_in.add)(peer)
        self.board.set_connection(peer, "direct" if reach.direct else "dial-out")
        if not reach.direct:
            self.board.event("join", f"peer {peer} is behind a NAT: it dials out ({reach.detail})")
        try:
            await asyncio.wait_for(self.transport.send(peer, Reachability(self.config.run_id, reach.direct,
                                                                          reach.detail, ports)), 10)  # fmt: skip
        except (PeerUnreachable, asyncio.TimeoutError) as exc:
            logger.debug("could not tell %s its reachability: %s", peer, exc)

    def _tell_refused(self, sender: str, why: str) -> asyncio.Task[None] | None:
        """Say why a hello was refused (at most once a minute per sender): a peer coming
        back after a token rotation or a ban leaves with the reason instead of waiting.
        Returns the sending task (None when not told again)."""
        now = time.monotonic()
        if sender in self._told and now - self._told[sender] < 60 or self.transport is None:
            return None
        if len(self._told) > 10_000:
            self._told.clear()
        self._told[sender] = now
        task = asyncio.get_running_loop().create_task(self._abort_quietly(sender, why))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)
        return task

    async def _abort_quietly(self, sender: str, why: str) -> None:
        assert self.transport is not None
        try:
            await asyncio.wait_for(self.transport.send(sender, Abort(self.config.run_id, NOT_ADMITTED + why)), 10)
        except Exception as exc:  # it may be gone already
            logger.debug("could not tell %s why it was refused: %s", sender, exc)

    def _lane_ok(self, sender: str, nbytes: int) -> bool:
        """Lane parts (large payloads) only from planned peers, no larger than a payload
        the coordinator accepts from them (``_expect``)."""
        driver = self.driver
        return driver is not None and sender in driver.st.planned and nbytes <= driver.max_payload_bytes

    def _divert(self, inbound: Inbound) -> bool:
        """Spot-check answers from planned peers go to the driver's audit box (spot checks
        run beside the step that the inbox serves); others are dropped."""
        driver = self.driver
        if driver is None or not isinstance(inbound.message, (Evidence, Verdict)):
            return False
        if inbound.sender in driver.st.planned:
            driver.take_answer(inbound)
        return True

    def _relay_ok(self, origin: str, dest: str, nbytes: int) -> bool:
        """Frames are forwarded only between planned peers that cannot dial each other,
        no larger than a payload the coordinator takes."""
        driver = self.driver
        nat = {p for p, direct in self.reached.items() if not direct}
        return driver is not None and {origin, dest} <= driver.st.planned & nat and nbytes <= driver.max_payload_bytes

    async def _certify(self, peers: list[str]) -> None:
        """Issue ``peers`` fresh admission certificates (their senders are refused past
        the end of the last one), and send each its own with when every planned peer's
        ends (for their gates)."""
        assert self.transport is not None
        now = time.time()
        certs = {}
        for p in peers:
            key = self.gate.keys.get(p)
            if key is not None:
                cert = issue_certificate(self.identity, self.config.run_id, p, key_hex(key), now, self.config.cert_ttl)
                certs[p] = cert
                self.gate.until[p] = certs[p]["expires_at"]
        planned = self.driver.st.planned if self.driver is not None else set()
        ends = {p: self.gate.until[p] for p in planned if p in self.gate.until}
        await asyncio.gather(
            *(self._send_certificate(p, Certificate(self.config.run_id, c, ends)) for p, c in certs.items())
        )
        self._certifying = {t for t in self._certifying if not t.done()}

    async def _send_certificate(self, peer: str, msg: Certificate) -> None:
        assert self.transport is not None
        try:
            await asyncio.wait_for(self.transport.send(peer, msg), renewal_send_s(self.config.cert_ttl))
        except (PeerUnreachable, asyncio.TimeoutError) as exc:  # it may be gone; its certificate runs out
            logger.debug("could not send %s its certificate: %s", peer, exc)

    async def _renew_certificates(self) -> None:
        """Every renewal period, renew the certificates of the peers still admitted (not
        banned, not excluded): one that is not renewed is refused everywhere once its
        certificate ends."""
        assert self.transport is not None
        while True:
            await asyncio.sleep(renewal_period(self.config.cert_ttl))
            st = self.driver.st if self.driver is not None else None
            excluded = {p for p, why in st.lost.items() if why.startswith(EXCLUDED)} if st is not None else set()
            peers = [p for p in self.gate.keys if p != self.transport.peer_id and p not in excluded]
            try:
                await self._certify(peers)
            except Exception as exc:  # never lose the renewals to one failure
                honour_cancel()
                logger.warning("renewing certificates failed: %s", exc)

    async def _enforce_bans(self) -> None:
        """Banned peers (by id or key) lose their admission at once; a planned one is
        dropped from the run for good (its stage is recovered like a failed peer's) once
        it has been told why: the recovery forgets its streams, which would cut the word."""
        assert self.admission is not None
        me = self.transport.peer_id if self.transport is not None else ""
        known = {p: key_hex(k) for p, k in self.gate.keys.items() if p != me}
        hit = self.admission.banned_among(known)
        telling = []
        self.banned |= hit
        for p in hit:
            self.gate.revoke(p)
            self.board.event("failure", f"peer {p} is banned by the swarm's host")
            telling.append(self._tell_refused(p, f"{p} is banned from run '{self.config.run_id}' by the swarm's host"))
        await asyncio.gather(*(t for t in telling if t is not None))  # each bounded by _abort_quietly
        planned = self.driver.st.planned if self.driver is not None else set()  # it may have changed meanwhile
        dropped = (hit | self.admission.banned()) & planned
        self.banned |= dropped
        for p in dropped:
            self.driver.fail(p, BANNED)  # type: ignore[union-attr]

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

    def keys_of(self, peers: set[str]) -> dict[str, str]:
        """The admitted Ed25519 keys (hex) of ``peers``."""
        return {p: key_hex(self.gate.keys[p]) for p in peers if p in self.gate.keys}

    def where(self, peer_id: str, plan: Assignment | None) -> str:
        try:
            s, r = plan.stage_of(peer_id) if plan else (None, None)
        except KeyError:
            return "not assigned"
        return "not assigned" if s is None else f"stage {s}, replica {r}"

    async def reachable(self, peer_id: str, timeout: float = 2.0) -> bool:
        """Whether a connection to ``peer_id`` exists or can be made within ``timeout``."""
        assert self.transport is not None
        try:
            if peer_id in await self.transport.connected():
                return True
            await asyncio.wait_for(self.transport.connect(peer_id), timeout)
            return True
        except Exception:
            honour_cancel()
            return False

    def traffic(self, st: RunState) -> list[tuple[int, int]]:
        assert st.plan is not None
        return _traffic(st.plan, st.link_bytes, st.raw_bytes)

    async def run(
        self,
        model: torch.nn.Module,
        on_step: Callable[[StepReport], None] | None = None,
        on_peers: Callable[[int], None] | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> RunSummary:
        """Train ``model``'s job on the swarm through plan epochs; returns the losses and
        the trained state. Raises SwarmError (one line) when the run cannot go on."""
        assert self.transport is not None and self.run_dir is not None
        self._tasks.append(asyncio.create_task(self._watch_adverts()))
        driver = Driver(self, model, self.run_dir, on_step, on_event)
        self.driver = driver
        start = time.perf_counter()
        try:
            st = await driver.run(self.config.resume, on_peers)
        except SwarmError as exc:
            self.board.finish(False, str(exc))
            await self._abort(driver.st.planned | set(self.adverts), str(exc))
            raise
        seconds = sum(st.step_seconds) or time.perf_counter() - start
        assert st.plan is not None and driver.final is not None
        self.board.finish(True, f"{len(st.losses)} steps in {seconds:.0f} s")
        links = {f"{src[-6:]}->{dst[-6:]}": n for src, sent in st.link_bytes.items() for dst, n in sent.items()}
        reports = [
            LinkReport(b, str(c), st.mbps[b], w, r) for b, (c, (w, r)) in enumerate(zip(st.codecs, self.traffic(st)))
        ]
        estimate = _estimate(st.plan, st.compute, st.step_seconds, self.config.job.micro_batches)
        return RunSummary(
            st.losses,
            seconds,
            st.tokens,
            st.plan,
            self.adverts,
            links,
            driver.final,
            reports,
            estimate,
            epochs=st.epoch + 1,
            failures=len(st.lost),
            steps_redone=st.redone,
            checkpoint_s=list(st.checkpoint_s),
            step_seconds=list(st.step_seconds),
            rebalances=list(st.rebalances),
            val_losses=list(st.val_losses),
            spot_checks=st.spot_checks,
            audit_wait_s=st.audit_wait_s,
            audit_share=st.audit_compute_s / max(st.train_compute_s, 1e-9),
            check_overhead=step_overhead(st.step_seconds, st.audited),
            connections={p: self.board.connections.get(p, "direct") for p in st.planned},
            forwarded_bytes=sum(self.transport.forwarded.values()),
        )

    def choose_codecs(
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
        # ended before the transport they use (one stuck past the wait is left to the loop)
        await cancel_all([*self._tasks, *self._certifying, *self._telling], CLOSE_WAIT_S)
        if self.status is not None:
            await self.status.aclose()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()


def _tcp_ports(maddrs: list[str]) -> list[int]:
    """The TCP ports among listening multiaddrs."""
    out = set()
    for m in maddrs:
        parts = m.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            out.add(int(parts[parts.index("tcp") + 1]))
    return sorted(out)


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
