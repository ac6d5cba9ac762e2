"""The run's rebalancing: each peer's speed measured from its step reports (not its
advert), and, every ``rebalance_every`` steps, OP-Fence re-run on the measured
speeds (standby peers included, so peers that joined mid-run are taken in). When
the pure rule (``replan.rebalance``) says the new plan pays for its move, the step
just committed is checkpointed and a new plan epoch starts from that checkpoint: no
rollback, and the run stays exact. It owns the speeds, the levels and the record of
past moves that decide the next one."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
from collections.abc import Callable
from typing import Any

from coordinator import host_share, replan
from coordinator.assign import Assignment, moves_text, network_from_adverts, on_own_share, signature
from coordinator.auditing import Auditor
from coordinator.breakdown import run_overheads
from coordinator.checkpointing import Checkpoints
from coordinator.estimator import DagCosts, Plan
from coordinator.host import Host
from coordinator.messaging import Mailbox
from coordinator.netmodel import Network
from coordinator.opdag import OpDag
from coordinator.overheads import LIVE, NONE, Overheads
from coordinator.planning import Planner
from coordinator.rebalance_state import Decided, Priced, RebalanceRecord
from coordinator.runstate import RunState
from protocol.model.job import JobSpec
from protocol.net.clock import Clock
from protocol.wire.codecs import Codec
from protocol.wire.messages import Advert, StepDone

logger = logging.getLogger(__name__)


class Rebalancer:
    def __init__(
        self,
        host: Host,
        st: RunState,
        dag: OpDag,
        job: JobSpec,
        planner: Planner,
        checkpoints: Checkpoints,
        mailbox: Mailbox,
        auditor: Auditor,
        clock: Clock,
        on_event: Callable[[str], None],
    ) -> None:
        self.host = host
        self.st = st
        self.dag = dag
        self.job = job
        self.every = host.config.rebalance_every
        self.planner = planner
        self.checkpoints = checkpoints
        self.mailbox = mailbox
        self.auditor = auditor
        self.clock = clock
        self.on_event = on_event
        self.record = RebalanceRecord()
        self._costs: DagCosts | None = None
        self._planning: asyncio.Task[Decided | None] | None = None  # a check planning
        self._last_skip = ""  # why the last due check did not plan (said once while it holds)

    def measure(self, sender: str, msg: StepDone) -> None:
        """A peer's effective speed from its report of one step's compute."""
        st = self.st
        assert st.plan is not None
        s, r = st.plan.stage_of(sender)
        n = len(range(r, self.job.micro_batches, len(st.plan.stages[s])))
        flops = self.dag.stage_flops(st.plan.cut)[s]
        if msg.compute_s > 0 and n and flops > 0:
            samples = self.record.speeds.setdefault(sender, [])
            samples.append(replan.effective_flops(flops, n, msg.compute_s))
            del samples[: -replan.LONG_SAMPLES]
            self.host.board.measured(sender, replan.robust_speed(samples))

    def measured(self, adverts: list[Advert], network: Network | None = None) -> list[Advert]:
        """The adverts with each measured peer's FLOP/s replaced by its planning speed:
        what it delivered while the current plan kept its machine's other peers busy,
        turned back into its own speed, for each plan to be priced at the share it
        leaves it (``host_share.undivided``); an unmeasured peer's reading scaled as its
        machine's measured peers' were (``host_share.like_measured``). ``network``: the run's links (built from
        the adverts, the links probed so far and the peers behind NATs when not given)."""
        speeds, levels = self.record.speeds, self.record.levels

        def speed(a: Advert) -> float:
            return replan.planning_speed(speeds[a.peer_id], levels.get(a.peer_id, []))

        delivered = [dataclasses.replace(a, flops=speed(a)) if a.peer_id in speeds else a for a in adverts]
        network = network or self._network(delivered)
        as_delivered = [dataclasses.replace(a, host="") for a in delivered]  # no machine divided
        busy = host_share.busy_shares(self._predicted_plan(as_delivered, network=network), self.job.micro_batches)
        own = host_share.undivided(delivered, busy, host_share.lockstep(self._current()))
        return host_share.like_measured(adverts, own, set(speeds))

    def _network(
        self, ads: list[Advert], links: dict[tuple[str, str], float] | None = None, nat: set[str] | None = None
    ) -> Network:
        """The links between ``ads``'s peers: those probed (``links``, else the run's), the rest guessed."""
        links = self.st.link_mbps if links is None else links
        return network_from_adverts(ads, links, self.planner.behind_nat() if nat is None else nat)

    def _current(self) -> Plan:
        """The current plan, without codecs, for the estimator."""
        assert self.st.plan is not None
        bounds = tuple(self.st.plan.cut.boundaries)
        return Plan(bounds, self.st.plan.stages, [Codec()] * len(bounds))

    def _running(self) -> Plan:
        """The current plan with the codecs its links run (``RunState.codecs``; before
        its first dispatch, those it was planned with)."""
        plan = self._current()
        planned = self.st.plan.plan.codecs if self.st.plan is not None and self.st.plan.plan else []
        for codecs in (self.st.codecs, planned):
            if len(codecs) == len(plan.cut):
                return dataclasses.replace(plan, codecs=list(codecs))
        return plan

    def record_levels(self) -> None:
        """Each measured peer's recent speed as seen at this check (``replan.level_changes``)."""
        st, m = self.st, self.record
        epoch_began = m.levels_epoch != st.epoch  # a new plan since: speeds are of other operators now
        m.levels_epoch = st.epoch
        for p, samples in m.speeds.items():
            levels = m.levels.setdefault(p, [])
            levels.extend([None, replan.robust_speed(samples)] if epoch_began else [replan.robust_speed(samples)])
            del levels[: -replan.LEVEL_HISTORY]
            if p in st.planned and replan.new_level(levels) and m.doubt:
                logger.info("peer %s changed speed for good: the doubt of earlier moves is cleared", p)
                m.doubt = 0.0

    def poll(self) -> Assignment | None:
        """At each committed step: the plan to move to, if any. That is a revert
        (``judge_last``) or what a check that finished planning decided; every
        ``rebalance_every`` steps (a full period into the epoch, and not within the
        cool-down after the last rebalance unless a peer fell far since, ``_fell``) a
        check starts planning beside the steps.
        The swarm does not wait for it: a check that planned took 1.1-2.0 s on the demo,
        and every peer waited that long for the step's commit."""
        st, every = self.st, self.every
        assert st.plan is not None
        if st.step >= self.job.steps:
            self.stop()
            return None
        found = self._collect()
        if not every or st.step % every:
            return found
        self.record_levels()
        if found is not None or st.step - st.epoch_start < every:
            return found
        revert = self.judge_last()
        if revert is not None:
            return revert
        m = self.record
        if st.step - m.last_rebalance < replan.cooldown_steps(every) and not self._fell():
            return self._skipped(f"within the cool-down after the rebalance at step {m.last_rebalance}")
        if self._planning is not None:
            return self._skipped("the last one is still planning")
        began, speeds = self.clock.now(), self._speeds()
        if not replan.check_affordable(
            began - m.checked_at, m.check_cost_s, speeds, m.checked_speeds, m.checked_unsettled
        ):
            return self._skipped(f"the last that planned took {m.check_cost_s:.2f} s, over its share of the time since")
        self._planning = asyncio.create_task(self._timed_check(began, speeds, self._measured_s(), self._inputs()))
        self._last_skip = ""
        return None

    async def check(self) -> Assignment | None:
        """``poll``, and the check it started (if any) planned to its end: its decision."""
        found = self.poll()
        if found is not None or self._planning is None:
            return found
        await asyncio.wait({self._planning})
        return self._collect()

    def stop(self) -> None:
        """The run ended or failed, or peers were lost: a check still planning is dropped
        (its thread runs to its end; what it finds is not used)."""
        task, self._planning = self._planning, None
        if task is None:
            return
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.error("a rebalance check failed: %s", task.exception())
        task.cancel()

    async def _timed_check(
        self, began: float, speeds: dict[str, float], measured_s: float, inputs: tuple[int, int, float, tuple[Any, ...]]
    ) -> Decided | None:
        """A check planned (``_plan_check``), and what the next check's budget reads of it:
        when it began, what it cost, the speeds it planned on, and whether a speed was
        still moving or its price of the current plan was off the median step measured
        before it (``measured_s``; ``replan.mispriced``)."""
        m, st = self.record, self.st
        assert st.plan is not None
        plan_key = signature(st.plan)  # the plan ``speeds`` were measured on
        # read before it plans, over this plan's steps only (a move changes what a speed measures)
        unsettled = self._moved_over(min(2 * replan.SPEED_SAMPLES, st.step - st.epoch_start), steady=True) is not None
        found = await self._plan_check(*inputs)  # a check dropped (``stop``) is not counted
        m.checked_at, m.check_cost_s, m.checked_speeds = began, self.clock.now() - began, speeds
        priced = st.repriced[1].iteration_s if st.repriced is not None and st.repriced[0] == inputs[0] else 0.0
        error, m.checked_plan = replan.price_error(priced, measured_s), plan_key
        m.checked_unsettled = unsettled or replan.mispriced(error, m.price_error)
        m.price_error = error if error is not None else m.price_error
        st.checks_planned, st.check_planning_s = st.checks_planned + 1, st.check_planning_s + m.check_cost_s
        return found

    def _collect(self) -> Assignment | None:
        """What a finished check decided: its plan, unless the swarm changed since it began."""
        task = self._planning
        if task is None or not task.done():
            return None
        self._planning = None
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                logger.error("a rebalance check failed: %s", task.exception())
            return None
        found = task.result()
        if found is None:
            return None
        if self._stale(found.candidate, found.step, found.epoch):
            self._said(f"rebalance check at step {found.step}: the swarm changed while it planned")
            return None
        m = self.record
        m.why, m.gain, m.moved_gain, m.before_tokens_per_s = found.why, found.gain, found.moved_gain, found.tokens_per_s
        return found.candidate

    def _stale(self, candidate: Assignment, step: int, epoch: int) -> bool:
        """Whether a plan checked at ``step`` of plan epoch ``epoch`` no longer applies."""
        st = self.st
        gone = set(st.lost) | set(self.mailbox.failed)
        if st.epoch != epoch or st.step >= self.job.steps:
            return True
        return any(p in gone or p not in self.host.adverts for g in candidate.stages for p in g)

    def _moved_over(self, span: int, steady: bool = False) -> str | None:
        """The first planned peer (``steady``: planned at its recent speed, not at its
        average: ``replan.planned_at_recent``) whose speed changed level over its last
        ``span`` measurements (``replan.speed_moved``), in words; None if none did. CI
        saw a move judged over steps in which a peer was throttled to a twentieth: it
        was undone, and the undo and the move made the next one wait for a 50% gain."""
        m = self.record
        for p in sorted(self.st.planned):
            if steady and p in m.speeds and not replan.planned_at_recent(m.speeds[p], m.levels.get(p, [])):
                continue
            moved = replan.speed_moved(m.speeds.get(p, []), span)
            if moved > replan.CHANGED_SPEED:
                return f"peer {p}'s speed moved {moved:.1f}x meanwhile"
        return None

    def _speeds(self) -> dict[str, float]:
        """The planned and standby peers' speeds: measured, else advertised."""
        st, m = self.st, self.record
        pool = set(st.planned) | set(self.planner.standby())
        return {
            p: replan.robust_speed(m.speeds[p]) if p in m.speeds else a.flops
            for p, a in self.host.adverts.items()
            if p in pool
        }

    def _inputs(self) -> tuple[int, int, float, tuple[Any, ...]]:
        """A check's step, plan epoch, tokens/s so far and ``_price``'s inputs, copied at
        the step it begins (the swarm trains on while it plans): the adverts of the
        planned and standby peers, the links, the peers behind NATs, the breakdown's means."""
        st = self.st
        standby = self.planner.standby()
        ads = [a for p, a in self.host.adverts.items() if p in st.planned or p in standby]
        means = st.breakdown.means_ms()
        inputs = (ads, dict(st.link_mbps), set(self.planner.behind_nat()), means)
        return st.step, st.epoch, self.tokens_per_s(), inputs

    async def _plan_check(self, step: int, epoch: int, before: float, inputs: tuple[Any, ...]) -> Decided | None:
        """The planning part of a check begun at ``step`` of plan epoch ``epoch`` on
        ``inputs`` (``_inputs``): the measured speeds, OP-Fence on them and both plans
        priced, on a worker thread (on a thousand peers this takes seconds, and the swarm
        goes on training meanwhile); then the rule. The plan to move to, with the step and
        plan epoch it was checked at."""
        st = self.st
        said = f"rebalance check at step {step}"
        try:
            priced = await asyncio.to_thread(self._price, *inputs)
        except Exception as exc:  # no plan for these peers now (or a recovery changed them): keep the current one
            changed = st.epoch != epoch
            self._said(
                f"{said}: "
                + ("the swarm changed while it planned" if changed else f"no plan for the measured speeds: {exc}")
            )
            return None
        candidate, bare = priced.candidate, priced.bare
        if self._stale(candidate, step, epoch):
            self._said(f"{said}: the swarm changed while it planned")
            return None
        if priced.current is not None:  # kept unless the rule below moves: its price on what the swarm measured
            st.repriced = (step, priced.current)
        if bare is None or candidate.plan is None:
            self._said(f"{said}: the plan on measured speeds is the current one")
            return None
        remaining, move = self.job.steps - st.step, self._move_seconds()
        gain = bare[0] / max(bare[1], 1e-12)
        undone = self.record.reverted.get(signature(candidate))
        if undone is not None and replan.still_banned(undone, gain):
            self._said(f"{said}: the plan on measured speeds was tried and undone")
            return None
        damped = replan.damping([r["step"] for r in st.rebalances], st.step, self.every)
        decision = replan.rebalance(*bare, remaining, move, self._bar(damped))
        self._said(f"{said}: {decision.why}")
        if not decision.go:
            return None
        # what the move must deliver is the whole step's speed-up, fixed costs included
        why, must = f"checked at step {step}: {decision.why}", priced.current_s / priced.candidate_s
        return Decided(candidate, step, epoch, why, must, gain, before)

    def _bar(self, damped: float) -> float:
        """``replan.bar`` on the planned peers' measured speeds."""
        return replan.bar(self.record.doubt, damped, self._planned_speeds(), self.record.moved_speeds)

    def _fell(self) -> bool:
        """Whether a planned peer planned at its recent speed fell far since the last move
        (``replan.fell_for_good``), measured on the plan the move's speeds were (a speed
        is relative to the operators a peer runs): the cool-down after a move does not
        hold the next check back then (which still needs its budget, ``check_affordable``).
        CI saw a move on noise at step 20, its undo at 60 (back to the plan the move's
        speeds were measured on), a peer throttled to a twentieth at 53, and the cool-down
        after the undo hold the checks at 80 and 100."""
        assert self.st.plan is not None
        m = self.record
        same = m.moved_plan == signature(self.st.plan)
        return same and replan.fell_for_good(self._planned_speeds(steady=True), m.moved_speeds)

    def _planned_speeds(self, steady: bool = False) -> dict[str, float]:
        """The planned peers' measured speeds (``_speeds``); ``steady``: of those planned at
        their recent speed (``replan.planned_at_recent``)."""
        m, planned = self.record, set(self.st.planned)
        return {
            p: v
            for p, v in self._speeds().items()
            if p in planned
            and p in m.speeds
            and (not steady or replan.planned_at_recent(m.speeds[p], m.levels.get(p, [])))
        }

    def _measured_s(self) -> float:
        """The median step of this plan's last period, its first (set-up) step left out."""
        st = self.st
        span = max(1, min(self.every, st.step - st.epoch_start - 1))
        return statistics.median(st.step_seconds[-span:]) if st.step_seconds else 0.0

    def _skipped(self, why: str) -> None:
        """A check due that does not plan, and why, on the page (CI saw a move come late,
        and nothing said which rule held the checks back); said once while the reason
        holds, so that skips do not push the outcomes of checks that planned off the page."""
        if why != self._last_skip:
            self._last_skip = why
            self._said(f"rebalance check at step {self.st.step} skipped: {why}")

    def _said(self, text: str) -> None:
        """A rebalance check's outcome: logged, and shown on the page (its own history)."""
        logger.info("%s", text)
        self.host.board.event("check", text)

    def supersede(self) -> None:
        """Peers were lost before the last rebalance was judged: what follows measures the
        recovery, not the rebalance, so it is not judged (the bar for the next stays)."""
        last = self.st.rebalances[-1] if self.st.rebalances else None
        if last is not None and "tokens_per_s_after" not in last:
            last["tokens_per_s_after"] = None

    def judge_last(self) -> Assignment | None:
        """One period after a rebalance (its new stages settled), its measured effect sets
        the bar for the next (``replan.next_doubt``); the plan to go back to when
        it made things measurably worse (``replan.should_revert``; a revert is never undone)."""
        st, m, every = self.st, self.record, self.every
        last = st.rebalances[-1] if st.rebalances else None
        if last is None or "tokens_per_s_after" in last or st.step - m.last_rebalance < every:
            return None
        span = max(1, min(every, st.step - m.last_rebalance) - 1)  # not the set-up step
        moved = self._moved_over(span)
        if moved is not None:  # its tokens/s say what that peer did, not what the move did
            last["tokens_per_s_after"] = None
            text = f"rebalance at step {last['step']}: not judged: {moved}"
            self.host.board.event("rebalance", text)
            self.on_event(text)
            return None
        after = last["tokens_per_s_after"] = self.tokens_per_s(last=span)
        if not last.get("revert"):  # a revert that delivered does not make the move it undid a success
            m.doubt = replan.next_doubt(m.gain, last["tokens_per_s_before"], after)
        text = (
            f"rebalance at step {last['step']}: {last['tokens_per_s_before']:,.0f} -> {after:,.0f} tokens/s "
            f"(predicted x{m.gain:.2f}); the next must be predicted {replan.REPLAN_GAIN + m.doubt:.0%} faster"
        )
        self.host.board.event("rebalance", text)
        self.on_event(text)
        return self.revert_to(last, after)

    def revert_to(self, last: dict[str, Any], after: float) -> Assignment | None:
        """The plan the rebalance ``last`` left, if it is to be undone (see ``judge_last``)."""
        st, m, previous = self.st, self.record, self.record.before
        before = last["tokens_per_s_before"]
        if last.get("revert") or previous is None or not replan.should_revert(before, after):
            return None
        if any(p in st.lost or p not in self.host.adverts for g in previous.stages for p in g):
            return None  # a peer of the old plan is gone: nothing to go back to
        assert st.plan is not None
        m.reverted[signature(st.plan)] = m.moved_gain
        m.why = f"undoing the move of step {last['step']}: {after:,.0f} tokens/s after it, {before:,.0f} before"
        m.gain = before / max(after, 1e-9)
        return previous

    def _price(
        self, ads: list[Advert], links: dict[tuple[str, str], float], nat: set[str], means: dict[int, dict[str, float]]
    ) -> Priced:
        """On the worker thread, from copies of what the loop changes (``links``, ``nat``,
        the breakdown's ``means``): the measured speeds, OP-Fence's plan on them, both
        plans priced; the current one (the summary's prediction) with the swarm's own
        fixed costs from its breakdown (``breakdown.run_overheads``)."""
        st = self.st
        assert st.plan is not None
        network = self._network(ads, links, nat)
        ads = self.measured(ads, network)
        logger.debug("measured speeds (GFLOP/s): %s", {a.peer_id[-6:]: round(a.flops / 1e9, 2) for a in ads})
        candidate = self.planner.plan(ads, 0, True, links, nat)
        running = self._running()
        own = run_overheads(means, self._dag_costs(), running, self.job.micro_batches)
        current = self._predicted_plan(ads, running, own, network)
        if candidate.cut == st.plan.cut and candidate.stages == st.plan.stages or candidate.plan is None:
            return Priced(candidate, None, current)
        # the bar is set on what the two plans differ in: both priced without the swarm's
        # fixed costs, which every plan pays alike (with them, the liar's first check
        # read 78.6 ms against under 20% more and declined; the bar was set without them)
        bare = self._predicted(ads, None, NONE, network), self._predicted(ads, candidate.plan, NONE, network)
        return Priced(candidate, bare, current, self._predicted(ads, candidate.plan, own, network))

    def _predicted(
        self, ads: list[Advert], other: Plan | None = None, overheads: Overheads = LIVE, network: Network | None = None
    ) -> float:
        return self._predicted_plan(ads, other, overheads, network).iteration_s

    def _predicted_plan(
        self, ads: list[Advert], other: Plan | None = None, overheads: Overheads = LIVE, network: Network | None = None
    ) -> Plan:
        """The current plan (or ``other``) predicted on ``ads``'s speeds, each machine shared
        as the plan keeps it busy (``assign.on_own_share``), with fixed costs ``overheads``."""
        plan = self._current() if other is None else other.bare()
        network = network or self._network(ads)
        return on_own_share(self._dag_costs(), plan, ads, network, self.job.micro_batches, overheads)[0]

    def _dag_costs(self) -> DagCosts:
        if self._costs is None:
            self._costs = DagCosts.from_opdag(self.dag)
        return self._costs

    def _move_seconds(self) -> float:
        """What moving costs: a checkpoint (measured, or guessed before the first) and
        setting the new stages up (the last dispatch, measured)."""
        cost = self.checkpoints.cost_s
        return (cost if cost is not None else replan.CHECKPOINT_COST_GUESS_S) + self.st.dispatch_s

    async def move_to(self, candidate: Assignment) -> None:
        """The step just committed was checkpointed: wait for it, then start the new plan
        epoch from it (every stage restores its part; nothing is redone)."""
        st, m = self.st, self.record
        assert st.plan is not None
        ckpts = self.checkpoints
        await self.mailbox.next((), set(), until=lambda: ckpts.latest is not None and ckpts.latest.step == st.step)
        await self.auditor.settled()  # the old plan's peers hold what its spot checks need
        revert = candidate is m.before
        # a checked move's tokens/s before it are those up to its check: not the steps
        # it planned beside, which shared the coordinator's and the peers' cores with it
        before = m.before_tokens_per_s if m.before_tokens_per_s is not None and not revert else self.tokens_per_s()
        m.before_tokens_per_s = None
        moved = moves_text(st.plan, candidate)
        text = f"rebalanced at step {st.step}: {m.why}; {moved}; {before:,.0f} tokens/s before"
        self.host.board.event("rebalance", text)
        self.on_event(f"epoch {st.epoch + 1}: {text}")
        st.rebalances.append(
            {"step": st.step, "why": m.why, "moved": moved, "tokens_per_s_before": before, "revert": revert}
        )
        m.before = None if revert else st.plan
        # those its check planned on (a revert's: the last check's), the measured ones only
        m.moved_speeds = {p: v for p, v in m.checked_speeds.items() if p in m.speeds}
        m.moved_plan = m.checked_plan
        st.next_epoch(candidate)
        st.restore, st.reason = "state", f"rebalanced: {m.why}"
        m.last_rebalance = st.step
        self.host.gate.epoch = st.epoch

    def tokens_per_s(self, last: int = 10) -> float:
        """Tokens a second over the ``last`` steps."""
        seconds = sum(self.st.step_seconds[-last:])
        tokens = self.st.tokens_per_step * min(last, len(self.st.step_seconds))
        return tokens / seconds if seconds > 0 else 0.0
