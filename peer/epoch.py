"""One plan epoch on a peer: set up the assigned stage (keep, restore or build
it), measure the next stage's link, then train steps until the run's last one.

A step is two-phase (see ``coordinator.run``): forward and backward, replica
averaging, ``StepDone``, and only on the coordinator's ``Commit`` the optimizer
update. Replica 0 of each stage sends its state (weights and optimizer) after a
commit that asks for a checkpoint, and after the last step. Its spot checks are
answered by ``peer.spotcheck.SpotChecks``; the epoch keeps its evidence there."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from peer.checks import PlanChecks
from peer.compute import Compute
from peer.config import PeerConfig
from peer.executor import StageExecutor
from peer.mailbox import Mailbox
from peer.probing import epoch_links
from peer.spotcheck import SpotChecks, as_evidence
from peer.stage import ForeignCode, HeldStage, RunRefused, StageBuilder
from peer.timing import StepTimes
from protocol.model import schedule as schedules
from protocol.model.graph import Cut
from protocol.model.job import JobSpec, SpecError, foreign_code
from protocol.model.recipe import LossScale, Recipe, Update
from protocol.net.tasks import log_failure
from protocol.net.transport import Inbound, Transport
from protocol.trust.identity import IdentityError, public_key
from protocol.wire.codecs import Codec, CodecError, ErrorFeedback
from protocol.wire.encoding import Link, all_finite
from protocol.wire.messages import (
    Activations,
    Assign,
    Commit,
    EvalActivations,
    EvalDone,
    Gradients,
    Ready,
    ReplicaGrads,
    State,
    StepDone,
)
from protocol.wire.reject import Reject
from protocol.wire.step_parts import BREAKDOWN_V

logger = logging.getLogger(__name__)

__all__ = ["EpochEnv", "EpochHost", "EpochRunner", "Poisoned"]


class Poisoned(RuntimeError):
    """A peer sent activations or gradients that are not finite; ``evidence`` is its
    signed frame (head and payload), which the coordinator checks before it believes
    the report."""

    def __init__(self, inbound: Inbound, what: str) -> None:
        super().__init__(f"{Reject.NON_FINITE.value}: {what} from {inbound.sender} hold NaN or infinity")
        self.sender = inbound.sender
        self.evidence = as_evidence(inbound)


class EpochHost(Protocol):
    """What an epoch changes on the peer that runs it (``peer.node.PeerNode`` is one)."""

    held: HeldStage | None  # the stage kept across epochs
    step: int  # the step under way (its heartbeats say it)

    def say(self, text: str) -> None:
        """Tell the volunteer (one line)."""
        ...

    def serve_audits(self, task: asyncio.Task[None] | None) -> None:
        """``task`` answers the coordinator's spot checks from now on (None: no one)."""
        ...


@dataclass(frozen=True)
class EpochEnv:
    """The peer's parts an epoch works with, the same for the whole epoch."""

    config: PeerConfig
    transport: Transport
    coordinator: str  # the coordinator's peer id
    coordinator_key: Any  # its Ed25519 public key
    checks: PlanChecks  # what the gate expects (the epoch keeps it up to date)
    compute: Compute  # the stage's compute thread
    audits: asyncio.Queue[Inbound]  # the coordinator's spot checks of this epoch
    namespaces: tuple[str, ...]  # the operator namespaces this peer runs stage programs from
    memory_bytes: int | None = None  # what this peer measured free (its advert's)
    up_mbps: float = 0.0  # its uplink to the coordinator (its advert's)

    @property
    def device(self) -> torch.device:
        return self.compute.device


class EpochRunner:
    """Serves one assignment (``run``); raises ``RunRefused`` (``ForeignCode``: never
    this run) when the assignment cannot be served."""

    def __init__(self, host: EpochHost, env: EpochEnv, a: Assign, mailbox: Mailbox) -> None:
        self.host = host
        self.env = env
        self.a = a
        self.mailbox = mailbox
        try:
            self.job = JobSpec.decode(a.job)
        except SpecError as exc:
            raise RunRefused(f"the assignment's job: {exc}") from None
        code = foreign_code(self.job.model)
        if not a.program and code is not None and code not in env.config.allow_code:
            raise ForeignCode(
                f"the run's model '{self.job.model[:120]}' is code this peer would have to import; it runs only "
                f"built-in models unless joined with --allow-code {code[:120]}"
            )
        self.recipe = Recipe()  # the job's, checked in _setup
        self.cut = Cut(tuple(a.cut))
        self.k, self.s, self.r = self.cut.num_stages, a.stage, a.replica
        self.my_mbs = [m for m in range(self.job.micro_batches) if m % len(a.stages[a.stage]) == a.replica]
        self.timeout = env.config.message_timeout
        self.codecs: list[Codec] = []
        self.feedback = ErrorFeedback()
        self.uploads: list[asyncio.Task[int]] = []  # checkpoint states on their way
        self.mb_grads: dict[int, dict[str, torch.Tensor]] = {}  # replicated stages: own gradients per micro-batch
        self.replica_sends: list[asyncio.Task[int]] = []  # this step's gradient sends to the other replicas
        self.busy_s = 0.0  # compute and throttle pauses (not waits for messages) since the step began
        self.times = StepTimes()  # where the step's time goes, reported with StepDone
        self.builder = StageBuilder(self.job, a, env.device, env.namespaces, env.config.allow_code, env.memory_bytes)
        self.spot = SpotChecks(env.transport, env.coordinator, env.compute, self.builder)

    async def run(self) -> None:
        """Serve the epoch through the run's last step (and its final state)."""
        self._setup()
        await self._dial_out()
        t0 = time.perf_counter()
        held = await self._stage()
        # answered until the coordinator's next word, also after this epoch fails (a neighbour lost: the checks
        # of the last committed step still need this peer's evidence)
        self.host.serve_audits(asyncio.create_task(self.spot.serve(held, self.env.audits)))
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
        tp, a = self.env.transport, self.a
        tp.dials_in = set(a.nat) - {tp.peer_id}
        tp.direct.listening = tp.peer_id not in a.nat  # no one could use a direct port here
        tp.forward_via = {}
        if tp.peer_id not in a.nat:
            return
        tp.forward_via = {p: self.env.coordinator for p in tp.dials_in}  # neither can dial the other
        peers = sorted({p for group in a.stages for p in group} - set(a.nat))  # its neighbourhood's
        failed = await tp.dial_out(peers)
        self.host.say(f"dialled out to {len(peers) - len(failed)} of its {len(peers)} reachable neighbours")
        if failed:
            logger.warning("could not dial out to %s", ", ".join(failed))

    def _setup(self) -> None:
        tp, a, checks = self.env.transport, self.a, self.env.checks
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
        # its neighbourhood's peers and the coordinator only: a peer dropped (or banned) since is refused now
        tp.gate.keys = {self.env.coordinator: self.env.coordinator_key, **keys}
        tp.gate.until = {p: end for p, end in a.certs.items() if p in keys and math.isfinite(end)}
        checks.my_mbs = frozenset(self.my_mbs)
        evals = self.job.eval_batches * self.job.micro_batches if self.job.eval_every else 0
        checks.eval_mbs = range(a.replica, evals, len(a.stages[a.stage]))
        checks.step = a.start_step
        rates = list(a.link_mbps)  # per boundary; a link is paced the same both ways
        if self.s < min(self.k - 1, len(rates)):
            for pid in a.stages[self.s + 1]:
                tp.set_rate(pid, rates[self.s])
        if 0 < self.s <= len(rates):
            for pid in a.stages[self.s - 1]:
                tp.set_rate(pid, rates[self.s - 1])

    async def _stage(self) -> HeldStage:
        """The stage's executor holding the state of ``start_step`` (messages.RESTORE_MODES)."""
        a, host, compute = self.a, self.host, self.env.compute
        key = (tuple(a.cut), a.stage)
        held = host.held
        if a.restore == "keep":
            if held is None or held.key != key:
                raise RunRefused(f"asked to keep stage {a.stage} of cut {a.cut}, which this peer does not hold")
            await compute.run(self._reconcile, held)
            return held
        if a.restore not in ("init", "state"):
            raise RunRefused(f"unknown restore mode '{a.restore}'")
        host.held = None
        if a.program:
            if a.restore != "state":
                raise RunRefused("a stage program comes with its state; the assignment sends none")
            inb = await self.mailbox.get("program", self.timeout)
            if inb.message.stage != a.stage or inb.message.cut != a.cut:
                raise RunRefused(f"got the program of stage {inb.message.stage} of cut {inb.message.cut}")
            ex = await compute.run(self.builder.own_program, inb.values())
            host.say(self.builder.lending(ex, inb.values(), len(self.my_mbs)))
        else:
            ex = await compute.run(self.builder.from_job, self.s)
        if a.restore == "state":
            inb = await self.mailbox.get("stagestate", self.timeout)
            if inb.message.stage != a.stage or inb.message.step != a.start_step:
                raise RunRefused(f"got the state of stage {inb.message.stage} step {inb.message.step}")
            tensors = dict(zip(inb.message.names, inb.frame.values(compute.device), strict=True))
            try:
                await compute.run(ex.load_state_tensors, tensors)
            except ValueError as exc:
                raise RunRefused(f"the stage state does not fit: {exc}") from None
        elif a.start_step != 0:
            raise RunRefused(f"initial weights asked for step {a.start_step}")
        ex.steps_done = a.start_step
        ex.loss_scale = LossScale(a.loss_scale)
        host.held = HeldStage(key, ex)
        return host.held

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
        a, env = self.a, self.env
        later = a.stages[self.s + 1] if self.s < self.k - 1 else []
        mbps = await epoch_links(
            env.transport, later, a.stages[self.s], self.r, env.config.link_probe_bytes, env.up_mbps
        )
        await env.transport.send(env.coordinator, Ready(a.run_id, self.s, self.r, build_s, mbps, a.epoch))

    async def _links(self) -> None:
        plan_msg = (await self.mailbox.get("links", self.timeout)).message
        try:
            codecs = [Codec.from_json(c) for c in plan_msg.codecs]
        except CodecError as exc:
            raise RunRefused(f"the link plan names a bad codec: {exc}") from None
        if len(codecs) != self.k - 1:
            raise RunRefused(f"the link plan has {len(codecs)} codecs for {self.k - 1} boundaries")
        self.codecs = self.spot.codecs = self.env.checks.codecs = codecs

    # ------------------------------------------------------------------ steps
    async def _step(self, held: HeldStage, step: int) -> None:
        a, tp = self.a, self.env.transport
        self.env.checks.step = self.host.step = step
        lanes = [range(n) for n in a.sizes]  # the schedule compares the stages' replica counts
        order = schedules.make(schedules.effective(a.schedule, lanes), self.k, len(self.my_mbs))[self.s]
        sends: list[asyncio.Task[int]] = []
        losses: dict[str, float] = {}
        self.busy_s, self.replica_sends = 0.0, []
        self.times.start()
        for kind, i in order:
            if kind == "F":
                sent = await self._forward(held.ex, step, self.my_mbs[i], losses)
            else:
                sent = await self._backward(held.ex, step, self.my_mbs[i])
            if sent is not None:
                sends.append(sent)
        sends += self.replica_sends
        if len(a.stages[self.s]) > 1:
            await self._average_replicas(held.ex, step)
        norms = await self._compute("optimizer", held.ex.grad_norms) if self.recipe.needs_norm else {}
        t0 = self.times.clock()
        for t in sends:
            await t
        self.times.since("wire", t0)
        held.pending = step
        sent, raw = dict(tp.bytes_sent), dict(tp.raw_sent)
        audit_s = self.spot.spent()
        parts = self.times.report()
        done = StepDone(
            a.run_id, step, self.s, self.r, losses, self.busy_s, sent, raw, a.epoch, norms, audit_s, parts, BREAKDOWN_V
        )
        await tp.send(self.env.coordinator, done)
        t0 = self.times.clock()
        commit: Commit = (await self.mailbox.get(("commit", step), self.timeout)).message
        t0 = self.times.since("commit", t0)
        await self.spot.hold(step, held.ex, commit.audit)  # its snapshot queued before the update
        self.times.since("spot_checks", t0)
        await self._compute("optimizer", held.ex.step, Update(commit.factor, commit.skip, LossScale(commit.loss_scale)))
        held.pending = None
        t0 = self.times.clock()
        if commit.evaluate:
            await self._evaluate(held.ex, step, commit.evaluate)
        t0 = self.times.since("eval", t0)
        if self.r == 0 and (commit.checkpoint or step + 1 == self.job.steps):
            await self._upload(held, step + 1)
        self.times.since("checkpoint", t0)

    async def _forward(self, ex: StageExecutor, step: int, mb: int, losses: dict[str, float]) -> Any:
        a = self.a
        inb = self.spot.keep("act", mb, await self._await(("act", step, mb)))
        out = await self._compute("forward", ex.forward, mb, self._checked(inb, "activations"))
        if self.s == self.k - 1:
            losses[str(mb)] = float(out)
            return None
        dest = a.stages[self.s + 1][mb % len(a.stages[self.s + 1])]
        msg = Activations(a.run_id, step, mb, self.s + 1, a.epoch)
        return self._send_soon(dest, msg, list(out), Link(self.codecs[self.s].forward))

    async def _backward(self, ex: StageExecutor, step: int, mb: int) -> Any:
        a = self.a
        grad_out = None
        if self.s < self.k - 1:
            inb = self.spot.keep("grad", mb, await self._await(("grad", step, mb)))
            t0 = self.times.clock()
            grad_out = _finite(inb, "gradients", self.env.device, self.recipe.scales_loss)
            self.times.since("encode", t0)
        replicated = len(a.stages[self.s]) > 1
        grads, own = await self._compute("backward", _backward, ex, mb, grad_out, self.job.micro_batches, replicated)
        sent = None
        if self.s > 0:  # first the gradient the pipeline waits for, then the replicas' (the step's end waits for those)
            dest = a.stages[self.s - 1][mb % len(a.stages[self.s - 1])]
            # stochastic rounding of gradients: seeded by run, stage, replica and step (reproducible, also
            # when a step is redone in a later epoch)
            rounding = torch.Generator().manual_seed(hash((self.job.seed, self.s, self.r, step)) & (2**62 - 1))
            link = Link(self.codecs[self.s - 1].backward, self.feedback, dest, rounding)
            sent = self._send_soon(dest, Gradients(a.run_id, step, mb, self.s - 1, a.epoch), grads, link)
        if own is not None:
            self.mb_grads[mb] = own
            names = sorted(own)
            for other, pid in enumerate(a.stages[self.s]):  # to every replica at once, awaited at the step's end
                if other != self.r:
                    msg = ReplicaGrads(a.run_id, step, self.s, self.r, names, epoch=a.epoch, mb=mb)
                    self.replica_sends.append(self._send_soon(pid, msg, [own[n] for n in names]))
        return sent

    async def _evaluate(self, ex: StageExecutor, step: int, count: int) -> None:
        """Run this replica's share of ``count`` validation micro-batches forward; the
        last stage reports their losses."""
        a, tp = self.a, self.env.transport
        group = a.stages[self.s]
        losses: dict[str, float] = {}
        for mb in [m for m in range(count) if m % len(group) == self.r]:
            inb = await self.mailbox.get(("evalact", step, mb), self.timeout)
            out = await self._compute("eval", ex.evaluate, self._checked(inb, "validation activations"))
            if self.s == self.k - 1:
                losses[str(mb)] = float(out)
                continue
            dest = a.stages[self.s + 1][mb % len(a.stages[self.s + 1])]
            msg = EvalActivations(a.run_id, step, mb, self.s + 1, a.epoch)
            await tp.send(dest, msg, list(out), Link(self.codecs[self.s].forward))
        if self.s == self.k - 1:
            await tp.send(self.env.coordinator, EvalDone(a.run_id, step, self.s, self.r, losses, a.epoch))

    def _checked(self, inbound: Inbound, what: str) -> list[Any]:
        """A frame's values, checked for poison (see ``_finite``); the time is ``encode``'s."""
        t0 = self.times.clock()
        try:
            return _finite(inbound, what, self.env.device, overflow_ok=self.recipe.scales_loss)
        finally:
            self.times.since("encode", t0)

    async def _await(self, key: tuple[Any, ...]) -> Inbound:
        """A stage message from the mailbox; the wait is the neighbour's (bubble) until its
        first byte arrives, then the wire's."""
        t0 = self.times.clock()
        inb: Inbound = await self.mailbox.get(key, self.timeout)
        self.times.waited(t0, inb.wire_s)
        return inb

    def _send_soon(self, dest: str, msg: Any, values: list[Any], link: Link | None = None) -> asyncio.Task[int]:
        """Encode and sign now (``encode``), and write in the background."""
        t0 = self.times.clock()
        out = self.env.transport.prepare(dest, msg, values, link)
        self.times.since("encode", t0)
        return asyncio.create_task(self.env.transport.transmit(out))

    async def _compute(self, part: str, fn: Any, *args: Any) -> Any:
        """``fn`` on the compute thread (or, short, on the loop: ``Compute.timed``), then
        the idle time the throttle asks for (on the event loop: messages and heartbeats
        go on); both count as busy time, and as
        ``part``'s; waiting for the thread while a spot check holds it is ``spot_checks``',
        the rest of the wait (handing the work to the thread and back) ``handoff``'s."""
        t0, checked = self.times.clock(), self.spot.seconds
        out, seconds = await self.env.compute.throttled(fn, *args, inline=part)
        self.busy_s += seconds
        self.times.add(part, seconds)
        self.times.thread_wait(self.times.clock() - t0 - seconds, self.spot.seconds - checked)
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
                inb = self.spot.keep("rgrad", mb, await self._await(("rgrad", step, mb)))
                values = self._checked(inb, "replica gradients")
                per_mb.append(dict(zip(inb.message.names, values, strict=True)))
        params = dict(ex.module.named_parameters())
        for grads in per_mb:
            for name, g in grads.items():
                if name not in params or g.shape != params[name].shape:
                    raise RunRefused(f"a replica sent a gradient for '{name[:80]}' that this stage does not have")
        await self._compute("optimizer", _sum_in_order, ex, per_mb)

    async def _upload(self, held: HeldStage, step: int) -> None:
        """Send the stage's state after ``step`` steps to the coordinator in the
        background (the snapshot is a copy, so training goes on meanwhile)."""
        a, tp = self.a, self.env.transport
        state = await self.env.compute.run(held.ex.state_tensors)
        names = sorted(state)
        msg = State(a.run_id, self.s, names, a.epoch, step, True)
        send = tp.send(self.env.coordinator, msg, [state[n] for n in names])
        self.uploads = [t for t in self.uploads if not t.done()]
        self.uploads.append(asyncio.create_task(send))
        self.uploads[-1].add_done_callback(log_failure)


def _finite(inbound: Inbound, what: str, device: torch.device, overflow_ok: bool = False) -> list[Any]:
    """The decoded values of a frame, refused (``Poisoned``) when a floating tensor
    among them holds NaN or infinity: one pass over the decoded tensor. Under fp16's
    loss scaling (``overflow_ok``) an overflow is expected now and then: the step is
    skipped on the gradient norms instead."""
    values = inbound.frame.values(device)
    if not overflow_ok and not all(all_finite(v) for v in values):
        raise Poisoned(inbound, what)
    return values


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
