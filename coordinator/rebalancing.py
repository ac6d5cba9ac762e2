"""The coordinator driver's rebalancing: each peer's speed measured from its step
reports (not its advert), and, every ``rebalance_every`` steps, OP-Fence re-run
on the measured speeds (standby peers included, so peers that joined mid-run
are taken in). When the pure rule (``replan.rebalance``) says the new plan pays
for its move, the step just committed is checkpointed and a new plan epoch
starts from that checkpoint: no rollback, and the run stays exact."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from coordinator import replan
from coordinator.assign import Assignment, live_profile, network_from_adverts
from coordinator.estimator import DagCosts, Plan, predict
from coordinator.opdag import OpDag
from coordinator.runstate import DriverParts
from protocol.wire.codecs import Codec
from protocol.wire.messages import Advert, StepDone

logger = logging.getLogger(__name__)


class Rebalancing(DriverParts):
    """Mixed into :class:`coordinator.run.Driver`."""

    dag: OpDag
    _costs: DagCosts | None = None

    def _measure(self, sender: str, msg: StepDone) -> None:
        """A peer's effective speed from its report of one step's compute."""
        st = self.st
        assert st.plan is not None
        s, r = st.plan.stage_of(sender)
        n = len(range(r, self.job.micro_batches, len(st.plan.stages[s])))
        flops = self.dag.stage_costs(st.plan.cut)[s]["flops"]
        if msg.compute_s > 0 and n and flops > 0:
            samples = st.speeds.setdefault(sender, [])
            samples.append(replan.effective_flops(flops, n, msg.compute_s))
            del samples[: -replan.LONG_SAMPLES]
            self.coord.board.measured(sender, replan.robust_speed(samples))

    def _measured(self, adverts: list[Advert]) -> list[Advert]:
        """The adverts with each measured peer's FLOP/s replaced by its planning speed."""
        speeds, levels = self.st.speeds, self.st.levels

        def speed(a: Advert) -> float:
            return replan.planning_speed(speeds[a.peer_id], levels.get(a.peer_id, []))

        return [dataclasses.replace(a, flops=speed(a)) if a.peer_id in speeds else a for a in adverts]

    def _record_levels(self) -> None:
        """Each measured peer's recent speed as seen at this check (``replan.level_changes``)."""
        st = self.st
        epoch_began = st.levels_epoch != st.epoch  # a new plan since: speeds are of other operators now
        st.levels_epoch = st.epoch
        for p, samples in st.speeds.items():
            levels = st.levels.setdefault(p, [])
            levels.extend([None, replan.robust_speed(samples)] if epoch_began else [replan.robust_speed(samples)])
            del levels[: -replan.LEVEL_CHECKS]
            if p in st.planned and replan.new_level(levels) and st.rebalance_doubt:
                logger.info("peer %s changed speed for good: the doubt of earlier moves is cleared", p)
                st.rebalance_doubt = 0.0

    def _rebalance_check(self) -> Assignment | None:
        """Every ``rebalance_every`` steps (a full period into the epoch, and not within
        the cool-down after the last rebalance): the plan to move to, if any."""
        st, every = self.st, self.cfg.rebalance_every
        assert st.plan is not None
        if not every or st.step % every:
            return None
        self._record_levels()
        if st.step >= self.job.steps or st.step - st.epoch_start < every:
            return None
        revert = self._judge_last_rebalance()
        if revert is not None:
            return revert
        if st.step - st.last_rebalance < replan.cooldown_steps(every):
            return None
        pool = [a for p, a in self.coord.adverts.items() if p in st.planned or p in self._standby()]
        ads = self._measured(pool)
        logger.debug("measured speeds (GFLOP/s): %s", {a.peer_id[-6:]: round(a.flops / 1e9, 2) for a in ads})
        try:
            candidate = self._plan(ads, leave_out=True)
        except Exception as exc:  # no plan for these peers now: keep the current one
            self._said(f"rebalance check at step {st.step}: no plan for the measured speeds: {exc}")
            return None
        if candidate.cut == st.plan.cut and candidate.stages == st.plan.stages or candidate.plan is None:
            self._said(f"rebalance check at step {st.step}: the plan on measured speeds is the current one")
            return None
        if _signature(candidate) in st.reverted:
            self._said(f"rebalance check at step {st.step}: the plan on measured speeds was tried and undone")
            return None
        remaining, move = self.job.steps - st.step, self._move_seconds()
        decision = replan.rebalance(
            self._predicted(ads), candidate.plan.iteration_s, remaining, move, st.rebalance_doubt
        )
        self._said(f"rebalance check at step {st.step}: {decision.why}")
        if not decision.go:
            return None
        st.rebalance_why, st.rebalance_gain = decision.why, decision.current_s / decision.candidate_s
        return candidate

    def _said(self, text: str) -> None:
        """A rebalance check's outcome: logged, and shown on the page (its own history)."""
        logger.info("%s", text)
        self.coord.board.event("check", text)

    def _supersede_rebalance(self) -> None:
        """Peers were lost before the last rebalance was judged: what follows measures the
        recovery, not the rebalance, so it is not judged (the bar for the next stays)."""
        last = self.st.rebalances[-1] if self.st.rebalances else None
        if last is not None and "tokens_per_s_after" not in last:
            last["tokens_per_s_after"] = None

    def _judge_last_rebalance(self) -> Assignment | None:
        """One period after a rebalance (its new stages settled), its measured effect sets
        the bar for the next (``replan.next_doubt``); the plan to go back to when
        it made things measurably worse (``replan.should_revert``; a revert is never undone)."""
        st, every = self.st, self.cfg.rebalance_every
        last = st.rebalances[-1] if st.rebalances else None
        if last is None or "tokens_per_s_after" in last or st.step - st.last_rebalance < every:
            return None
        after = self._tokens_per_s(last=max(1, min(every, st.step - st.last_rebalance) - 1))  # not the set-up step
        last["tokens_per_s_after"] = after
        if not last.get("revert"):  # a revert that delivered does not make the move it undid a success
            st.rebalance_doubt = replan.next_doubt(st.rebalance_gain, last["tokens_per_s_before"], after)
        text = (
            f"rebalance at step {last['step']}: {last['tokens_per_s_before']:,.0f} -> {after:,.0f} tokens/s "
            f"(predicted x{st.rebalance_gain:.2f}); the next must be predicted "
            f"{replan.REPLAN_GAIN + st.rebalance_doubt:.0%} faster"
        )
        self.coord.board.event("rebalance", text)
        self.on_event(text)
        return self._revert_to(last, after)

    def _revert_to(self, last: dict[str, Any], after: float) -> Assignment | None:
        st, previous = self.st, self.st.before_rebalance
        before = last["tokens_per_s_before"]
        if last.get("revert") or previous is None or not replan.should_revert(before, after):
            return None
        if any(p in st.lost or p not in self.coord.adverts for g in previous.stages for p in g):
            return None  # a peer of the old plan is gone: nothing to go back to
        assert st.plan is not None
        st.reverted.add(_signature(st.plan))
        st.rebalance_why = (
            f"undoing the move of step {last['step']}: {after:,.0f} tokens/s after it, {before:,.0f} before"
        )
        st.rebalance_gain = before / max(after, 1e-9)
        return previous

    def _predicted(self, ads: list[Advert]) -> float:
        """The current plan's predicted step time on the measured speeds."""
        st = self.st
        assert st.plan is not None
        if self._costs is None:
            self._costs = DagCosts.from_opdag(self.dag)
        by_id = {a.peer_id: live_profile(a) for a in ads}
        bounds = tuple(st.plan.cut.boundaries)
        plan = Plan(bounds, st.plan.stages, [Codec()] * len(bounds))
        nat = {p for p, direct in self.coord.reached.items() if not direct}
        network = network_from_adverts(ads, st.link_mbps, nat)
        return predict(self._costs, plan, by_id, network, self.job.micro_batches).iteration_s

    def _move_seconds(self) -> float:
        """What moving costs: a checkpoint (measured, or guessed before the first) and
        setting the new stages up (the last dispatch, measured)."""
        st = self.st
        cost = st.checkpoint_cost_s if st.checkpoint_cost_s is not None else replan.CHECKPOINT_COST_GUESS_S
        return cost + st.dispatch_s

    async def _rebalance_to(self, candidate: Assignment) -> None:
        """The step just committed was checkpointed: wait for it, then start the new plan
        epoch from it (every stage restores its part; nothing is redone)."""
        st = self.st
        assert st.plan is not None
        await self._next((), set(), until=lambda: st.checkpoint is not None and st.checkpoint.step == st.step)
        await self._audit_settled()  # type: ignore[attr-defined]  # the old plan's peers hold what it needs
        before = self._tokens_per_s()
        moved = _moves(st.plan, candidate)
        revert = candidate is st.before_rebalance
        text = f"rebalanced at step {st.step}: {st.rebalance_why}; {moved}; {before:,.0f} tokens/s before"
        self.coord.board.event("rebalance", text)
        self.on_event(f"epoch {st.epoch + 1}: {text}")
        st.rebalances.append(
            {"step": st.step, "why": st.rebalance_why, "moved": moved, "tokens_per_s_before": before, "revert": revert}
        )
        st.before_rebalance = None if revert else st.plan
        st.plan, st.epoch, st.dispatched = candidate, st.epoch + 1, False
        st.restore, st.reason = "state", f"rebalanced: {st.rebalance_why}"
        st.last_rebalance = st.step
        self.coord.gate.epoch = st.epoch

    def _tokens_per_s(self, last: int = 10) -> float:
        seconds = sum(self.st.step_seconds[-last:])
        tokens = self.st.tokens_per_step * min(last, len(self.st.step_seconds))
        return tokens / seconds if seconds > 0 else 0.0


def _signature(plan: Assignment) -> str:
    """A plan as a rebalance judges it: the cut and the set of peers of each stage (the
    same replicas in another order once slipped past ``reverted``: CI saw a one-stage
    plan of three replicas undone, then proposed again with its replicas reordered)."""
    return f"{plan.cut.to_list()} {[sorted(group) for group in plan.stages]}"


def _moves(old: Assignment, new: Assignment) -> str:
    """What a new plan changes, in words: the cut and the peers of each stage."""
    parts = []
    if old.cut != new.cut:
        parts.append(f"cut {old.cut.to_list()} -> {new.cut.to_list()}")
    old_peers = {p for g in old.stages for p in g}
    new_peers = {p for g in new.stages for p in g}
    if old_peers - new_peers:
        parts.append("to standby: " + ", ".join(sorted(old_peers - new_peers)))
    if new_peers - old_peers:
        parts.append("taken in: " + ", ".join(sorted(new_peers - old_peers)))
    if old.stages != new.stages and not parts[1:]:
        parts.append(f"peers per stage {[len(g) for g in old.stages]} -> {[len(g) for g in new.stages]}")
    return "; ".join(parts) or "peers regrouped"
