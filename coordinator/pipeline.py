"""The step pipeline: one training step of the current plan epoch, and the
validation passes. A step is two-phase: peers run their forward and backward passes
and report ``StepDone``; only when every planned peer has does the coordinator count
the step and send ``Commit``, and only then do peers apply the optimizer update.

One exception takes the commit's round trip off the step's path: the first stage
finishes a step last (its final backward), and where nothing it reports can change
the update (no global clip or loss scale, one replica, not the run's last step), its
commit goes out with everyone's once the other stages have reported, and its
``StepDone`` is awaited after it (``early_peers``). A peer lost in that window rolls
the swarm back to its last checkpoint: the first stage may be anywhere in the step."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator

import torch

from coordinator.auditing import Auditor
from coordinator.breakdown import BOARD_EVERY, breakdown_table
from coordinator.checkpoint import RunDir
from coordinator.checkpointing import Checkpoints
from coordinator.host import Host
from coordinator.messaging import Mailbox, send_each
from coordinator.outcome import StepReport, SwarmError
from coordinator.rebalancing import Rebalancer
from coordinator.runstate import EXCLUDED, PeerLost, RunState
from coordinator.scaling import LossScales
from coordinator.spotchecks import Check
from coordinator.stages import Stages
from protocol.model.job import mean_loss, split_batch
from protocol.model.recipe import Update, decide_update, in_model_order
from protocol.net.clock import Clock
from protocol.wire.encoding import encode_values
from protocol.wire.expect import match_values
from protocol.wire.messages import Activations, Commit, EvalActivations, EvalDone, StepDone
from protocol.wire.reject import Rejected

logger = logging.getLogger(__name__)

#: a step's commits under way at once (each bounded by the config's ``send_timeout_s``)
COMMITS_AT_ONCE = 64


class StepPipeline:
    def __init__(
        self,
        host: Host,
        st: RunState,
        stages: Stages,
        mailbox: Mailbox,
        auditor: Auditor,
        checkpoints: Checkpoints,
        rebalancer: Rebalancer,
        scales: LossScales,
        run_dir: RunDir,
        clock: Clock,
        on_step: Callable[[StepReport], None] | None,
        on_event: Callable[[str], None],
    ) -> None:
        self.host = host
        self.cfg = host.config
        self.st = st
        self.stages = stages
        self.job = stages.job
        self.recipe = stages.recipe
        self.mailbox = mailbox
        self.auditor = auditor
        self.checkpoints = checkpoints
        self.rebalancer = rebalancer
        self.scales = scales
        self.run_dir = run_dir
        self.clock = clock
        self.on_step = on_step
        self.on_event = on_event
        self.mb_losses: dict[str, float] = {}  # the last step's losses by micro-batch
        self._data: tuple[int, Iterator[tuple[torch.Tensor, ...]]] | None = None
        self._done_at: dict[str, float] = {}  # when each peer's last StepDone came (clock seconds)
        self._fed: tuple[int, int, tuple[torch.Tensor, ...]] | None = None  # (epoch, step, batch) fed ahead
        self._feeding: asyncio.Task[None] | None = None
        self._counted: tuple[tuple[int, int], float] = ((-1, -1), 0.0)  # the last step counted: (epoch, step), when

    def _batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Batch ``step`` of the deterministic data stream (after a resume or a rollback, the
        stream starts again at ``step``: at once where the data can start anywhere, as token
        shards can; replayed from the first batch otherwise)."""
        if self._data is None or self._data[0] != step:
            self._data = (step, self.job.batches(start=step))
        _, it = self._data
        self._data = (step + 1, it)
        return next(it)

    async def step(self) -> None:
        """Run step ``st.step`` of the current plan, commit it, and what follows it
        (spot checks, a checkpoint, an evaluation, a rebalance)."""
        st = self.st
        assert st.plan is not None
        # the steps of an epoch tile the run's training time: each from the previous one's
        # count, so its commit and a spot check's start are in the next (an evaluation is not)
        began = self.clock.now()
        step, t0 = st.step, self._counted[1] if self._counted[0] == (st.epoch, st.step - 1) else began
        audited = self.auditor.under_way  # the last step's spot checks run in this one's time
        fed, self._fed = self._fed, None
        if fed is not None and fed[:2] == (st.epoch, step):
            batch = fed[2]
        else:
            batch = self._batch(step)
            await self._feed(step, split_batch(batch, self.job.micro_batches))
        try:
            losses, norms, rest = await self.await_done(step, self.job.micro_batches, began, self.early_peers(step))
        except BaseException:
            if self._feeding is not None:  # the step failed: what follows it is fed anew
                self._feeding.cancel()
                self._feeding = None
            raise
        await self._fed_ahead()
        waited = self.clock.now()
        await self.auditor.settled()  # peers hold one committed step for its spot checks
        st.audit_wait_s += self.clock.now() - waited
        checks = self.auditor.sample()
        if checks and step + 1 == self.job.steps:  # the result is never left unchecked
            await self.auditor.check_now(step, checks, self.mb_losses)
            checks, audited = [], True
        update = self._decide(step, norms)
        # the step counts from here: a peer lost now finds the survivors holding or applying it
        counted = self._count(step, update, losses, t0, audited, batch[0].numel())
        candidate = self.rebalancer.poll()
        checkpoint = self.checkpoints.due(force=candidate is not None)
        if checkpoint:
            self.scales.record(st.step)
        evaluate = len(self.stages.eval_micro_batches(st.specs)) if self.job.eval_due(st.step) else 0
        try:
            await self._commit(step, update, checkpoint, evaluate, checks)
            if rest:
                await self._rest_done(step, rest, began)
        except PeerLost as exc:
            if not rest:
                raise
            at_most = step if exc.rollback_to is None else min(step, exc.rollback_to)
            raise PeerLost(exc.lost, rollback_to=at_most) from None
        finally:  # after the commits: the loss's write and the page are off the next step's path
            self._report(counted)
        if checks:
            self.auditor.start(step, checks, self.mb_losses)
        if evaluate:  # validation is not training: out of the steps' time, as a move's set-up is
            evaluated = self.clock.now()
            await self.evaluate(step)
            (key, at), spent = self._counted, self.clock.now() - evaluated
            self._counted = (key, at + spent)
        if candidate is not None:
            await self.rebalancer.move_to(candidate)

    async def _feed(self, step: int, mbs: list[tuple[torch.Tensor, ...]]) -> None:
        """The step's micro-batches to the first stage's peers (checked against the plan first)."""
        st = self.st
        assert st.plan is not None
        for m, mb in enumerate(mbs):
            try:
                match_values(encode_values(list(mb))[0], st.specs[0], None)
            except Rejected as exc:
                raise SwarmError(f"step {step}, micro-batch {m} does not fit the plan: {exc.detail}") from None
        first = st.plan.stages[0]
        for m, mb in enumerate(mbs):
            await self.mailbox.send(first[m % len(first)], Activations(self.cfg.run_id, step, m, 0, st.epoch), list(mb))

    def _feed_ahead(self, step: int) -> None:
        """Send step ``step + 1``'s micro-batches while step ``step`` drains, off the path
        from its last ``StepDone`` to the next step's first forward. Started once every
        last-stage peer has reported ``step``: the first stage's peers have then sent
        all their activations of ``step``, so they are in it and take ``step + 1``'s
        (``peer.checks``). Data only: the next forward still waits for the commit."""
        st = self.st
        if self._feeding is not None or step + 1 >= self.job.steps:
            return

        async def feed(epoch: int) -> None:
            batch = self._batch(step + 1)
            await self._feed(step + 1, split_batch(batch, self.job.micro_batches))
            self._fed = (epoch, step + 1, batch)

        self._feeding = asyncio.create_task(feed(st.epoch))

    async def _fed_ahead(self) -> None:
        """Wait for the feed ahead; one that failed leaves the next step to feed (and
        meet the failure) itself, as without it."""
        task, self._feeding = self._feeding, None
        if task is not None:
            with contextlib.suppress(PeerLost, SwarmError, asyncio.TimeoutError):
                await task

    def _count(self, step: int, update: Update, loss: float, began: float, audited: bool, tokens: int) -> StepReport:
        """Step ``step`` (begun at ``began``) is committed: its loss, time and tokens in
        the run's state; what ``_report`` puts on the record and the page."""
        st = self.st
        st.step += 1
        self.scales.commit(st.step, update)
        st.losses.append(loss)
        now = self.clock.now()
        seconds = now - began
        self._counted = ((st.epoch, step), now)
        st.step_seconds.append(seconds)
        st.audited.append(audited)
        st.tokens += tokens
        st.tokens_per_step = tokens
        return StepReport(step, loss, seconds, tokens)

    def _report(self, counted: StepReport) -> None:
        """A counted step's loss on the record, and the step on the page and to
        ``on_step``: 0.55 ms (median, the demo) that ran between the step's last
        ``StepDone`` and its commit, which the first stage waits for."""
        st = self.st
        self.run_dir.record_loss(counted.step, counted.loss)
        self.host.board.step_done(counted.step, counted.loss, counted.seconds, counted.tokens, self.host.traffic(st))
        if st.step % BOARD_EVERY == 0 or st.step == self.job.steps:
            self.host.board.set_breakdown(breakdown_table(st, self.job.micro_batches))
        if self.on_step:
            self.on_step(counted)

    async def _commit(self, step: int, update: Update, checkpoint: bool, evaluate: int, checks: list[Check]) -> None:
        """Tell every planned peer to apply step ``step``'s update: ``COMMITS_AT_ONCE``
        sends at a time, the first stage's first (its commit starts the next step), one
        signed frame for the peers that keep this step's weights and one for the rest."""
        st, scale = self.st, self.scales.scale
        assert st.plan is not None
        keep = {p for s, _, _ in checks for p in st.plan.stages[s]}  # they keep this step's weights
        plain = Commit(self.cfg.run_id, step, st.epoch, checkpoint, update.factor, update.skip, scale.scale, evaluate)
        kept = dataclasses.replace(plain, audit=True)
        order = _first_stage_first(st.plan.stages, st.planned)
        sends = {p: kept if p in keep else plain for p in order}
        missed = await send_each(self.mailbox.transport, sends, self.cfg.send_timeout_s, COMMITS_AT_ONCE)
        if missed:  # a peer gone before its commit (a cheat leaving?) cannot dodge the checks
            lost = {p: f"unreachable: {why}" for p, why in missed.items()}
            raise PeerLost(lost, rollback_to=step if checks else None)

    def early_peers(self, step: int) -> frozenset[str]:
        """The peers whose ``StepDone`` of ``step`` may come after its commit: the first
        stage's one peer where the update cannot depend on it (no gradient norms asked
        for) and its commit asks nothing of the step's evidence (not the last step, whose
        spot checks run before its commit); none otherwise."""
        st = self.st
        assert st.plan is not None
        first = st.plan.stages[0]
        if self.recipe.needs_norm or len(first) != 1 or len(st.plan.stages) < 2 or step + 1 >= self.job.steps:
            return frozenset()
        return frozenset(first)

    async def await_done(
        self, step: int, micro_batches: int, began: float, early: frozenset[str] = frozenset()
    ) -> tuple[float, dict[str, float], set[str]]:
        """The step's mean loss, the gradient norms of every stage's replica 0 (the step
        began at ``began``, by the clock), and the peers of ``early`` not yet heard from
        once every other peer has reported (``_rest_done`` awaits them after the commit)."""
        st = self.st
        assert st.plan is not None
        pending, step_losses, norms = set(st.planned), {}, {}
        while pending and not pending <= early:
            inbound = await self.mailbox.next((StepDone,), pending)
            msg: StepDone = inbound.message
            if msg.step != step:
                continue
            pending.discard(inbound.sender)
            if pending.isdisjoint(st.plan.stages[-1]):
                self._feed_ahead(step)
            if inbound.sender in st.plan.stages[-1]:  # only the last stage computes the loss
                step_losses.update(finite_losses(inbound.sender, msg.losses, self.recipe.scales_loss))
            if self.recipe.needs_norm and inbound.sender in (g[0] for g in st.plan.stages):
                norms.update(self._checked_norms(inbound.sender, msg))
            self._account(inbound.sender, msg, began)
        self.mb_losses = step_losses
        if len(step_losses) != micro_batches:
            raise SwarmError(f"step {step}: got {len(step_losses)} losses for {micro_batches} micro-batches")
        return sum(step_losses.values()) / micro_batches, norms, pending

    async def _rest_done(self, step: int, pending: set[str], began: float) -> None:
        """The ``StepDone`` of ``step`` from the ``pending`` peers, whose commit went first."""
        while pending:
            inbound = await self.mailbox.next((StepDone,), pending)
            if inbound.message.step == step:
                pending.discard(inbound.sender)
                self._account(inbound.sender, inbound.message, began)

    def _account(self, sender: str, msg: StepDone, began: float) -> None:
        """What a peer's StepDone says of its compute and traffic, on the record."""
        st = self.st
        st.record_compute(sender, msg.compute_s)
        now = self.clock.now()  # no peer computes longer than the time that went by
        st.train_compute_s += reported_seconds(msg.compute_s, now - began)
        st.audit_compute_s += reported_seconds(msg.audit_s, now - self._done_at.get(sender, began))
        self._done_at[sender] = now
        self.rebalancer.measure(sender, msg)
        assert st.plan is not None
        stage = next((s for s, group in enumerate(st.plan.stages) if sender in group), None)
        if stage is not None:
            st.breakdown.record(stage, msg)
        st.link_bytes[sender] = msg.bytes_sent
        st.raw_bytes[sender] = msg.raw_sent

    def _checked_norms(self, sender: str, msg: StepDone) -> dict[str, float]:
        """A stage's gradient norms: only its own parameters, none negative."""
        assert self.st.plan is not None
        stage = next(s for s, group in enumerate(self.st.plan.stages) if sender in group)
        own = self.stages.names(self.st.plan.cut)[stage]
        bad = [n[:80] for n, v in msg.grad_norms.items() if n not in own or not _norm_value(v)]
        if bad:
            raise PeerLost({sender: f"{EXCLUDED}it reported gradient norms that are not its stage's ({bad[0]})"})
        if not self.recipe.scales_loss and not all(math.isfinite(v) for v in msg.grad_norms.values()):
            # its inputs were finite (receivers check them): its own gradients are not
            raise PeerLost({sender: f"{EXCLUDED}it reported a non-finite gradient norm"})
        return {n: float(v) for n, v in msg.grad_norms.items()}

    def _decide(self, step: int, norms: dict[str, float]) -> Update:
        """The step's update (the global clip, fp16's skip and loss scale)."""
        scale = self.scales.scale
        if not self.recipe.needs_norm:
            return Update(scale=scale)
        update = decide_update(self.recipe, in_model_order(self.stages.param_order, norms), scale)
        if update.skip:
            now = update.scale.scale
            self.on_event(f"step {step}: the gradients are not finite; update skipped, loss scale now {now:g}")
        return update

    async def evaluate(self, step: int) -> None:
        """Run the validation set forward through the stages after step ``step``'s
        update; record the validation loss."""
        st, cfg = self.st, self.cfg
        assert st.plan is not None
        mbs = self.stages.eval_micro_batches(st.specs)
        first, last = st.plan.stages[0], st.plan.stages[-1]
        for m, mb in enumerate(mbs):
            await self.mailbox.send(first[m % len(first)], EvalActivations(cfg.run_id, step, m, 0, st.epoch), list(mb))
        pending, losses = set(last), {}
        while pending:
            inbound = await self.mailbox.next((EvalDone,), pending)
            if inbound.message.step != step:
                continue
            pending.discard(inbound.sender)
            replica = last.index(inbound.sender)  # its own micro-batches only: not another replica's
            own = {k: v for k, v in inbound.message.losses.items() if _of_replica(k, replica, len(last))}
            losses.update(finite_losses(inbound.sender, own, self.recipe.scales_loss))
        wanted = [str(m) for m in range(len(mbs))]
        if any(k not in losses for k in wanted):
            self.on_event(f"step {step}: the evaluation came back incomplete; no validation loss recorded")
            return
        val = mean_loss([losses[k] for k in wanted])
        st.val_losses.append((step + 1, val))
        self.run_dir.set_meta("val_losses", st.val_losses)
        self.host.board.evaluated(step + 1, val)
        self.on_event(f"validation loss after step {step + 1}: {val:.4f}")


def _first_stage_first(stages: list[list[str]], peers: set[str]) -> list[str]:
    """``peers`` in stage order (the first stage's, whose commit starts the next step, first)."""
    order = {p: i for i, p in enumerate(p for group in stages for p in group)}
    return sorted(peers, key=lambda p: (order.get(p, len(order)), p))


def _norm_value(v: object) -> bool:
    """A gradient norm as a peer may report it: a number, not negative (inf and nan
    say the gradients were not finite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not v < 0


def reported_seconds(reported: float, went_by: float = 3600.0) -> float:
    """Seconds a peer reports (of one step: at most an hour), at most the ``went_by``
    seconds the coordinator saw pass meanwhile, or 0 where the figure is not a finite,
    non-negative number of them."""
    ok = isinstance(reported, (int, float)) and math.isfinite(reported) and 0 <= reported <= 3600
    return min(float(reported), max(went_by, 0.0)) if ok else 0.0


def finite_losses(sender: str, losses: dict[str, float], overflow_ok: bool = False) -> dict[str, float]:
    """A last-stage peer's losses; one that is not a finite number excludes the peer
    (its inputs were finite: receivers check them), and the step is redone without it.
    Under fp16's loss scaling (``overflow_ok``) an overflow is the scale's business."""
    bad = [k for k, v in losses.items() if not isinstance(v, (int, float)) or not (overflow_ok or math.isfinite(v))]
    if bad:
        raise PeerLost(
            {sender: f"excluded: it reported a non-finite loss ({losses[bad[0]]!r}) for micro-batch {bad[0]}"}
        )
    return losses


def _of_replica(mb: str, replica: int, replicas: int) -> bool:
    """Whether validation micro-batch ``mb`` (a string key) is the given replica's."""
    return mb.isdigit() and int(mb) % replicas == replica
