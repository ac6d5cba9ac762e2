"""One plan epoch on a peer: set up the assigned stage (keep, restore or build
it), measure the next stage's link, then train steps until the run's last one.

A step is two-phase (see ``coordinator.run``): forward and backward, replica
averaging, ``StepDone``, and only on the coordinator's ``Commit`` the optimizer
update. Replica 0 of each stage sends its state (weights and optimizer) after a
commit that asks for a checkpoint, and after the last step."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from peer import audit
from peer.executor import StageExecutor
from peer.mailbox import Mailbox
from protocol.model import schedule as schedules
from protocol.model.graph import Cut, build_stage, partition, trace
from protocol.model.job import JobSpec, SpecError, foreign_code
from protocol.model.program import Program, ProgramError
from protocol.model.program_check import build_checked
from protocol.model.recipe import LossScale, Recipe, Update
from protocol.net.tasks import honour_cancel, log_failure
from protocol.net.transport import Inbound
from protocol.trust.identity import IdentityError, public_key
from protocol.wire.codecs import Codec, CodecError, ErrorFeedback
from protocol.wire.encoding import Link, all_finite, raw_bytes
from protocol.wire.messages import (
    Activations,
    Assign,
    Audit,
    Commit,
    EvalActivations,
    EvalDone,
    Gradients,
    Ready,
    Recheck,
    ReplicaGrads,
    State,
    StepDone,
    Verdict,
)
from protocol.wire.reject import Reject

if TYPE_CHECKING:
    from peer.node import PeerNode

logger = logging.getLogger(__name__)


class RunRefused(RuntimeError):
    """The assignment cannot be served (e.g. a malformed key or codec in it)."""


class ForeignCode(RunRefused):
    """The run's model is code this peer did not opt in to: it can never serve this run."""


class Poisoned(RuntimeError):
    """A peer sent activations or gradients that are not finite; ``evidence`` is its
    signed frame (head and payload), which the coordinator checks before it believes
    the report."""

    def __init__(self, inbound: Inbound, what: str) -> None:
        super().__init__(f"{Reject.NON_FINITE.value}: {what} from {inbound.sender} hold NaN or infinity")
        self.sender = inbound.sender
        self.evidence = [_bytes_tensor(inbound.head), _bytes_tensor(inbound.frame.payload)]


@dataclass
class AuditHold:
    """A committed step's evidence, held for its spot checks while the next step
    trains: the frames received, and (if the coordinator asked) the stage as it was
    before the step's update, copied on the compute thread."""

    step: int
    kept: dict[tuple[str, int], Inbound]
    state: asyncio.Future[dict[str, torch.Tensor] | None]  # weights and buffers (StageExecutor.snapshot)
    scale: LossScale  # the step's loss scale


@dataclass
class HeldStage:
    """The stage a peer holds across epochs: its executor, which cut and stage it is,
    and the step whose gradients are complete but not yet committed (if any)."""

    key: tuple[tuple[int, ...], int]
    ex: StageExecutor
    pending: int | None = None


class EpochRunner:
    def __init__(self, node: PeerNode, a: Assign, mailbox: Mailbox) -> None:
        self.node = node
        self.a = a
        self.mailbox = mailbox
        try:
            self.job = JobSpec.decode(a.job)
        except SpecError as exc:
            raise RunRefused(f"the assignment's job: {exc}") from None
        code = foreign_code(self.job.model)
        if not a.program and code is not None and code not in node.config.allow_code:
            raise ForeignCode(
                f"the run's model '{self.job.model[:120]}' is code this peer would have to import; it runs only "
                f"built-in models unless joined with --allow-code {code[:120]}"
            )
        self.recipe = Recipe()  # the job's, checked in _setup
        self.cut = Cut(tuple(a.cut))
        self.k, self.s, self.r = self.cut.num_stages, a.stage, a.replica
        self.my_mbs = [m for m in range(self.job.micro_batches) if m % len(a.stages[a.stage]) == a.replica]
        self.timeout = node.config.message_timeout
        self.codecs: list[Codec] = []
        self.feedback = ErrorFeedback()
        self.uploads: list[asyncio.Task[int]] = []  # checkpoint states on their way
        self.mb_grads: dict[int, dict[str, torch.Tensor]] = {}  # replicated stages: own gradients per micro-batch
        self.busy_s = 0.0  # compute and throttle pauses (not waits for messages) since the step began
        self.audit_s = 0.0  # compute spent on spot checks since the last StepDone (reported in it)
        self.kept: dict[tuple[str, int], Inbound] = {}  # this step's received frames: evidence for spot checks
        self.hold: AuditHold | None = None  # the last committed step's, for its spot checks
        self._others: dict[int, StageExecutor] = {}  # other stages of this cut, built to arbitrate
        self._others_at: tuple[int, int] | None = None  # (stage, step) of the weights last loaded to arbitrate
        self.activation_bytes = 0  # what the stage's program computes per micro-batch (its dry run's count)

    async def run(self) -> None:
        """Serve the epoch through the run's last step (and its final state)."""
        self._setup()
        await self._dial_out()
        t0 = time.perf_counter()
        held = await self._stage()
        # answered until the coordinator's next word, also after this epoch fails (a neighbour lost: the checks
        # of the last committed step still need this peer's evidence)
        self.node.serve_audits(asyncio.create_task(self._serve_audits(held)))
        await self._ready(held, time.perf_counter() - t0)
        await self._links()
        if self.a.start_step >= self.job.steps and self.r == 0:
            await self._upload(held, self.job.steps)
        for step in range(self.a.start_step, self.job.steps):
            await self._step(held, step)
        for t in self.uploads:
            await t

    # ------------------------------------------------------------------ setup
    async def _dial_out(self) -> None:
        """Behind a NAT (the plan says so), connect to the plan's peers first: they
        cannot dial this peer, and send to it over these connections."""
        tp, a = self.node.transport, self.a
        assert tp is not None
        tp.dials_in = set(a.nat) - {tp.peer_id}
        tp.forward_via = {}
        if tp.peer_id not in a.nat:
            return
        assert self.node.coordinator is not None
        tp.forward_via = {p: self.node.coordinator.peer_id for p in tp.dials_in}  # neither can dial the other
        peers = sorted({p for group in a.stages for p in group} - set(a.nat))
        failed = await tp.dial_out(peers)
        self.node._say(f"dialled out to {len(peers) - len(failed)} of the plan's {len(peers)} reachable peers")
        if failed:
            logger.warning("could not dial out to %s", ", ".join(failed))

    def _setup(self) -> None:
        tp, a = self.node.transport, self.a
        assert tp is not None and self.node.checks is not None
        try:
            self.recipe = self.job.recipe()
        except SpecError as exc:
            raise RunRefused(str(exc)) from None
        for pid, addrs in a.maddrs.items():
            tp.learn(pid, addrs)
        try:
            keys = {pid: public_key(k) for pid, k in a.keys.items() if pid != tp.peer_id}
        except IdentityError as exc:
            raise RunRefused(f"the assignment holds a bad key: {exc}") from None
        # the plan's peers and the coordinator only: a peer dropped (or banned) since is refused now
        coordinator = self.node.coordinator
        assert coordinator is not None
        tp.gate.keys = {coordinator.peer_id: self.node.coordinator_key, **keys}
        tp.gate.until = {p: end for p, end in a.certs.items() if p in keys and math.isfinite(end)}
        self.node.checks.my_mbs = frozenset(self.my_mbs)
        evals = self.job.eval_batches * self.job.micro_batches if self.job.eval_every else 0
        self.node.checks.eval_mbs = range(a.replica, evals, len(a.stages[a.stage]))
        self.node.checks.step = a.start_step
        rates = list(a.link_mbps)  # per boundary; a link is paced the same both ways
        if self.s < min(self.k - 1, len(rates)):
            for pid in a.stages[self.s + 1]:
                tp.set_rate(pid, rates[self.s])
        if 0 < self.s <= len(rates):
            for pid in a.stages[self.s - 1]:
                tp.set_rate(pid, rates[self.s - 1])

    async def _stage(self) -> HeldStage:
        """The stage's executor holding the state of ``start_step`` (messages.RESTORE_MODES)."""
        a, node = self.a, self.node
        key = (tuple(a.cut), a.stage)
        held = node.held
        if a.restore == "keep":
            if held is None or held.key != key:
                raise RunRefused(f"asked to keep stage {a.stage} of cut {a.cut}, which this peer does not hold")
            await node.run_compute(self._reconcile, held)
            return held
        if a.restore not in ("init", "state"):
            raise RunRefused(f"unknown restore mode '{a.restore}'")
        node.held = None
        if a.program:
            if a.restore != "state":
                raise RunRefused("a stage program comes with its state; the assignment sends none")
            inb = await self.mailbox.get("program", self.timeout)
            if inb.message.stage != a.stage or inb.message.cut != a.cut:
                raise RunRefused(f"got the program of stage {inb.message.stage} of cut {inb.message.cut}")
            ex = await node.run_compute(self._build_program, inb.values())
            node._say(self._lending(ex, inb.values()))
        else:
            ex = await node.run_compute(self._build)
        if a.restore == "state":
            inb = await self.mailbox.get("stagestate", self.timeout)
            if inb.message.stage != a.stage or inb.message.step != a.start_step:
                raise RunRefused(f"got the state of stage {inb.message.stage} step {inb.message.step}")
            tensors = dict(zip(inb.message.names, inb.frame.values(node.device), strict=True))
            try:
                await node.run_compute(ex.load_state_tensors, tensors)
            except ValueError as exc:
                raise RunRefused(f"the stage state does not fit: {exc}") from None
        elif a.start_step != 0:
            raise RunRefused(f"initial weights asked for step {a.start_step}")
        ex.steps_done = a.start_step
        ex.loss_scale = LossScale(a.loss_scale)
        node.held = HeldStage(key, ex)
        return node.held

    def _build_program(self, values: list[Any]) -> StageExecutor:
        """The stage from its program: operators checked against this peer's allowed
        namespaces and the program run on the meta device against the plan's shapes
        before it is built (nothing of it runs on real data before both pass)."""
        last = self.s == self.k - 1
        if foreign_code(self.job.model) in self.node.config.allow_code:
            try:
                self.job.model_factory()  # the code this volunteer opted in to: its own operators register
            except SpecError as exc:
                raise RunRefused(str(exc)) from None
        try:
            module, self.activation_bytes = self._checked_program(self.s, values)
        except ProgramError as exc:
            raise ForeignCode(str(exc)) from None
        return StageExecutor(module, self.job.recipe(), last, casts_inside=True)

    def _checked_program(self, s: int, values: list[Any]) -> tuple[torch.nn.Module, int]:
        """Stage ``s`` built from its program once every check passed (``build_checked``:
        operators, memory against what this peer measured free, a dry run against the
        plan's shapes); ``ProgramError`` otherwise."""
        a, node = self.a, self.node
        if not a.specs or len(a.specs) != self.k:
            raise ProgramError("the assignment does not give the shapes to check the stage program against")
        outputs = None if s == self.k - 1 else a.specs[s + 1]
        memory = node.advert.memory_bytes if node.advert is not None else None
        prog = Program.from_payload(values)
        return build_checked(prog, a.specs[s], outputs, node.device, node.namespaces, memory)

    def _lending(self, ex: StageExecutor, program: list[Any]) -> str:
        """What this peer is about to lend to the stage: operators, parameters, memory
        (weights, gradients and AdamW's two moments in fp32, plus the activations of
        the micro-batches 1F1B keeps in flight) and traffic per step before compression."""
        a, prog = self.a, Program.from_payload(program)
        ops = prog.operators()
        params = sum(p.numel() for p in ex.params)
        in_flight = min(len(self.my_mbs), self.k - self.s)
        memory = 4 * 4 * params + in_flight * self.activation_bytes
        inputs = raw_bytes(a.specs[self.s]) if self.s else 0
        outputs = raw_bytes(a.specs[self.s + 1]) if self.s < self.k - 1 else 0
        traffic = 2 * len(self.my_mbs) * (inputs + outputs)  # values one way, their gradients back
        return (
            f"stage {self.s}: a program of {len(prog.graph['nodes'])} calls to {len(ops)} ATen operators, "
            f"{params / 1e6:.2f}M parameters; lending about {memory / 2**20:.0f} MiB of memory and "
            f"{traffic / 2**20:.1f} MiB of traffic per step (before compression)"
        )

    def _build(self) -> StageExecutor:
        model = self.job.build_model()
        module = build_stage(partition(trace(model), self.cut), self.s).to(self.node.device)
        return StageExecutor(module, self.job.recipe(), self.s == self.k - 1)

    def _reconcile(self, held: HeldStage) -> None:
        """Bring a kept stage to ``start_step``: drop a half-done step, or apply the
        update of a step that was committed while the epoch ended."""
        a, ex = self.a, held.ex
        start = a.start_step
        if ex.steps_done == start:
            ex.discard_step()
        elif ex.steps_done == start - 1 and held.pending == start - 1:
            ex.step(Update(a.pending_factor, a.pending_skip, LossScale(a.loss_scale)))
        else:
            raise RunRefused(f"this peer holds the state of step {ex.steps_done}; the plan starts at step {start}")
        held.pending = None

    async def _ready(self, held: HeldStage, build_s: float) -> None:
        tp, a = self.node.transport, self.a
        assert tp is not None and self.node.coordinator is not None
        next_mbps = {}
        for pid in a.stages[self.s + 1] if self.s < self.k - 1 else []:
            if pid in tp.forward_via:  # through the coordinator: this peer's uplink to it bounds the path
                next_mbps[pid] = self.node.advert.up_mbps if self.node.advert is not None else 0.0
                continue
            next_mbps[pid], _ = await tp.measure_bandwidth(pid, self.node.config.link_probe_bytes, down=False)
        ready = Ready(a.run_id, self.s, self.r, build_s, next_mbps, a.epoch)
        await tp.send(self.node.coordinator.peer_id, ready)

    async def _links(self) -> None:
        plan_msg = (await self.mailbox.get("links", self.timeout)).message
        try:
            codecs = [Codec.from_json(c) for c in plan_msg.codecs]
        except CodecError as exc:
            raise RunRefused(f"the link plan names a bad codec: {exc}") from None
        if len(codecs) != self.k - 1:
            raise RunRefused(f"the link plan has {len(codecs)} codecs for {self.k - 1} boundaries")
        self.codecs = self.node.checks.codecs = codecs

    # ------------------------------------------------------------------ steps
    async def _step(self, held: HeldStage, step: int) -> None:
        node, a = self.node, self.a
        tp = node.transport
        assert tp is not None and node.coordinator is not None and node.checks is not None
        node.checks.step = node.step = step
        order = schedules.make(schedules.effective(a.schedule, a.stages), self.k, len(self.my_mbs))[self.s]
        sends: list[asyncio.Task[int]] = []
        losses: dict[str, float] = {}
        self.busy_s = 0.0
        for kind, i in order:
            if kind == "F":
                sent = await self._forward(held.ex, step, self.my_mbs[i], losses)
            else:
                sent = await self._backward(held.ex, step, self.my_mbs[i])
            if sent is not None:
                sends.append(sent)
        if len(a.stages[self.s]) > 1:
            await self._average_replicas(held.ex, step)
        norms = await self._compute(held.ex.grad_norms) if self.recipe.needs_norm else {}
        for t in sends:
            await t
        held.pending = step
        sent, raw = dict(tp.bytes_sent), dict(tp.raw_sent)
        done = StepDone(a.run_id, step, self.s, self.r, losses, self.busy_s, sent, raw, a.epoch, norms, self.audit_s)
        self.audit_s = 0.0
        await tp.send(node.coordinator.peer_id, done)
        commit: Commit = (await self.mailbox.get(("commit", step), self.timeout)).message
        snapshot = self._snapshot(held.ex, commit.audit)
        self.hold, self.kept = AuditHold(step, self.kept, snapshot, held.ex.loss_scale), {}
        await snapshot  # queued before the update on the compute thread
        await self._compute(held.ex.step, Update(commit.factor, commit.skip, LossScale(commit.loss_scale)))
        held.pending = None
        if commit.evaluate:
            await self._evaluate(held.ex, step, commit.evaluate)
        if self.r == 0 and (commit.checkpoint or step + 1 == self.job.steps):
            await self._upload(held, step + 1)

    async def _forward(self, ex: StageExecutor, step: int, mb: int, losses: dict[str, float]) -> Any:
        node, a = self.node, self.a
        tp = node.transport
        assert tp is not None
        inb = self.kept["act", mb] = await self.mailbox.get(("act", step, mb), self.timeout)
        out = await self._compute(ex.forward, mb, self._checked(inb, "activations"))
        if self.s == self.k - 1:
            losses[str(mb)] = float(out)
            return None
        dest = a.stages[self.s + 1][mb % len(a.stages[self.s + 1])]
        msg = Activations(a.run_id, step, mb, self.s + 1, a.epoch)
        return asyncio.create_task(tp.send(dest, msg, list(out), Link(self.codecs[self.s].forward)))

    async def _backward(self, ex: StageExecutor, step: int, mb: int) -> Any:
        node, a = self.node, self.a
        tp = node.transport
        assert tp is not None
        grad_out = None
        if self.s < self.k - 1:
            inb = self.kept["grad", mb] = await self.mailbox.get(("grad", step, mb), self.timeout)
            grad_out = _finite(
                inb,
                "gradients",
                node.device,
                self.recipe.scales_loss,
            )
        replicated = len(a.stages[self.s]) > 1
        grads, own = await self._compute(_backward, ex, mb, grad_out, self.job.micro_batches, replicated)
        if own is not None:
            self.mb_grads[mb] = own
            names = sorted(own)
            for other, pid in enumerate(a.stages[self.s]):
                if other != self.r:
                    msg = ReplicaGrads(a.run_id, step, self.s, self.r, names, epoch=a.epoch, mb=mb)
                    await tp.send(pid, msg, [own[n] for n in names])
        if self.s == 0:
            return None
        dest = a.stages[self.s - 1][mb % len(a.stages[self.s - 1])]
        # stochastic rounding of gradients: seeded by run, stage, replica and step (reproducible, also
        # when a step is redone in a later epoch)
        rounding = torch.Generator().manual_seed(hash((self.job.seed, self.s, self.r, step)) & (2**62 - 1))
        link = Link(self.codecs[self.s - 1].backward, self.feedback, dest, rounding)
        return asyncio.create_task(tp.send(dest, Gradients(a.run_id, step, mb, self.s - 1, a.epoch), grads, link))

    def _snapshot(self, ex: StageExecutor, wanted: bool) -> asyncio.Future[dict[str, torch.Tensor] | None]:
        """The stage's state before this step's update, if the coordinator will spot-check it."""
        if wanted:
            return asyncio.ensure_future(self._audit_compute(ex.snapshot))
        none: asyncio.Future[dict[str, torch.Tensor] | None] = asyncio.get_running_loop().create_future()
        none.set_result(None)
        return none

    async def _serve_audits(self, held: HeldStage) -> None:
        """Answer the coordinator's spot checks as they come: of the step done and not
        yet committed, or of the last committed one (while the next step trains)."""
        while True:
            inbound = await self.node.audits.get()
            try:
                await self._answer(held, inbound)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the coordinator's wait for the answer decides what it means
                honour_cancel()
                logger.warning("could not answer a spot check of step %s: %s", inbound.message.step, exc)

    async def _audited(
        self, held: HeldStage, step: int
    ) -> tuple[dict[tuple[str, int], Inbound], dict[str, torch.Tensor] | None, LossScale] | None:
        """The frames, the stage's weights and buffers (None: not kept) and the loss
        scale of ``step`` as its spot checks see them."""
        hold = self.hold
        if hold is not None and hold.step == step:
            return hold.kept, await hold.state, hold.scale
        if held.pending == step:  # not updated yet: a copy made before the update (both on the compute thread)
            kept, scale = self.kept, held.ex.loss_scale
            return kept, await self._audit_compute(held.ex.snapshot), scale
        return None

    async def _answer(self, held: HeldStage, inbound: Inbound) -> None:
        tp, coordinator, msg = self.node.transport, self.node.coordinator, inbound.message
        assert tp is not None and coordinator is not None
        found = await self._audited(held, msg.step)
        if found is None:
            return
        kept, state, scale = found
        compute = self._audit_compute  # not the step's busy time: the next step may be training
        if isinstance(msg, Audit):
            reply, values = audit.evidence_for(msg, kept, state)
        elif msg.stage not in (-1, self.s):  # an arbiter: it rebuilds the other stage from the weights shown
            reply, values = await compute(self._arbitrate, scale, msg, inbound.values()), None
        elif state is None:
            reply, values = Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False,
                                    f"it kept no weights of step {msg.step}", msg.epoch, False), None  # fmt: skip
        else:  # a replica of the suspect's stage
            group = self.a.stages[self.s]
            mine = msg.suspect in group and msg.mb % len(group) == group.index(msg.suspect)
            own = kept.get(("rgrad", msg.mb)) if mine else None
            reply, values = await compute(self._recheck, held.ex, (state, scale), msg, inbound.values(), own), None
        await tp.send(coordinator.peer_id, reply, values)

    def _recheck(
        self, ex: StageExecutor, at: tuple[dict[str, torch.Tensor], LossScale], msg: Recheck, values: list[Any],
        own: Inbound | None,
    ) -> Verdict:  # fmt: skip
        """Re-execute a replica's micro-batch with the stage as it was in the audited
        step (on the compute thread, between two of this step's operations)."""
        missing = ex.not_covered(at[0])
        if missing:  # a stage cut otherwise since: its kept weights are not this stage's
            return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False,
                           f"its weights of step {msg.step} lack {missing[0]}", msg.epoch, False)  # fmt: skip
        with ex.holding(*at):
            return self._rechecker(ex, self.s).verdict(msg, values, own)

    def _rechecker(self, ex: StageExecutor, s: int) -> audit.Rechecker:
        assert self.node.transport is not None
        forward = self.codecs[s].forward if s < self.k - 1 else None
        backward = self.codecs[s - 1].backward if s > 0 else None
        tp = self.node.transport
        keys = {**tp.gate.keys, tp.peer_id: tp.identity.public_key}  # an arbiter may have signed the input itself
        return audit.Rechecker(ex, s, keys, forward, backward, self.job.micro_batches)

    def _arbitrate(self, scale: LossScale, msg: Recheck, values: list[Any]) -> Verdict:
        """Re-execute a micro-batch of another stage (two of its replicas disagreed, or
        its only peer is checked): that stage rebuilt from the job, with the weights
        shown (or, ``same_weights``, those loaded for its last arbitration)."""
        n = 2 * len(msg.roles)
        evidence, weights, program = (
            values[:n],
            values[n : len(values) - msg.program],
            values[len(values) - msg.program :],
        )
        if not 0 <= msg.stage < self.k or len(weights) != len(msg.weights) or msg.program < 0:
            return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False, "a malformed arbitration", msg.epoch)
        if msg.same_weights and (self._others_at != (msg.stage, msg.step) or msg.stage not in self._others):
            detail = f"it holds no weights of stage {msg.stage} at step {msg.step} to arbitrate with"
            return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False, detail, msg.epoch, False)
        try:
            other = self._others.get(msg.stage) or self._other_stage(msg.stage, program)
        except (ProgramError, SpecError) as exc:  # it could not check: the coordinator drops it, blames no one
            detail = f"could not build the stage: {exc}"[:400]
            return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False, detail, msg.epoch, False)
        self._others, self._others_at = {msg.stage: other}, None  # kept while it arbitrates the same stage
        if not msg.same_weights:
            try:
                other.load_weights(dict(zip(msg.weights, weights, strict=True)))
            except ValueError as exc:
                return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False, f"the weights: {exc}", msg.epoch)
        self._others_at = (msg.stage, msg.step)
        other.loss_scale = scale
        return self._rechecker(other, msg.stage).verdict(msg, evidence, None)

    def _other_stage(self, s: int, program: list[Any]) -> StageExecutor:
        """Another stage of this cut, to arbitrate: from its program, or (a run whose
        stages are the model's code) rebuilt from the job."""
        last = s == self.k - 1
        if self.a.program:
            module, _ = self._checked_program(s, program)
            return StageExecutor(module, self.recipe, last, casts_inside=True)
        module = build_stage(partition(trace(self.job.build_model()), self.cut), s).to(self.node.device)
        return StageExecutor(module, self.recipe, last)

    async def _evaluate(self, ex: StageExecutor, step: int, count: int) -> None:
        """Run this replica's share of ``count`` validation micro-batches forward; the
        last stage reports their losses."""
        node, a = self.node, self.a
        tp = node.transport
        assert tp is not None and node.coordinator is not None
        group = a.stages[self.s]
        losses: dict[str, float] = {}
        for mb in [m for m in range(count) if m % len(group) == self.r]:
            inb = await self.mailbox.get(("evalact", step, mb), self.timeout)
            out = await self._compute(ex.evaluate, self._checked(inb, "validation activations"))
            if self.s == self.k - 1:
                losses[str(mb)] = float(out)
                continue
            dest = a.stages[self.s + 1][mb % len(a.stages[self.s + 1])]
            msg = EvalActivations(a.run_id, step, mb, self.s + 1, a.epoch)
            await tp.send(dest, msg, list(out), Link(self.codecs[self.s].forward))
        if self.s == self.k - 1:
            await tp.send(node.coordinator.peer_id, EvalDone(a.run_id, step, self.s, self.r, losses, a.epoch))

    def _checked(self, inbound: Inbound, what: str) -> list[Any]:
        """A frame's values, checked for poison (see ``_finite``)."""
        return _finite(inbound, what, self.node.device, overflow_ok=self.recipe.scales_loss)

    async def _compute(self, fn: Any, *args: Any) -> Any:
        """``fn`` on the compute thread, then the idle time the throttle asks for (on the
        event loop: messages and heartbeats go on); both count as busy time."""
        out, seconds = await self.node.run_compute(_timed, self.node.device, fn, *args)
        self.busy_s += seconds + await self.node.throttle.idle(seconds)
        return out

    async def _audit_compute(self, fn: Any, *args: Any) -> Any:
        """``fn`` on the compute thread for a spot check, its seconds counted apart."""
        out, seconds = await self.node.run_compute(_timed, self.node.device, fn, *args)
        self.audit_s += seconds
        return out

    async def _average_replicas(self, ex: StageExecutor, step: int) -> None:
        """Sum every micro-batch's parameter gradients (each already divided by the
        micro-batch count; this replica's and those its replicas sent) in
        micro-batch order: the additions one process's autograd makes, so replicas
        change nothing in the result, bit for bit."""
        per_mb: list[dict[str, torch.Tensor]] = []
        for mb in range(self.job.micro_batches):
            if mb in self.mb_grads:
                per_mb.append(self.mb_grads.pop(mb))
            else:
                inb = self.kept["rgrad", mb] = await self.mailbox.get(("rgrad", step, mb), self.timeout)
                values = self._checked(inb, "replica gradients")
                per_mb.append(dict(zip(inb.message.names, values, strict=True)))
        params = dict(ex.module.named_parameters())
        for grads in per_mb:
            for name, g in grads.items():
                if name not in params or g.shape != params[name].shape:
                    raise RunRefused(f"a replica sent a gradient for '{name[:80]}' that this stage does not have")
        await self.node.run_compute(_sum_in_order, ex, per_mb)

    async def _upload(self, held: HeldStage, step: int) -> None:
        """Send the stage's state after ``step`` steps to the coordinator in the
        background (the snapshot is a copy, so training goes on meanwhile)."""
        node, a = self.node, self.a
        assert node.transport is not None and node.coordinator is not None
        state = await node.run_compute(held.ex.state_tensors)
        names = sorted(state)
        msg = State(a.run_id, self.s, names, a.epoch, step, True)
        send = node.transport.send(node.coordinator.peer_id, msg, [state[n] for n in names])
        self.uploads = [t for t in self.uploads if not t.done()]
        self.uploads.append(asyncio.create_task(send))
        self.uploads[-1].add_done_callback(log_failure)


def _bytes_tensor(data: bytes | memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _finite(inbound: Inbound, what: str, device: torch.device, overflow_ok: bool = False) -> list[Any]:
    """The decoded values of a frame, refused (``Poisoned``) when a floating tensor
    among them holds NaN or infinity: one pass over the decoded tensor. Under fp16's
    loss scaling (``overflow_ok``) an overflow is expected now and then: the step is
    skipped on the gradient norms instead."""
    values = inbound.frame.values(device)
    if not overflow_ok and not all(all_finite(v) for v in values):
        raise Poisoned(inbound, what)
    return values


def _timed(device: torch.device, fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took, its GPU work included."""
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def _backward(
    ex: StageExecutor, mb: int, grad_out: Any, divisor: int, split: bool
) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor] | None]:
    """Backward of one micro-batch; with ``split``, its parameter gradients are taken
    out (and the parameters' ``.grad`` cleared) to be summed in order later."""
    grads = ex.backward(mb, grad_out, divisor)
    if not split:
        return grads, None
    own = {}
    for name, p in ex.module.named_parameters():
        if p.grad is not None:
            own[name] = p.grad
            p.grad = None
    return grads, own


def _sum_in_order(ex: StageExecutor, per_mb: list[dict[str, torch.Tensor]]) -> None:
    params = dict(ex.module.named_parameters())
    total: dict[str, torch.Tensor] = {}
    for grads in per_mb:
        for name, g in grads.items():
            if name not in total:
                total[name] = g.clone()
            else:
                total[name] += g
    for name, g in total.items():
        params[name].grad = g
