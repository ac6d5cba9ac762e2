"""The training driver of a swarm run: phases (plan, dispatch, step, checkpoint,
recover, collect) over an explicit :class:`RunState`, keyed on the plan epoch.

A step is two-phase: peers run their forward and backward passes and report
``StepDone``; only when every planned peer has, the coordinator counts the step
and sends ``Commit``, and only then do peers apply the optimizer update. So when
a peer is lost mid-step, no survivor has applied that step, and it can be redone
exactly. A new plan epoch keeps the survivors' state when every stage kept a
peer (replicas), and otherwise rolls every stage back to the last checkpoint and
replays the deterministic data stream from there.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from coordinator import replan
from coordinator.assign import Assignment, assign
from coordinator.auditing import AUDIT_GRACE_S, Auditing
from coordinator.checkpoint import RunDir
from coordinator.checkpointing import Checkpointing
from coordinator.links import boundary_specs
from coordinator.messaging import Messaging
from coordinator.opdag import build_opdag
from coordinator.outcome import StepReport, SwarmError
from coordinator.rebalancing import Rebalancing
from coordinator.runstate import BANNED, EXCLUDED, PeerLost, RunState
from coordinator.weights import InitError, read_init
from protocol.model.graph import Cut
from protocol.model.job import mean_loss, split_batch
from protocol.model.program import ProgramError, export_stages
from protocol.model.recipe import LossScale, Update, decide_update, in_model_order, initial_scale
from protocol.net.tasks import cancel_all
from protocol.net.transport import Inbound
from protocol.wire.encoding import encode_values
from protocol.wire.expect import match_values
from protocol.wire.messages import (
    Activations,
    Advert,
    Assign,
    Commit,
    EvalActivations,
    EvalDone,
    Finish,
    LinkPlan,
    Ready,
    Release,
    StageProgram,
    StageState,
    Standby,
    StepDone,
)
from protocol.wire.reject import Rejected

if TYPE_CHECKING:
    from coordinator.swarm import Coordinator

logger = logging.getLogger(__name__)


class Driver(Messaging, Checkpointing, Rebalancing, Auditing):
    """Runs one job on a started :class:`Coordinator` through plan epochs."""

    def __init__(
        self,
        coord: Coordinator,
        model: torch.nn.Module,
        run_dir: RunDir,
        on_step: Callable[[StepReport], None] | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.coord = coord
        self.cfg = coord.config
        self.job = coord.config.job
        self.model = model
        self.run_dir = run_dir
        self.on_step = on_step
        self.on_event = on_event or (lambda text: None)
        self.example = self.job.first_micro_batch()
        self.dag = build_opdag(model, self.example)
        self.st = RunState()
        self._failed: dict[str, str] = {}  # found by the link watcher, not yet handled
        self._names: dict[tuple[int, ...], list[set[str]]] = {}
        self._data: tuple[int, Iterator[tuple[torch.Tensor, ...]]] | None = None
        self.final: dict[str, torch.Tensor] | None = None
        self._final_write: asyncio.Task[None] | None = None
        self._evicted: set[str] = set()
        self._side: set[asyncio.Task[Any]] = set()
        self.auditing: set[str] = set()
        self.mb_losses: dict[str, float] = {}
        self.audit_losses: dict[str, float] = {}
        self.audit_box: asyncio.Queue[Inbound] = asyncio.Queue()
        self.audit_queued: collections.Counter[str] = collections.Counter()
        self._shown: dict[int, tuple[list[str], list[torch.Tensor]] | None] = {}
        self._lone_checkers: dict[tuple[int, int, int], list[str]] = {}
        self._loaded: dict[str, tuple[int, int, int]] = {}
        self._audit: tuple[int, asyncio.Task[None]] | None = None
        self._rejoined: set[str] = set()  # planned peers that said hello again (their stage is gone)
        self._done_at: dict[str, float] = {}  # when each peer's last StepDone came (time.perf_counter)
        self.recipe = self.job.recipe()
        self.st.scale = initial_scale(self.recipe)
        self._param_order = [n for n, _ in model.named_parameters()]
        self.init_state = self._read_init()
        self._programs: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}
        #: stages travel as programs of ATen operators (peers import no model code), unless the model has an
        #: operation that cannot be traced to them; then peers build stages from the model's Python (--allow-code)
        self.as_programs = self.cfg.stages_as == "program" and self._exportable()
        coord.board.stages_as = "program" if self.as_programs else "code"
        if self.as_programs and self.init_state is None:
            self.init_state = model.state_dict()  # peers cannot seed what they do not build: they get the weights
        self._eval_set: list[tuple[torch.Tensor, ...]] | None = None
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        activations = sum(op.out_bytes for op in self.dag.ops)  # all of one micro-batch's: what any boundary carries
        #: the most a peer's payload to the coordinator may take: a stage's state (weights, AdamW's two moments)
        #: or the evidence of poison (what one micro-batch carries across a boundary), with slack for the rest
        self.max_payload_bytes = max(3 * weights, 2 * activations) + (1 << 20)

    # ------------------------------------------------------------------ the run
    async def run(self, resume: bool, on_peers: Callable[[int], None] | None = None) -> RunState:
        """Train to the job's last step; returns the final state (``self.final`` holds
        the trained weights). Raises SwarmError when no plan fits the peers left."""
        await (self._resume if resume else self._begin)(on_peers)
        self.coord.gate.listeners.append(self._on_reject)
        watcher = asyncio.create_task(self._watch_links())
        try:
            while self.final is None:
                try:
                    if not self.st.dispatched:
                        await self._dispatch()
                    elif self.st.step < self.job.steps:
                        await self._step()
                    else:
                        await self._collect()
                except PeerLost as exc:
                    await self._recover(exc.lost, exc.rollback_to)
        finally:
            watcher.cancel()
            await self._drop_audit()
            await cancel_all(self._side, AUDIT_GRACE_S)
        await self._release()
        return self.st

    # ------------------------------------------------------------------ plan
    async def _begin(self, on_peers: Callable[[int], None] | None) -> None:
        adverts = await self.coord.wait_for_peers(on_peers)
        self.st.plan = self._plan(list(adverts.values()), keep_out=self.cfg.standby)
        self.st.restore = self._restore_at(0)
        self.run_dir.set_meta("job", self.cfg.job_fields())

    async def _resume(self, on_peers: Callable[[int], None] | None) -> None:
        st = self.st
        self._drop_unaudited()
        info = self.run_dir.latest()
        st.checkpoint = info
        st.step = info.step if info else 0
        st.losses = self.run_dir.losses()[: st.step]
        st.epoch = int(self.run_dir.get_meta("epoch", -1)) + 1
        st.restore, st.reason = self._restore_at(st.step), "the coordinator restarted"
        st.scale = self._saved_scale(st.step)
        st.scale_at[st.step] = st.scale
        st.val_losses = [(int(n), float(v)) for n, v in self.run_dir.get_meta("val_losses", []) if n <= st.step]
        self.coord.board.resumed(st.step, str(self.run_dir.path))
        self.coord.board.restore_losses(st.losses)
        self.on_event(f"resuming run '{self.cfg.run_id}' from the checkpoint of step {st.step} in {self.run_dir.path}")
        adverts = await self.coord.wait_for_peers(on_peers)
        st.plan = self._plan(list(adverts.values()), keep_out=self.cfg.standby)

    def _plan(self, adverts: list[Advert], keep_out: int = 0, leave_out: bool = False) -> Assignment:
        """OP-Fence over ``adverts``; the ``keep_out`` slowest wait as standby, and with
        ``leave_out`` OP-Fence may leave more out where that is faster."""

        ranked = sorted(adverts, key=lambda a: -a.flops)
        use = ranked[: max(len(ranked) - keep_out, 1)]
        k = min(self.cfg.num_stages, len(use)) if self.cfg.num_stages else None if leave_out else len(use)
        try:
            nat = {p for p, direct in self.coord.reached.items() if not direct}
            plan = assign(self.dag, use, k, self.job.micro_batches, standby=leave_out, measured=self.st.link_mbps,
                          nat=nat)  # fmt: skip
        except ValueError as exc:
            raise SwarmError(f"cannot plan the run: {exc}") from None
        return plan

    def _standby(self) -> list[str]:
        """Admitted peers with a live advert outside the plan and not lost, fastest first."""
        live = self.coord.adverts
        planned = self.st.planned
        pool = [a for p, a in live.items() if p not in planned and p not in self.st.lost]
        return [a.peer_id for a in sorted(pool, key=lambda a: -a.flops)]

    # ------------------------------------------------------------------ dispatch
    async def _dispatch(self) -> None:
        st, cfg, tp, board = self.st, self.cfg, self.coord.transport, self.coord.board
        assert st.plan is not None and tp is not None
        plan, k = st.plan, st.plan.cut.num_stages
        t0 = time.monotonic()
        await self._refresh_adverts()
        if cfg.link_mbps and len(cfg.link_mbps) != k - 1:
            raise SwarmError(f"--link-mbps gives {len(cfg.link_mbps)} rates; the plan has {k - 1} stage boundaries")
        st.specs = boundary_specs(self.model, plan.cut, self.example, self.recipe)
        self.coord.gate.epoch = st.epoch
        self.run_dir.set_meta("epoch", st.epoch)
        self.run_dir.set_meta("peers", {p: a.maddrs for p, a in self.coord.adverts.items()})
        board.set_epoch(st.epoch, st.reason)
        board.set_plan(
            [op.flops for op in self.dag.ops],
            self.dag.stage_costs(plan.cut),
            plan.cut.to_list(),
            self.dag.boundary_bytes(plan.cut),
            plan.stages,
        )
        for p in self._standby():
            board.peer_state(p, "standby")
        for p in st.planned:
            tp.learn(p, self.coord.adverts[p].maddrs if p in self.coord.adverts else [])
        self._show_paths(plan.stages)
        states = programs = None
        if st.restore == "state":
            states = await asyncio.get_running_loop().run_in_executor(None, self._stage_states, plan.cut)
        if self.as_programs and st.restore != "keep":
            programs = await asyncio.get_running_loop().run_in_executor(None, self._program_payloads, plan.cut)
        for s, group in enumerate(plan.stages):
            for r, p in enumerate(group):
                await self._send(p, self._assign_msg(s, r))
                if programs is not None:
                    await self._send(p, StageProgram(cfg.run_id, s, plan.cut.to_list(), st.epoch), programs[s])
                if states is not None:
                    names = sorted(states[s])
                    msg = StageState(cfg.run_id, s, names, st.epoch, st.step)
                    await self._send(p, msg, [states[s][n] for n in names])
        for p in self._standby():
            self._background(self._send_quietly(p, Standby(cfg.run_id, st.epoch)))
        now = time.monotonic()
        st.last_heard.update(dict.fromkeys(st.planned, now))
        await self._await_ready()
        st.dispatched = True
        st.dispatch_s, st.epoch_start = time.monotonic() - t0, st.step

    async def _refresh_adverts(self) -> None:
        self.coord.keep_adverts(await self.coord.live_adverts(), self.st.planned)

    def _show_paths(self, stages: list[list[str]]) -> None:
        """On the page, how each planned peer behind a NAT is reached: it dials out, or
        (its stage or a neighbouring one has another such peer) frames are forwarded."""
        nat = {p for group in stages for p in group if not self.coord.reached.get(p, True)}
        for s, group in enumerate(stages):
            partners = {p for i in (s - 1, s, s + 1) if 0 <= i < len(stages) for p in stages[i]}
            for p in nat & set(group):
                self.coord.board.set_connection(p, "forwarded" if (nat & partners) - {p} else "dial-out")

    def _assign_msg(self, s: int, r: int) -> Assign:
        st, cfg, plan = self.st, self.cfg, self.st.plan
        assert plan is not None
        maddrs = {p: self.coord.adverts[p].maddrs for p in st.planned if p in self.coord.adverts}
        keys = self.coord.keys_of(st.planned)
        return Assign(
            cfg.run_id,
            s,
            r,
            cfg.job_fields(),
            plan.cut.to_list(),
            plan.stages,
            maddrs,
            cfg.schedule,
            keys=keys,
            specs=st.specs,
            link_mbps=list(cfg.link_mbps),
            epoch=st.epoch,
            start_step=st.step,
            restore=st.restore,
            loss_scale=st.scale.scale,
            pending_factor=st.last_update.factor,
            pending_skip=st.last_update.skip,
            program=self.as_programs,
            certs={p: self.coord.gate.until[p] for p in st.planned if p in self.coord.gate.until},
            nat=sorted(p for p in st.planned if not self.coord.reached.get(p, True)),
        )

    async def _await_ready(self) -> None:
        st, cfg = self.st, self.cfg
        assert st.plan is not None
        pending, measured = set(st.planned), {}
        while pending:
            inbound = await self._next((Ready,), pending)
            pending.discard(inbound.sender)
            measured[inbound.sender] = inbound.message.next_mbps
            st.learn_links(inbound.sender, {p: v for p, v in inbound.message.next_mbps.items() if p in st.planned})
        st.codecs, st.mbps = self.coord.choose_codecs(self.dag, st.plan, st.specs, measured)
        self.coord.board.set_links([str(c) for c in st.codecs], st.mbps)
        for p in st.planned:
            await self._send(p, LinkPlan(cfg.run_id, [c.to_json() for c in st.codecs], st.epoch))

    # ------------------------------------------------------------------ step
    def _batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Batch ``step`` of the deterministic data stream (replayed after a rollback)."""
        if self._data is None or self._data[0] != step:
            self._data = (step, itertools.islice(self.job.batches(), step, None))
        _, it = self._data
        self._data = (step + 1, it)
        return next(it)

    async def _step(self) -> None:

        st, cfg = self.st, self.cfg
        assert st.plan is not None
        step, t0 = st.step, time.perf_counter()
        audited = self._audit is not None  # the last step's spot checks run in this one's time
        batch = self._batch(step)
        mbs = split_batch(batch, self.job.micro_batches)
        for m, mb in enumerate(mbs):
            try:
                match_values(encode_values(list(mb))[0], st.specs[0], None)
            except Rejected as exc:
                raise SwarmError(f"step {step}, micro-batch {m} does not fit the plan: {exc.detail}") from None
        first = st.plan.stages[0]
        for m, mb in enumerate(mbs):
            await self._send(first[m % len(first)], Activations(cfg.run_id, step, m, 0, st.epoch), list(mb))
        losses, norms = await self._await_done(step, len(mbs), t0)
        waited = time.perf_counter()
        await self._audit_settled()  # peers hold one committed step for its spot checks
        st.audit_wait_s += time.perf_counter() - waited
        checks = self._sample_checks()
        if checks and step + 1 == self.job.steps:  # the result is never left unchecked
            await self._spot_check(step, checks, self.mb_losses)
            checks, audited = [], True
        update = self._decide(step, norms)
        # the step counts from here: a peer lost now finds the survivors holding or applying it
        st.step += 1
        st.scale, st.last_update = update.scale, update
        st.scale_at[st.step] = update.scale
        st.losses.append(losses)
        self.run_dir.record_loss(step, losses)
        seconds = time.perf_counter() - t0
        st.step_seconds.append(seconds)
        st.audited.append(audited)
        st.trained_s += seconds
        st.tokens += batch[0].numel()
        st.tokens_per_step = batch[0].numel()
        self.coord.board.step_done(step, losses, seconds, batch[0].numel(), self.coord.traffic(st))
        if self.on_step:
            self.on_step(StepReport(step, losses, seconds, batch[0].numel()))
        candidate = self._rebalance_check()
        checkpoint = self._checkpoint_due(force=candidate is not None)
        if checkpoint and self.recipe.scales_loss:
            self.run_dir.set_meta(f"loss_scale@{st.step}", [st.scale.scale, st.scale.good])
        evaluate = len(self._eval_micro_batches()) if self.job.eval_due(st.step) else 0
        keep = {p for s, _, _ in checks for p in st.plan.stages[s]}  # they keep this step's weights
        try:
            for p in st.planned:
                msg = Commit(cfg.run_id, step, st.epoch, checkpoint, update.factor, update.skip, st.scale.scale,
                             evaluate, p in keep)  # fmt: skip
                await self._send(p, msg)
        except PeerLost as exc:  # a peer gone before its commit (a cheat leaving?) cannot dodge the checks
            raise PeerLost(exc.lost, rollback_to=step if checks else None) from None
        if checks:
            self._start_audit(step, checks, self.mb_losses)
        if evaluate:
            await self._evaluate(step)
        if candidate is not None:
            await self._rebalance_to(candidate)

    async def _await_done(self, step: int, micro_batches: int, began: float) -> tuple[float, dict[str, float]]:
        """The step's mean loss, and the gradient norms of every stage's replica 0 (the
        step began at ``began``, by ``time.perf_counter``)."""

        st = self.st
        assert st.plan is not None
        pending, step_losses, norms = set(st.planned), {}, {}
        while pending:
            inbound = await self._next((StepDone,), pending)
            msg: StepDone = inbound.message
            if msg.step != step:
                continue
            pending.discard(inbound.sender)
            if inbound.sender in st.plan.stages[-1]:  # only the last stage computes the loss
                step_losses.update(_finite_losses(inbound.sender, msg.losses, self.recipe.scales_loss))
            if self.recipe.needs_norm and inbound.sender in (g[0] for g in st.plan.stages):
                norms.update(self._checked_norms(inbound.sender, msg))
            st.compute.setdefault(inbound.sender, []).append(msg.compute_s)
            now = time.perf_counter()  # no peer computes longer than the time that went by
            st.train_compute_s += _seconds(msg.compute_s, now - began)
            st.audit_compute_s += _seconds(msg.audit_s, now - self._done_at.get(inbound.sender, began))
            self._done_at[inbound.sender] = now
            self._measure(inbound.sender, msg)
            st.link_bytes[inbound.sender] = msg.bytes_sent
            st.raw_bytes[inbound.sender] = msg.raw_sent
        self.mb_losses = step_losses
        if len(step_losses) != micro_batches:
            raise SwarmError(f"step {step}: got {len(step_losses)} losses for {micro_batches} micro-batches")
        return sum(step_losses.values()) / micro_batches, norms

    def fail(self, peer: str, why: str) -> None:
        """Drop a planned peer at the next health check (as if its link had died)."""
        self._failed.setdefault(peer, why)

    # ------------------------------------------------------------------ recipe
    def _read_init(self) -> dict[str, torch.Tensor] | None:
        """The starting weights of ``--init`` (checked against the model), if any."""

        if not self.job.init:
            return None
        try:
            return read_init(self.job.init, self.model)
        except InitError as exc:
            raise SwarmError(str(exc)) from None

    def _exportable(self) -> bool:
        """Whether the model traces to ATen operators (then every stage of every cut does)."""
        try:
            export_stages(self.model, Cut(()), self.example, self.recipe)
        except ProgramError as exc:
            self.on_event(f"stages run the model's own Python on the peers: {exc}")
            return False
        return True

    def _program_payloads(self, cut: Cut) -> list[list[torch.Tensor]]:
        """Each stage's program of ``cut``, as a message carries it (made once per cut)."""
        if cut.boundaries not in self._programs:
            programs = export_stages(self.model, cut, self.example, self.recipe)
            self._programs[cut.boundaries] = [p.to_payload() for p in programs]
        return self._programs[cut.boundaries]

    def _restore_at(self, step: int) -> str:
        """How stages get the state of ``step``: the seeded initialisation at step 0, or
        a state the coordinator sends (a checkpoint's, or ``--init``'s)."""
        return "state" if step or self.init_state is not None else "init"

    def _saved_scale(self, step: int) -> LossScale:
        saved = self.run_dir.get_meta(f"loss_scale@{step}", None) if step else None
        if isinstance(saved, list) and len(saved) == 2:
            return LossScale(float(saved[0]), int(saved[1]))
        return initial_scale(self.recipe)

    def _checked_norms(self, sender: str, msg: StepDone) -> dict[str, float]:
        """A stage's gradient norms: only its own parameters, none negative."""
        assert self.st.plan is not None
        stage = next(s for s, group in enumerate(self.st.plan.stages) if sender in group)
        own = self._stage_names(self.st.plan.cut)[stage]
        bad = [n[:80] for n, v in msg.grad_norms.items() if n not in own or not _norm_value(v)]
        if bad:
            raise PeerLost({sender: f"{EXCLUDED}it reported gradient norms that are not its stage's ({bad[0]})"})
        if not self.recipe.scales_loss and not all(math.isfinite(v) for v in msg.grad_norms.values()):
            # its inputs were finite (receivers check them): its own gradients are not
            raise PeerLost({sender: f"{EXCLUDED}it reported a non-finite gradient norm"})
        return {n: float(v) for n, v in msg.grad_norms.items()}

    def _decide(self, step: int, norms: dict[str, float]) -> Update:
        """The step's update (the global clip, fp16's skip and loss scale)."""
        st = self.st
        if not self.recipe.needs_norm:
            return Update(scale=st.scale)
        update = decide_update(self.recipe, in_model_order(self._param_order, norms), st.scale)
        if update.skip:
            scale = update.scale.scale
            self.on_event(f"step {step}: the gradients are not finite; update skipped, loss scale now {scale:g}")
        return update

    def _eval_micro_batches(self) -> list[tuple[torch.Tensor, ...]]:
        """The validation set (held-out split), checked once against the plan's inputs."""

        if self._eval_set is None:
            mbs = self.job.eval_micro_batches()
            for m, mb in enumerate(mbs):
                try:
                    match_values(encode_values(list(mb))[0], self.st.specs[0], None)
                except Rejected as exc:
                    raise SwarmError(f"validation micro-batch {m} does not fit the plan: {exc.detail}") from None
            self._eval_set = mbs
        return self._eval_set

    async def _evaluate(self, step: int) -> None:
        """Run the validation set forward through the stages after step ``step``'s
        update; record the validation loss."""
        st, cfg = self.st, self.cfg
        assert st.plan is not None
        mbs = self._eval_micro_batches()
        first, last = st.plan.stages[0], st.plan.stages[-1]
        for m, mb in enumerate(mbs):
            await self._send(first[m % len(first)], EvalActivations(cfg.run_id, step, m, 0, st.epoch), list(mb))
        pending, losses = set(last), {}
        while pending:
            inbound = await self._next((EvalDone,), pending)
            if inbound.message.step != step:
                continue
            pending.discard(inbound.sender)
            replica = last.index(inbound.sender)  # its own micro-batches only: not another replica's
            own = {k: v for k, v in inbound.message.losses.items() if _of_replica(k, replica, len(last))}
            losses.update(_finite_losses(inbound.sender, own, self.recipe.scales_loss))
        wanted = [str(m) for m in range(len(mbs))]
        if any(k not in losses for k in wanted):
            self.on_event(f"step {step}: the evaluation came back incomplete; no validation loss recorded")
            return
        val = mean_loss([losses[k] for k in wanted])
        st.val_losses.append((step + 1, val))
        self.run_dir.set_meta("val_losses", st.val_losses)
        self.coord.board.evaluated(step + 1, val)
        self.on_event(f"validation loss after step {step + 1}: {val:.4f}")

    # ------------------------------------------------------------------ checkpoint

    async def _collect(self) -> None:
        """Wait for the last step's checkpoint (every stage's replica 0 sends it) and
        write it; its weights are the run's result."""

        await self._next((), set(), until=lambda: self._final_write is not None)
        assert self._final_write is not None
        try:
            await self._final_write
        except Exception as exc:
            raise SwarmError(f"writing the final checkpoint failed: {exc}") from None

    async def _release(self) -> None:
        """Tell every admitted peer the run is over: the plan's, the standby peers with
        an advert, and those whose advert the DHT did not return just now (a peer never
        told would wait for a coordinator that is gone)."""
        st = self.st
        try:
            await self._refresh_adverts()  # standby peers that came (back) since
        except Exception as exc:  # the DHT may hiccup: the admitted peers are told anyway
            logger.info("the last advert refresh failed: %s", exc)
        told = (st.planned | set(self._standby()) | set(self.coord.gate.keys)) - set(st.lost)
        finish = Finish(self.cfg.run_id, False, st.epoch)
        await asyncio.gather(*(self._send_quietly(p, finish) for p in told if p != self.coord.transport.peer_id))
        await asyncio.gather(*(self._send_quietly(p, Release(self.cfg.run_id)) for p in st.planned))

    # ------------------------------------------------------------------ recover
    async def _recover(self, lost: dict[str, str], rollback_to: int | None = None) -> None:

        st, board = self.st, self.coord.board
        assert st.plan is not None
        lost, rollback_to = await self._audit_before_recovery(lost, rollback_to)
        for p, why in lost.items():
            # revoked at once, a banned peer may be lost to a refused frame before its ban is enforced
            why = BANNED if p in self.coord.banned and not why.startswith(EXCLUDED) else why
            where = self.coord.where(p, st.plan)
            st.lost[p] = why
            self._failed.pop(p, None)
            board.failure(p, where, why)
            self.on_event(f"peer {p} ({where}) failed: {why}")
            self.coord.transport.forget(p)
        self.coord.gate.epoch = st.epoch + 1  # frames of the ending epoch are stale from now on
        self._supersede_rebalance()
        await self._refresh_adverts()
        rec = replan.recover(st.plan.stages, set(st.lost), self._standby())
        for p in self._rejoined & set(st.lost):
            self._back(p)
        self._rejoined.clear()
        if rec.kind == "replan":
            survivors = [a for p, a in self.coord.adverts.items() if p not in st.lost]
            if not survivors:
                raise SwarmError(self._stop_line("no peers are left"))
            try:
                new_plan = self._plan(survivors)
            except SwarmError as exc:
                raise SwarmError(self._stop_line(str(exc))) from None
            if new_plan.plan is not None and not new_plan.plan.fits_memory:
                raise SwarmError(self._stop_line(f"no plan fits the memory of the {len(survivors)} peers left"))
        else:
            new_plan = Assignment(st.plan.cut, rec.stages or [], st.plan.plan)
        for s, old, new in rec.taken:
            board.replaced(s, old, new)
            self.on_event(f"standby peer {new} takes stage {s} from {old}")
        if rec.rollback or rollback_to is not None:
            await self._rollback(rec.kind, rollback_to)
        elif not st.dispatched and st.restore != "keep":
            # the epoch that was setting up restores state: the next one restores the same
            st.reason = "lost replicas dropped while the stages were being set up"
            self.on_event(f"epoch {st.epoch + 1}: stages drop their lost replicas and restore their state again")
        else:
            st.restore, st.reason = "keep", "lost replicas dropped; the survivors hold the state"
            self.on_event(f"epoch {st.epoch + 1}: stages keep their surviving replicas, no rollback")
        st.parts.clear()
        st.asked_at.clear()
        st.plan, st.epoch, st.dispatched = new_plan, st.epoch + 1, False

    async def _rollback(self, kind: str, at_most: int | None = None) -> None:
        """Back to the last checkpoint (of at most ``at_most`` steps: a spot check of the
        step after it failed, or could not finish)."""
        st = self.st
        await self._flush_writes()
        if at_most is not None and st.checkpoint is not None and st.checkpoint.step > at_most:
            self.run_dir.drop_after(at_most)
            self._unmark(lambda ckpt, _: ckpt > at_most)
            st.checkpoint = self.run_dir.latest()
        to = st.checkpoint.step if st.checkpoint else 0
        redone = st.step - to
        st.redone += redone
        st.step, st.losses = to, st.losses[:to]
        st.val_losses = [v for v in st.val_losses if v[0] <= to]
        st.scale, st.last_update = st.scale_at.get(to) or self._saved_scale(to), Update()
        self.run_dir.truncate_losses(to)
        st.restore = self._restore_at(to)
        how = {"standby": "standby peers replace the lost ones", "replan": "re-planned the remaining peers"}.get(
            kind, "the survivors keep their stages; a committed step was not trusted"
        )
        st.reason = f"{how}; rolled back to step {to}"
        self.coord.board.rollback(to, st.reason)
        where = f"the checkpoint of step {to}" if to else "the initial weights"
        self.on_event(f"epoch {st.epoch + 1}: {how}; rolling back to {where} ({redone} steps to redo)")

    def _stop_line(self, why: str) -> str:
        ckpt = self.st.checkpoint
        left = f"the last checkpoint (step {ckpt.step}) is in {ckpt.path}" if ckpt else "no checkpoint was written"
        return f"the run cannot go on: {why}; {left}"


def _norm_value(v: object) -> bool:
    """A gradient norm as a peer may report it: a number, not negative (inf and nan
    say the gradients were not finite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not v < 0


def _seconds(reported: float, went_by: float = 3600.0) -> float:
    """Seconds a peer reports (of one step: at most an hour), at most the ``went_by``
    seconds the coordinator saw pass meanwhile, or 0 where the figure is not a finite,
    non-negative number of them."""
    ok = isinstance(reported, (int, float)) and math.isfinite(reported) and 0 <= reported <= 3600
    return min(float(reported), max(went_by, 0.0)) if ok else 0.0


def _finite_losses(sender: str, losses: dict[str, float], overflow_ok: bool = False) -> dict[str, float]:
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
