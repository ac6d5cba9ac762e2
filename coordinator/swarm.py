"""The coordinator of a swarm run: a thin shell that brings up its network presence
(run directory, DHT node, transport, status page) and starts and stops the components
that own each concern, then runs the training driver on them.

The components: who is admitted, certified and banned (``admission``), where each
peer can be reached (``reachability``), the peers' adverts (``adverts``), what the
coordinator takes from peers and forwards between them (``intake``), its record in
the DHT (``beacon``); they read the driver only through the ``roster``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import hivemind
import torch

from coordinator.admission import Admission
from coordinator.adverts import AdvertBook
from coordinator.assign import Assignment
from coordinator.beacon import Beacon
from coordinator.checkpoint import RunDir
from coordinator.config import CoordinatorConfig
from coordinator.hosting import family_ports, open_run_dir, start_dht, tcp_ports
from coordinator.intake import Intake
from coordinator.links import live_codecs
from coordinator.outcome import RunSummary, StepReport, SwarmError
from coordinator.reachability import Reach
from coordinator.roster import Endpoint, Roster
from coordinator.run import Driver
from coordinator.runstate import RunState
from coordinator.status import StatusBoard
from coordinator.summary import summarize, traffic
from coordinator.web import StatusServer
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.hostaddrs import JoinAddrs, interface_ips, join_addrs
from protocol.net.tasks import cancel_all, every, wait_until
from protocol.net.transport import PeerUnreachable, Transport
from protocol.trust.identity import Identity, IdentityError, key_hex
from protocol.wire.codecs import Codec
from protocol.wire.gate import Gate
from protocol.wire.messages import Abort, Advert

CLOSE_WAIT_S = 5.0  # how long closing waits for the coordinator's own background tasks to end
ADVERT_POLL_S = 2.0  # how often the status board's peers are refreshed while training
PEER_POLL_S = 0.5  # how often waiting for peers looks at the adverts
logger = logging.getLogger(__name__)


class Coordinator:
    """Hosts (or joins) the DHT, admits peers and reads their adverts, and trains a
    model's job on them (``run``). ``transport``: one already built (tests, embedding);
    by default ``start()`` builds one on the DHT's libp2p node. The constructor does no I/O."""

    def __init__(
        self, config: CoordinatorConfig, *, transport: Transport | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.config, self.clock = config, clock
        self.endpoint = Endpoint(transport=transport)
        self.gate = Gate(config.run_id)
        self.board = StatusBoard(config.run_id, config.job.steps)
        self.gate.listeners.append(self.board.reject)
        self.roster = Roster()
        self.reach = Reach(config.run_id, self.board, self.endpoint)
        self.admission = Admission(config, self.gate, self.board, self.endpoint, self.roster, clock)
        self.book = AdvertBook(config.run_id, self.gate, self.reach, self.board, self.endpoint)
        self.intake = Intake(self.roster, self.reach)
        self.intake.hook_gate(self.gate)
        self.beacon = Beacon(config.run_id, config.record_ttl, self.endpoint, clock, self.book.sharding)
        self.status: StatusServer | None = None
        self.run_dir: RunDir | None = None
        self.join_addrs = JoinAddrs([], [], True)  # what the join line names (``start()`` finds them)
        self._tasks: list[asyncio.Task[Any]] = []

    # ------------------------------------------------------------ what the driver reads
    @property
    def transport(self) -> Transport | None:
        return self.endpoint.transport

    @transport.setter
    def transport(self, transport: Transport | None) -> None:
        self.endpoint.transport = transport

    @property
    def identity(self) -> Identity | None:
        return self.endpoint.identity

    @property
    def dht(self) -> hivemind.DHT | None:
        return self.endpoint.dht

    @property
    def adverts(self) -> dict[str, Advert]:
        return self.book.adverts

    @adverts.setter
    def adverts(self, adverts: dict[str, Advert]) -> None:
        self.book.adverts = adverts

    @property
    def reached(self) -> dict[str, bool]:
        """Admitted peer -> whether it could be dialled back (``protocol.net.reach``)."""
        return self.reach.reached

    @property
    def banned(self) -> set[str]:
        """Peers the host banned during this run (each lost for that reason)."""
        return self.admission.banned

    @property
    def private(self) -> bool:
        return self.admission.private

    async def live_adverts(self) -> dict[str, Advert]:
        return await self.book.live()

    def keep_adverts(self, live: dict[str, Advert], planned: set[str]) -> None:
        self.book.keep(live, planned)

    async def reachable(self, peer_id: str, timeout: float = 2.0) -> bool:
        return await self.reach.reachable(peer_id, timeout)

    def keys_of(self, peers: set[str]) -> dict[str, str]:
        """The admitted Ed25519 keys (hex) of ``peers``."""
        return {p: key_hex(self.gate.keys[p]) for p in peers if p in self.gate.keys}

    def where(self, peer_id: str, plan: Assignment | None) -> str:
        try:
            s, r = plan.stage_of(peer_id) if plan else (None, None)
        except KeyError:
            return "not assigned"
        return "not assigned" if s is None else f"stage {s}, replica {r}"

    def traffic(self, st: RunState) -> list[tuple[int, int]]:
        assert st.plan is not None
        return traffic(st.plan, st.link_bytes, st.raw_bytes)

    async def wait_for_peers(self, on_change: Callable[[int], None] | None = None) -> dict[str, Advert]:
        """The live adverts once ``min_peers`` have joined; SwarmError past ``peer_wait_s``."""
        cfg = self.config
        seen = [-1]

        async def enough() -> dict[str, Advert] | None:
            ads = await self.live_adverts()
            if len(ads) != seen[0]:
                seen[0] = len(ads)
                if on_change:
                    on_change(seen[0])
            return ads if len(ads) >= cfg.min_peers else None

        ads = await wait_until(enough, cfg.peer_wait_s, interval=PEER_POLL_S, clock=self.clock)
        if ads is None:
            raise SwarmError(f"only {seen[0]} of {cfg.min_peers} peers joined within {cfg.peer_wait_s:.0f} s")
        return ads

    # ------------------------------------------------------------ up and down
    async def start(self) -> None:
        """Raises SwarmError (one line) when the identity file, the run directory or
        the status page's port cannot be used."""
        cfg = self.config
        try:
            self.endpoint.identity = identity = Identity.from_option(cfg.identity)
        except IdentityError as exc:
            raise SwarmError(str(exc)) from None
        self.run_dir = open_run_dir(cfg)
        self.admission.open(self.run_dir.path)
        self.gate.admission = self._admit
        assert self.admission.rules is not None
        self.gate.proven = self.admission.rules.proven  # a token-less flood cannot starve members' hellos
        await self._start_status()
        self.endpoint.dht = await start_dht(cfg, self.run_dir, identity, self.admission.private)
        if self.endpoint.transport is None:
            self.endpoint.transport = Transport(
                await self.endpoint.dht.replicate_p2p(), identity, self.gate, cfg.data_path == "direct"
            )
        self.intake.hook_transport(self.endpoint.transport)
        self.endpoint.transport.direct.dialable = lambda peer: self.reach.reached.get(peer, False)  # dialled back
        self.admission.start()
        self.gate.on_admit.append(self.reach.admitted)
        await self.endpoint.transport.start()
        visible = [str(m) for m in self.endpoint.dht.get_visible_maddrs(latest=True)]
        self.join_addrs = join_addrs(visible, interface_ips(), announced=bool(cfg.announce_maddrs))
        self.run_dir.set_meta("ports", family_ports(visible))
        self.run_dir.set_meta("join", {"key": identity.public_hex, "maddrs": self.join_addrs.maddrs})
        await self.beacon.start()

    async def _start_status(self) -> None:
        if not self.config.status:
            return
        self.status = StatusServer(self.board, self.config.status_host, self.config.status_port)
        try:
            await self.status.start()
        except OSError as exc:
            self.status = None
            raise SwarmError(str(exc)) from None

    def _admit(self, sender: str, hello: dict[str, Any]) -> str:
        """The gate's admission: why a hello's sender is not admitted ('' : it is)."""
        why = self.admission.check(sender, hello)
        if not why:
            self.reach.heard(sender, hello)
        return why

    @property
    def visible_maddrs(self) -> list[str]:
        return self.endpoint.visible_maddrs()

    def listen_ports(self) -> list[int]:
        """The TCP ports other machines must reach: the configured ones, or (any free
        one asked) those the join line names ([] when it names announced ones)."""
        fixed = [p for p in tcp_ports(self.config.host_maddrs) if p]
        return fixed if fixed or self.config.announce_maddrs else tcp_ports(self.join_addrs.maddrs)

    def join_command(self) -> str:
        """What a volunteer pastes: where to join (addresses another machine can dial,
        ``join_addrs``) and the coordinator's key, or, in a private swarm, one token
        holding both and the swarm's secret."""
        assert self.identity is not None
        if self.private:
            return f"fusionllm join --token {self.admission.token(self.join_addrs.maddrs)}"
        run = "" if self.config.run_id == "fusionllm" else f" --run {self.config.run_id}"
        pin = f" --coordinator-key {self.identity.public_hex}"
        return "fusionllm join --initial-peers " + " ".join(self.join_addrs.maddrs) + run + pin

    async def aclose(self) -> None:
        # ended before the transport they use (one stuck past the wait is left to the loop)
        await asyncio.gather(
            cancel_all(self._tasks, CLOSE_WAIT_S),
            self.admission.aclose(CLOSE_WAIT_S),
            self.reach.aclose(CLOSE_WAIT_S),
            self.beacon.aclose(CLOSE_WAIT_S),
        )
        if self.status is not None:
            await self.status.aclose()
        if self.transport is not None:
            await self.transport.aclose()
        if self.dht is not None:
            self.dht.shutdown()

    # ------------------------------------------------------------ the run
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
        self._tasks.append(
            asyncio.create_task(every(ADVERT_POLL_S, self._poll_adverts, what="advert poll", clock=self.clock))
        )
        # tracing and exporting take seconds of CPU: in a thread, so that the loop meanwhile
        # answers the joining peers' hellos and dials them back
        driver = await asyncio.to_thread(Driver.open, self, model, self.run_dir, on_step, on_event, self.clock)
        self.roster.driver = driver
        start = self.clock.now()
        try:
            st = await driver.run(self.config.resume, on_peers)
        except SwarmError as exc:
            self.board.finish(False, str(exc))
            await self._abort(driver.st.planned | set(self.adverts), str(exc))
            raise
        seconds = sum(st.step_seconds) or self.clock.now() - start
        assert driver.final is not None
        self.board.finish(True, f"{len(st.losses)} steps in {seconds:.0f} s")
        forwarded = sum(self.transport.forwarder.forwarded.values())
        mbs = self.config.job.micro_batches
        return summarize(
            st, driver.final, seconds, self.adverts, self.board.connections, forwarded, mbs, driver.stages.dag
        )

    async def _poll_adverts(self) -> None:
        """Keep the status board's peers fresh while training (joins, leaves, health),
        and drop the peers the host has banned meanwhile."""
        live = await self.live_adverts()  # the DHT may hiccup; the next poll retries
        await self.admission.enforce_bans()
        planned = self.roster.planned()
        self.keep_adverts(live, planned)  # joiners: rebalance candidates
        if self.roster.planning():  # joined mid-run: standby until a re-plan takes it in
            for p in set(live) - planned - set(self.roster.lost()):
                if self.board.peers.get(p, {}).get("state") == "joined":
                    self.board.peer_state(p, "standby")

    def choose_codecs(
        self, dag: Any, plan: Assignment, specs: list[list[Any]], measured: dict[str, dict[str, float]]
    ) -> tuple[list[Codec], list[float]]:
        """Per boundary: its codec under ``--compression`` and the bandwidth it was
        chosen for (``coordinator.links.live_codecs``: the one codec choice)."""
        cfg = self.config
        return live_codecs(
            dag,
            plan,
            specs,
            measured,
            self.adverts,
            cfg.compression,
            cfg.topk_fraction,
            cfg.lowrank_rank,
            cfg.job.micro_batches,
            lambda text: self.board.event("codec", text),
        )

    async def _abort(self, peers: set[str], reason: str) -> None:
        assert self.transport is not None
        for p in peers:
            try:
                await asyncio.wait_for(self.transport.send(p, Abort(self.config.run_id, reason)), 3)
            except (PeerUnreachable, asyncio.TimeoutError):
                pass
