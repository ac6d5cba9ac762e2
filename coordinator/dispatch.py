"""Setting a plan epoch up: every planned peer gets its assignment (and its stage's
program and state where the epoch restores them), standby peers are told to wait,
each peer measures its links to the next stage, and the codecs of the cut edges are
chosen from what they measured. And at the end of the run, every admitted peer is
told it is over."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from coordinator.assignments import PlanTooLarge, assignments, header_bytes, reassignments
from coordinator.checkpoint import RunDir
from coordinator.checkpointing import Checkpoints
from coordinator.host import Host
from coordinator.links import boundary_specs
from coordinator.messaging import Mailbox, send_each
from coordinator.outcome import SwarmError
from coordinator.planning import Planner
from coordinator.runstate import EXCLUDED, PeerLost, RunState
from coordinator.scaling import LossScales
from coordinator.stages import Stages
from protocol.net.clock import Clock
from protocol.wire.messages import (
    Assign,
    Finish,
    LinkPlan,
    Ready,
    Release,
    StageProgram,
    StageState,
    Standby,
)
from protocol.wire.reassign import Reassign, Resend

logger = logging.getLogger(__name__)

#: the end of the run: the longest a send of its notice to one peer may take (one that
#: takes longer is skipped), and how many are under way at once
END_NOTICE_S = 3.0
END_NOTICE_AT_ONCE = 64
#: an epoch's assignments and link plan under way at once (each bounded by the config's ``send_timeout_s``)
SETUP_AT_ONCE = 64


class Dispatcher:
    def __init__(
        self,
        host: Host,
        st: RunState,
        stages: Stages,
        planner: Planner,
        checkpoints: Checkpoints,
        scales: LossScales,
        mailbox: Mailbox,
        run_dir: RunDir,
        clock: Clock,
        say: Callable[[str], None],
    ) -> None:
        self.host = host
        self.cfg = host.config
        self.st = st
        self.stages = stages
        self.planner = planner
        self.checkpoints = checkpoints
        self.scales = scales
        self.mailbox = mailbox
        self.run_dir = run_dir
        self.clock = clock
        self.say = say
        self.held: dict[str, Assign] = {}  # each peer's assignment of the last epoch it was ready for
        self._whole: dict[str, Assign] = {}  # this epoch's, whole (for a peer that asks: ``Resend``)
        self._extras: dict[int, list[tuple[Any, Any]]] = {}  # per stage: its program, its state

    async def dispatch(self) -> None:
        """Set the current plan epoch up; ``st.dispatched`` once every peer is ready."""
        st, cfg, host = self.st, self.cfg, self.host
        assert st.plan is not None
        plan, k = st.plan, st.plan.cut.num_stages
        t0 = self.clock.now()
        await self.planner.refresh_adverts()
        if cfg.link_mbps and len(cfg.link_mbps) != k - 1:
            raise SwarmError(f"--link-mbps gives {len(cfg.link_mbps)} rates; the plan has {k - 1} stage boundaries")
        st.specs = boundary_specs(self.stages.model, plan.cut, self.stages.example, self.stages.recipe)
        host.gate.epoch = st.epoch
        self.run_dir.set_meta("epoch", st.epoch)
        self.run_dir.set_meta("peers", {p: a.maddrs for p, a in host.adverts.items()})
        self._show_plan()
        for p in st.planned:
            self.mailbox.transport.learn(p, host.adverts[p].maddrs if p in host.adverts else [])
        self._show_paths(plan.stages)
        await self._send_stages()
        for p in self.planner.standby():
            self.mailbox.background(self.mailbox.send_quietly(p, Standby(cfg.run_id, st.epoch)))
        self.mailbox.heard_all(st.planned)
        await self._await_ready()
        st.dispatched = True
        st.dispatch_s, st.epoch_start = self.clock.now() - t0, st.step

    def _show_plan(self) -> None:
        """The new epoch and its plan on the status page."""
        st, board, dag = self.st, self.host.board, self.stages.dag
        assert st.plan is not None
        board.set_epoch(st.epoch, st.reason)
        board.set_plan(
            [op.flops for op in dag.ops],
            dag.stage_costs(st.plan.cut),
            st.plan.cut.to_list(),
            dag.boundary_bytes(st.plan.cut),
            st.plan.stages,
        )
        for p in self.planner.standby():
            board.peer_state(p, "standby")

    async def _send_stages(self) -> None:
        """Each planned peer's assignment (what changed, to a peer that served the last
        epoch: ``reassignments``), and its stage's program and state where due.
        Assignments alone go out in bounded parallel (``send_each``), each sealed once:
        no order between peers matters (each waits for its own, ``_await_ready`` for
        all). A program and a state must follow their peer's assignment at once (its
        epoch waits for them from then, ``message_timeout``): with them, each peer's
        three go in turn, peer after peer, as before (a state may be gigabytes)."""
        st = self.st
        assert st.plan is not None
        try:
            self._whole = self._assign_msgs()
        except PlanTooLarge as exc:
            raise SwarmError(str(exc)) from None
        outgoing = reassignments(self._whole, self.held)
        changes = [m for m in outgoing.values() if isinstance(m, Reassign)]
        if changes:
            kb = sum(map(header_bytes, changes)) / 1e3
            told = f"{len(changes)} of {len(outgoing)} peers"
            self.say(f"{told} told only what changed in their assignment ({kb:.1f} kB)")
        self.held = {}  # until each is ready again (a peer may fail to apply what changed)
        self._extras = await self._stage_extras()
        if not self._extras:
            await self._send_all(outgoing)
            return
        for p in (p for group in st.plan.stages for p in group):
            await self._send_peer(p, outgoing[p])

    async def _stage_extras(self) -> dict[int, list[tuple[Any, Any]]]:
        """Per stage, what must follow its peers' assignments: its program (a private
        swarm's, unless the stages keep theirs) and its state (an epoch restored from a
        checkpoint); none where nothing must."""
        st, cfg, loop = self.st, self.cfg, asyncio.get_running_loop()
        assert st.plan is not None
        plan, extras = st.plan, {}
        states = programs = None
        if st.restore == "state":
            states = await loop.run_in_executor(None, self.checkpoints.stage_states, plan.cut)
        if self.stages.as_programs and st.restore != "keep":
            programs = await loop.run_in_executor(None, self.stages.programs, plan.cut)
        if programs is None and states is None:
            return {}
        for s in range(plan.cut.num_stages):
            extras[s] = []
            if programs is not None:
                extras[s].append((StageProgram(cfg.run_id, s, plan.cut.to_list(), st.epoch), programs[s]))
            if states is not None:
                names = sorted(states[s])
                extras[s].append((StageState(cfg.run_id, s, names, st.epoch, st.step), [states[s][n] for n in names]))
        return extras

    async def _send_peer(self, peer: str, assign: Assign | Reassign) -> None:
        """A peer's assignment, then its stage's program and state where due."""
        assert self.st.plan is not None
        await self.mailbox.send(peer, assign)
        for msg, values in self._extras.get(self.st.plan.stage_of(peer)[0], []):
            await self.mailbox.send(peer, msg, values)

    def _show_paths(self, stages: list[list[str]]) -> None:
        """On the page, how each planned peer behind a NAT is reached: it dials out, or
        (its stage or a neighbouring one has another such peer) frames are forwarded."""
        nat = {p for group in stages for p in group if not self.host.reached.get(p, True)}
        for s, group in enumerate(stages):
            partners = {p for i in (s - 1, s, s + 1) if 0 <= i < len(stages) for p in stages[i]}
            for p in nat & set(group):
                self.host.board.set_connection(p, "forwarded" if (nat & partners) - {p} else "dial-out")

    def _assign_msgs(self) -> dict[str, Assign]:
        """Each planned peer's assignment (``coordinator.assignments``: its neighbourhood only)."""
        st, cfg, plan, host = self.st, self.cfg, self.st.plan, self.host
        assert plan is not None
        shared = {
            "run_id": cfg.run_id,
            "job": cfg.job_fields(),
            "cut": plan.cut.to_list(),
            "schedule": cfg.schedule,
            "specs": st.specs,
            "link_mbps": list(cfg.link_mbps),
            "epoch": st.epoch,
            "start_step": st.step,
            "restore": st.restore,
            "loss_scale": self.scales.scale.scale,
            "pending_factor": self.scales.last.factor,
            "pending_skip": self.scales.last.skip,
            "program": self.stages.as_programs,
        }
        maddrs = {p: host.adverts[p].maddrs for p in st.planned if p in host.adverts}
        certs = {p: host.gate.until[p] for p in st.planned if p in host.gate.until}
        nat = {p for p in st.planned if not host.reached.get(p, True)}
        return assignments(plan.stages, shared, maddrs, host.keys_of(st.planned), certs, nat)

    async def _send_all(self, messages: dict[str, Any]) -> None:
        """``messages`` (peer -> its message, no payload) in bounded parallel; the peers
        not reached are lost, together."""
        missed = await send_each(self.mailbox.transport, messages, self.cfg.send_timeout_s, SETUP_AT_ONCE)
        if missed:
            raise PeerLost({p: f"unreachable: {why}" for p, why in missed.items()})

    async def _await_ready(self) -> None:
        st, cfg = self.st, self.cfg
        assert st.plan is not None
        pending, measured, resent = set(st.planned), {}, set()
        while pending:
            inbound = await self.mailbox.next((Ready, Resend), pending)
            if isinstance(inbound.message, Resend):  # it did not hold what the changes build on
                await self._resend(inbound.sender, resent)
                continue
            pending.discard(inbound.sender)
            self.held[inbound.sender] = self._whole[inbound.sender]
            measured[inbound.sender] = inbound.message.next_mbps
            st.learn_links(inbound.sender, {p: v for p, v in inbound.message.next_mbps.items() if p in st.planned})
        st.codecs, st.mbps = self.host.choose_codecs(self.stages.dag, st.plan, st.specs, measured)
        self.host.board.set_links([str(c) for c in st.codecs], st.mbps)
        links = LinkPlan(cfg.run_id, [c.to_json() for c in st.codecs], st.epoch)  # sealed once for all
        await self._send_all(dict.fromkeys(st.planned, links))

    async def _resend(self, peer: str, resent: set[str]) -> None:
        """A peer's whole assignment (with its stage's program and state), once an epoch:
        a peer asking again is not sent a state again (a small frame must not buy gigabytes)."""
        if peer in resent:
            logger.warning("peer %s asked again for its whole assignment of epoch %d", peer, self.st.epoch)
            return
        resent.add(peer)
        logger.info("peer %s asked for its whole assignment", peer)
        await self._send_peer(peer, self._whole[peer])

    async def release(self) -> None:
        """Tell every peer admitted during the run that it is over: the plan's, the standby
        peers, those dropped (a stalled one may be back, or wake up any moment), and
        those whose advert the DHT did not return just now; a peer never told would wait
        out its --coordinator-grace for a coordinator that is gone. Peers excluded for
        what they sent are not told. Each send is bounded (``END_NOTICE_S``, at most
        ``END_NOTICE_AT_ONCE`` at a time): a dead or stopped peer is skipped, and cannot
        hold the coordinator's exit."""
        st, mailbox = self.st, self.mailbox
        try:
            await self.planner.refresh_adverts()  # standby peers that came (back) since
        except Exception as exc:  # the DHT may hiccup: the admitted peers are told anyway
            logger.info("the last advert refresh failed: %s", exc)
        excluded = {p for p, why in st.lost.items() if why.startswith(EXCLUDED)} | self.host.banned
        admitted = st.planned | set(self.planner.standby()) | set(self.host.gate.keys) | set(st.lost)
        told = admitted - excluded - {mailbox.transport.peer_id}
        self.say(f"the run is over; telling {len(told)} peers")
        finish = Finish(self.cfg.run_id, False, st.epoch)
        missed = await mailbox.tell(told, finish, END_NOTICE_S, END_NOTICE_AT_ONCE)
        if missed:
            self.say(f"{len(missed)} of {len(told)} peers could not be told within {END_NOTICE_S:g} s")
        await mailbox.tell(st.planned - missed, Release(self.cfg.run_id), END_NOTICE_S, END_NOTICE_AT_ONCE)
