"""Recovery when planned peers are lost: the spot checks under way end first, the lost
peers are recorded, and the pure rule (``replan.recover``) picks what follows: the
surviving replicas keep their state, standby peers take the lost peers' stages, or
the peers left are re-planned; the last two roll every stage back to the last
checkpoint and replay the deterministic data stream from there."""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator import replan
from coordinator.assign import Assignment
from coordinator.auditing import Auditor
from coordinator.checkpoint import RunDir
from coordinator.checkpointing import Checkpoints
from coordinator.host import Host
from coordinator.messaging import Mailbox
from coordinator.outcome import SwarmError
from coordinator.planning import Planner
from coordinator.rebalancing import Rebalancer
from coordinator.runstate import BANNED, EXCLUDED, RunState
from coordinator.scaling import LossScales
from coordinator.stages import Stages

logger = logging.getLogger(__name__)


class Recovery:
    def __init__(
        self,
        host: Host,
        st: RunState,
        stages: Stages,
        planner: Planner,
        mailbox: Mailbox,
        auditor: Auditor,
        checkpoints: Checkpoints,
        rebalancer: Rebalancer,
        scales: LossScales,
        run_dir: RunDir,
        on_event: Callable[[str], None],
    ) -> None:
        self.host = host
        self.st = st
        self.stages = stages
        self.planner = planner
        self.mailbox = mailbox
        self.auditor = auditor
        self.checkpoints = checkpoints
        self.rebalancer = rebalancer
        self.scales = scales
        self.run_dir = run_dir
        self.on_event = on_event

    async def recover(self, lost: dict[str, str], rollback_to: int | None = None) -> None:
        """Start a new plan epoch without the ``lost`` peers (rolled back to at most
        ``rollback_to`` steps, if given); SwarmError when no plan fits the peers left."""
        st = self.st
        assert st.plan is not None
        lost, rollback_to = await self.auditor.before_recovery(lost, rollback_to)
        self._drop(lost)
        self.host.gate.epoch = st.epoch + 1  # frames of the ending epoch are stale from now on
        self.rebalancer.supersede()
        self.rebalancer.stop()  # a check planning for the old peers: dropped, not collected later
        await self.planner.refresh_adverts()
        rec = replan.recover(st.plan.stages, set(st.lost), self.planner.standby())
        for p in self.mailbox.rejoined & set(st.lost):
            self.mailbox.back(p)
        self.mailbox.rejoined.clear()
        kept = rec.kind != "replan"
        new_plan = Assignment(st.plan.cut, rec.stages or [], st.plan.plan) if kept else self._replanned()
        for s, old, new in rec.taken:
            self.host.board.replaced(s, old, new)
            self.on_event(f"standby peer {new} takes stage {s} from {old}")
        if rec.rollback or rollback_to is not None:
            await self.rollback(rec.kind, rollback_to)
        elif not st.dispatched and st.restore != "keep":
            # the epoch that was setting up restores state: the next one restores the same
            st.reason = "lost replicas dropped while the stages were being set up"
            self.on_event(f"epoch {st.epoch + 1}: stages drop their lost replicas and restore their state again")
        else:
            st.restore, st.reason = "keep", "lost replicas dropped; the survivors hold the state"
            self.on_event(f"epoch {st.epoch + 1}: stages keep their surviving replicas, no rollback")
        self.checkpoints.forget_parts()
        st.next_epoch(new_plan)

    def _drop(self, lost: dict[str, str]) -> None:
        """The ``lost`` peers leave the plan, each with why, on the record and the page."""
        st = self.st
        for p, why in lost.items():
            # revoked at once, a banned peer may be lost to a refused frame before its ban is enforced
            why = BANNED if p in self.host.banned and not why.startswith(EXCLUDED) else why
            where = self.host.where(p, st.plan)
            st.lost[p] = why
            self.mailbox.failed.pop(p, None)
            self.host.board.failure(p, where, why)
            self.on_event(f"peer {p} ({where}) failed: {why}")
            self.mailbox.transport.forget(p)

    def _replanned(self) -> Assignment:
        """A plan of the peers left (SwarmError, with the last checkpoint named, if none fits)."""
        survivors = [a for p, a in self.host.adverts.items() if p not in self.st.lost]
        if not survivors:
            raise SwarmError(self.checkpoints.stop_line("no peers are left"))
        try:
            new_plan = self.planner.plan(survivors)
        except SwarmError as exc:
            raise SwarmError(self.checkpoints.stop_line(str(exc))) from None
        if new_plan.plan is not None and not new_plan.plan.fits_memory:
            raise SwarmError(self.checkpoints.stop_line(f"no plan fits the memory of the {len(survivors)} peers left"))
        return new_plan

    async def rollback(self, kind: str, at_most: int | None = None) -> None:
        """Back to the last checkpoint (of at most ``at_most`` steps: a spot check of the
        step after it failed, or could not finish)."""
        st, ckpts = self.st, self.checkpoints
        await ckpts.flush()
        if at_most is not None and ckpts.latest is not None and ckpts.latest.step > at_most:
            ckpts.drop_after(at_most)
            self.auditor.unmark(lambda ckpt, _: ckpt > at_most)
        to = ckpts.latest.step if ckpts.latest else 0
        redone = st.step - to
        st.redone += redone
        st.step, st.losses = to, st.losses[:to]
        st.val_losses = [v for v in st.val_losses if v[0] <= to]
        self.scales.rollback(to)
        self.run_dir.truncate_losses(to)
        st.restore = self.stages.restore_at(to)
        how = {"standby": "standby peers replace the lost ones", "replan": "re-planned the remaining peers"}.get(
            kind, "the survivors keep their stages; a committed step was not trusted"
        )
        st.reason = f"{how}; rolled back to step {to}"
        self.host.board.rollback(to, st.reason)
        where = f"the checkpoint of step {to}" if to else "the initial weights"
        self.on_event(f"epoch {st.epoch + 1}: {how}; rolling back to {where} ({redone} steps to redo)")
