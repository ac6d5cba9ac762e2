"""A peer's side of spot checks (``protocol.trust.spotcheck``): for a step it finished
(before its ``Commit``, or after it while the next step trains, from what it held)
it shows the signed frames it received for a micro-batch (``Audit``), or
re-executes a replica's micro-batch from such frames and says whether the replica's
signed work matches (``Recheck``), or, as an arbiter, re-executes a micro-batch of
another stage rebuilt from the weights shown."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peer.compute import Compute
from peer.executor import StageExecutor
from peer.stage import HeldStage, StageBuilder
from protocol.model.job import SpecError
from protocol.model.program import ProgramError
from protocol.model.recipe import LossScale
from protocol.net.tasks import honour_cancel
from protocol.net.transport import Inbound, Transport
from protocol.trust.identity import IdentityError, public_key
from protocol.trust.spotcheck import differs, fingerprint, loss_differs, seed_of, wrong_frame
from protocol.wire.codecs import Codec
from protocol.wire.encoding import Frame, Link, encode_values
from protocol.wire.envelope import payload_digest
from protocol.wire.gate import signed_frame
from protocol.wire.messages import Audit, Evidence, Recheck, Verdict

logger = logging.getLogger(__name__)

#: what an arbiter keeps of the stages it built before the last (their weights and buffers)
KEEP_BYTES = 256 << 20


def as_evidence(inbound: Inbound) -> list[torch.Tensor]:
    """A received frame as evidence: its signed head and its payload, as uint8 tensors."""
    return [_bytes(inbound.head), _bytes(inbound.frame.payload)]


def _bytes(data: bytes | memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def evidence_for(
    msg: Audit, kept: dict[tuple[str, int], Inbound], state: dict[str, torch.Tensor] | None
) -> tuple[Evidence, list[torch.Tensor]]:
    """The answer to an ``Audit``: the kept frames it names (those this peer has), or
    the stage's weights and buffers (``weights``: ``state``, as they were in the
    audited step; none if this peer did not keep them)."""
    if msg.kinds == ["weights"]:
        if state is None:
            return Evidence(msg.run_id, msg.step, msg.mb, [], msg.epoch), []
        names = sorted(state)
        return Evidence(msg.run_id, msg.step, msg.mb, ["weights"], msg.epoch, names), [state[n] for n in names]
    shown = [key for key in _asked(msg) if key in kept]
    values = [t for key in shown for t in as_evidence(kept[key])]
    kinds, mbs = [k for k, _ in shown], [mb for _, mb in shown] if msg.mbs else []
    return Evidence(msg.run_id, msg.step, msg.mb, kinds, msg.epoch, mbs=mbs), values


def _asked(msg: Audit) -> list[tuple[str, int]]:
    """The (kind, micro-batch) frames an ``Audit`` asks for, each once (none where its
    ``mbs`` do not pair with its ``kinds``)."""
    if not msg.mbs:
        return list(dict.fromkeys((k, msg.mb) for k in msg.kinds))
    return list(dict.fromkeys(zip(msg.kinds, msg.mbs, strict=True))) if len(msg.mbs) == len(msg.kinds) else []


@dataclass
class Rechecker:
    """What a replica needs to re-execute a micro-batch of its stage."""

    ex: StageExecutor
    stage: int
    keys: dict[str, Any]  # peer id -> Ed25519 public key (the plan's peers and the coordinator)
    forward: Codec | None  # the codec of the activations this stage sends on (None: last stage)
    backward: Codec | None  # the codec of the gradients it sends back (None: first stage)
    divisor: int  # micro-batches per step

    def verdict(self, msg: Recheck, evidence: list[torch.Tensor], own_grads: Inbound | None) -> Verdict:
        """Re-execute ``msg``'s micro-batch and compare; ``own_grads`` is the suspect's
        signed ``ReplicaGrads`` of it, which this replica received during the step."""
        found = self._frames(msg, evidence)
        if isinstance(found, str):
            return Verdict(
                msg.run_id, msg.step, msg.mb, msg.suspect, False, f"bad evidence: {found}"[:400], msg.epoch, False
            )
        detail, computed = self._compare(msg, found, own_grads)
        return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, not detail, detail[:400], msg.epoch, True, computed)

    def _frames(self, msg: Recheck, evidence: list[torch.Tensor]) -> dict[str, tuple[Any, list[Any]]] | str:
        if len(evidence) != 2 * len(msg.roles):
            return f"{len(evidence)} evidence tensors for {len(msg.roles)} roles"
        if len(msg.signers) != len(msg.roles):
            return f"{len(msg.signers)} signers for {len(msg.roles)} roles"
        out = {}
        for i, (role, signer) in enumerate(zip(msg.roles, msg.signers, strict=True)):
            found = signed_frame(msg.run_id, signer, self.keys.get(signer), evidence[2 * i : 2 * i + 2])
            if found is None:
                return f"the {role} frame is not signed by {signer}"
            problem = wrong_frame(role, found[0], msg.run_id, msg.step, msg.mb, self.stage, msg.epoch)
            if problem:
                return problem
            out[role] = found
        return out

    def _compare(
        self, msg: Recheck, found: dict[str, tuple[Any, list[Any]]], own_grads: Inbound | None
    ) -> tuple[str, list[float]]:
        """What differs ('' if nothing) and, if something does, the fingerprint of what
        this re-execution computed (the coordinator compares it with another checker's)."""
        frames = {role: values for role, (_, values) in found.items()}
        # the frames decode on the CPU; the stage runs where its weights are (a GPU), and
        # what it computed is compared with the frames on the CPU
        inputs, grad_out = _on(frames["input"], self.ex.device), _on(frames.get("grad_out"), self.ex.device)
        out, grads_in, params = _on(self.ex.replay(inputs, grad_out, self.divisor, msg.backward), _CPU)
        computed: list[Any] = [out]
        if self.forward is None:
            problem = loss_differs(float(out), msg.loss, msg.tolerance)
        else:
            computed = _through(list(out), self.forward)
            problem = differs(computed, frames["output"], msg.tolerance)
            problem = problem and f"its activations: {problem}"
        if msg.backward:
            later = self._backward_differs(msg, found, (grads_in, params), own_grads, computed)
            problem = problem or later
        return problem, fingerprint(computed, seed_of(msg.step, msg.mb)) if problem else []

    def _backward_differs(
        self,
        msg: Recheck,
        found: dict[str, tuple[Any, list[Any]]],
        grads: tuple[list[Any], dict[str, torch.Tensor]],
        own_grads: Inbound | None,
        computed: list[Any],
    ) -> str:
        """What of the backward differs ('' if nothing); what it computed is added to
        ``computed`` (its fingerprint covers the whole re-execution)."""
        grads_in, params = grads
        problem = ""
        if "grad_in" in found and self.backward is not None and self.backward.lossless:
            sent_back = _through(grads_in, self.backward)
            computed += sent_back
            problem = differs(sent_back, found["grad_in"][1], msg.tolerance)
            problem = problem and f"its input gradients: {problem}"
        if msg.grads:
            computed += [params[n] for n in sorted(params)]
            if not problem:
                shown = found.get("param_grads")
                theirs = (list(shown[0].names), shown[1]) if shown else _named(own_grads)
                problem = _param_grads_differ(params, theirs, msg.tolerance)
        return problem


def _through(values: list[Any], codec: Codec) -> list[Any]:
    """``values`` as a receiver decodes them after ``codec`` (activations carry no
    error feedback, so a deterministic codec encodes them the same on every peer;
    the lossless one carries them unchanged, so they are not encoded at all)."""
    if codec.lossless:
        return [_on(v, _CPU) for v in values]
    descs, chunks = encode_values(values, Link(codec))
    return Frame({"values": descs}, memoryview(bytearray(b"".join(bytes(c) for c in chunks)))).values()


_CPU = torch.device("cpu")


def _on(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, nested in tuples, lists and dicts) detached, on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if type(value) in (tuple, list):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _named(own: Inbound | None) -> tuple[list[str], list[Any]] | None:
    return None if own is None else (list(own.message.names), own.values())  # type: ignore[attr-defined]


def _param_grads_differ(ours: dict[str, torch.Tensor], theirs: tuple[list[str], list[Any]] | None, rtol: float) -> str:
    if theirs is None:
        return "its parameter gradients of this micro-batch never arrived"
    names, values = theirs
    if sorted(names) != sorted(ours):
        return "its parameter gradients name other parameters"
    problem = differs([ours[n] for n in names], values, rtol)
    return problem and f"its parameter gradients: {problem}"


@dataclass
class AuditHold:
    """A committed step's evidence, held for its spot checks while the next step
    trains: the frames received, and (if the coordinator asked) the stage as it was
    before the step's update, copied between two of the stage's operations."""

    step: int
    kept: dict[tuple[str, int], Inbound]
    state: asyncio.Future[dict[str, torch.Tensor] | None]  # weights and buffers (StageExecutor.snapshot)
    scale: LossScale  # the step's loss scale


def _cannot(msg: Recheck, detail: str, checked: bool = False) -> Verdict:
    """A verdict that blames no one (``checked`` False: this peer could not check)."""
    return Verdict(msg.run_id, msg.step, msg.mb, msg.suspect, False, detail, msg.epoch, checked)


class Arbiter:
    """Re-executes micro-batches of other stages of the cut (two of a stage's replicas
    disagreed, or its only peer is checked); keeps the last stage it built, and the
    weights it loaded, while it arbitrates the same stage. Stages it built before are
    kept too (``stage``: ``KEEP_BYTES`` of them at most, one per stage of the cut) and
    used again, their weights loaded anew, when the same program comes back: a checker
    drawn at random rebuilt its stage at most checks, and the build was about half of
    what a check cost."""

    def __init__(
        self, num_stages: int, build: Callable[[int, list[Any]], StageExecutor], keep_bytes: int = KEEP_BYTES
    ) -> None:
        self.num_stages = num_stages
        self.build = build  # stage, its program (if any) -> the stage (ProgramError, SpecError)
        self.keep_bytes = keep_bytes
        self.others: dict[int, StageExecutor] = {}
        self.loaded: tuple[int, int] | None = None  # (stage, step) of the weights last loaded
        self.built: OrderedDict[tuple[int, str], tuple[StageExecutor, int]] = OrderedDict()  # -> (it, its bytes)

    def verdict(
        self,
        scale: LossScale,
        msg: Recheck,
        values: list[Any],
        rechecker: Callable[[StageExecutor, int, dict[str, str]], Rechecker],
    ) -> Verdict:
        """Re-execute ``msg``'s micro-batch of its stage with the weights shown (or,
        ``same_weights``, those loaded for its last arbitration)."""
        n = 2 * len(msg.roles)
        evidence, weights, program = values[:n], values[n : len(values) - msg.program], _program(msg, values)
        if not 0 <= msg.stage < self.num_stages or len(weights) != len(msg.weights) or msg.program < 0:
            return _cannot(msg, "a malformed arbitration", checked=True)
        if msg.same_weights and (self.loaded != (msg.stage, msg.step) or msg.stage not in self.others):
            return _cannot(msg, f"it holds no weights of stage {msg.stage} at step {msg.step} to arbitrate with")
        try:
            other = self.others.get(msg.stage) or self.stage(msg.stage, program)
        except (ProgramError, SpecError) as exc:  # it could not check: the coordinator drops it, blames no one
            return _cannot(msg, f"could not build the stage: {exc}"[:400])
        self.others, self.loaded = {msg.stage: other}, None  # kept while it arbitrates the same stage
        if not msg.same_weights:
            try:
                other.load_weights(dict(zip(msg.weights, weights, strict=True)))
            except ValueError as exc:
                return _cannot(msg, f"the weights: {exc}", checked=True)
        self.loaded = (msg.stage, msg.step)
        other.loss_scale = scale
        return rechecker(other, msg.stage, msg.keys).verdict(msg, evidence, None)

    def builds(self, msg: Recheck, values: list[Any]) -> bool:
        """Whether arbitrating ``msg`` (with ``values``) may build its stage: neither the
        stage loaded last nor one kept from the same program (the program it carries)."""
        if msg.stage in self.others:
            return False
        program = _program(msg, values)
        return not program or (msg.stage, _digest(program)) not in self.built

    def stage(self, s: int, program: list[Any]) -> StageExecutor:
        """Stage ``s`` as ``program`` builds it: one built before from the same program, or
        a new one (kept, the oldest let go past ``keep_bytes`` or one per stage of the
        cut; the newest always)."""
        key = (s, _digest(program))
        if key in self.built:
            self.built.move_to_end(key)
            return self.built[key][0]
        ex = self.build(s, program)
        self.built[key] = (ex, _held_bytes(ex.module))
        while len(self.built) > 1 and (
            len(self.built) > self.num_stages or sum(size for _, size in self.built.values()) > self.keep_bytes
        ):
            self.built.popitem(last=False)
        return ex


def _program(msg: Recheck, values: list[Any]) -> list[Any]:
    """The stage program an arbitration carries: its last ``msg.program`` values (none
    where it names none, or more than it carries)."""
    return values[len(values) - msg.program :] if 0 < msg.program <= len(values) else []


def _held_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers (persistent or not), each storage once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*module.parameters(), *module.buffers())
    }
    return sum(storages.values())


def _digest(program: list[Any]) -> str:
    """A digest of a program's tensors as the wire encodes them: their descriptions
    (dtype, shape, length) and then their bytes, so that no two programs share one."""
    descriptions, chunks = encode_values(list(program))
    return payload_digest([memoryview(json.dumps(descriptions).encode()), *chunks])


class SpotChecks:
    """One epoch's answers to the coordinator's spot checks: the frames each step
    received (``keep``), a committed step's evidence held while the next trains
    (``hold``), and the answers, computed between the stage's own operations (on the
    event loop or the compute thread, as they are) with their seconds counted apart
    from the step's (``spent``)."""

    def __init__(self, transport: Transport, coordinator: str, compute: Compute, builder: StageBuilder) -> None:
        self.transport = transport
        self.coordinator = coordinator  # its peer id: who asks, and who is answered
        self.compute = compute
        self.a = builder.a
        self.micro_batches = builder.job.micro_batches
        self.arbiter = Arbiter(builder.num_stages, builder.other)
        self.codecs: list[Codec] = []  # the link plan's, per boundary (once it came)
        self.kept: dict[tuple[str, int], Inbound] = {}  # this step's received frames
        self.held: AuditHold | None = None  # the last committed step's
        self.seconds = 0.0  # compute spent on spot checks since ``spent`` was last asked

    def keep(self, kind: str, mb: int, inbound: Inbound) -> Inbound:
        """Keep a frame this step received as evidence; returns it."""
        self.kept[kind, mb] = inbound
        return inbound

    def spent(self) -> float:
        """The compute seconds spent on spot checks since the last ask (reported in StepDone)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    async def hold(self, step: int, ex: StageExecutor, wanted: bool) -> None:
        """``step`` is committed: hold its frames, and (``wanted``: the coordinator will
        check it) a copy of the stage before the update, made before this returns."""
        if wanted:
            snapshot = asyncio.ensure_future(self._timed(ex.snapshot))
        else:
            snapshot = asyncio.get_running_loop().create_future()
            snapshot.set_result(None)
        self.held, self.kept = AuditHold(step, self.kept, snapshot, ex.loss_scale), {}
        await snapshot

    async def serve(self, held: HeldStage, inbox: asyncio.Queue[Inbound]) -> None:
        """Answer the coordinator's spot checks as they come: of the step done and not
        yet committed, or of the last committed one (while the next step trains)."""
        while True:
            inbound = await inbox.get()
            try:
                await self.answer(held, inbound)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the coordinator's wait for the answer decides what it means
                honour_cancel()
                logger.warning("could not answer a spot check of step %s: %s", inbound.message.step, exc)

    async def answer(self, held: HeldStage, inbound: Inbound) -> None:
        msg = inbound.message
        found = await self._audited(held, msg.step)
        if found is None:
            return
        kept, state, scale = found
        s = self.a.stage
        if isinstance(msg, Audit):
            reply, values = evidence_for(msg, kept, state)
        elif msg.stage not in (-1, s):  # an arbiter: it rebuilds the other stage from the weights shown
            # measured apart per stage and with or without weights to load; one that may
            # build the stage always on the thread
            kind = f"verdict:{msg.stage}:{'same' if msg.same_weights else 'load'}"
            shown = inbound.values()
            builds = self.arbiter.builds(msg, shown)
            reply = await self._timed(
                self.arbiter.verdict, scale, msg, shown, self.rechecker, kind=None if builds else kind
            )
            values = None
        elif state is None:
            reply, values = _cannot(msg, f"it kept no weights of step {msg.step}"), None
        else:  # a replica of the suspect's stage
            group = self.a.stages[s]
            mine = msg.suspect in group and msg.mb % len(group) == group.index(msg.suspect)
            own = kept.get(("rgrad", msg.mb)) if mine else None
            reply, values = await self._timed(self._recheck, held.ex, (state, scale), msg, inbound.values(), own), None
        await self.transport.send(self.coordinator, reply, values)

    async def _audited(
        self, held: HeldStage, step: int
    ) -> tuple[dict[tuple[str, int], Inbound], dict[str, torch.Tensor] | None, LossScale] | None:
        """The frames, the stage's weights and buffers (None: not kept) and the loss
        scale of ``step`` as its spot checks see them."""
        hold = self.held
        if hold is not None and hold.step == step:
            return hold.kept, await hold.state, hold.scale
        if held.pending == step:  # not updated yet: a copy made before the update (queued before it, or made at once)
            kept, scale = self.kept, held.ex.loss_scale
            return kept, await self._timed(held.ex.snapshot), scale
        return None

    async def _timed(self, fn: Any, *args: Any, kind: str | None = "") -> Any:
        """``fn`` for a spot check, its seconds counted apart (not the step's busy time:
        the next step may be training). As the stage's own short pieces run: on the
        event loop where the last call of its ``kind`` (by default ``fn``'s name) took
        under ``peer.compute.INLINE_MAX_S`` and the compute thread is idle, else (or
        ``kind`` None: a stage to build) on the thread. Always on the thread, a check
        held it while the stage's next pieces queued behind it, and the peer's two
        threads competed for the GIL: the demo's peers spent 10-17 ms more CPU a step
        with checks on than off, for 5-7 ms of checks."""
        inline = None if kind is None else f"check:{kind or fn.__name__}"
        out, seconds = await self.compute.timed(fn, *args, inline=inline)
        self.seconds += seconds
        return out

    def _recheck(
        self,
        ex: StageExecutor,
        at: tuple[dict[str, torch.Tensor], LossScale],
        msg: Recheck,
        values: list[Any],
        own: Inbound | None,
    ) -> Verdict:
        """Re-execute a replica's micro-batch with the stage as it was in the audited
        step (between two of this step's operations)."""
        missing = ex.not_covered(at[0])
        if missing:  # a stage cut otherwise since: its kept weights are not this stage's
            return _cannot(msg, f"its weights of step {msg.step} lack {missing[0]}")
        with ex.holding(*at):
            return self.rechecker(ex, self.a.stage).verdict(msg, values, own)

    def rechecker(self, ex: StageExecutor, s: int, signers: dict[str, str] | None = None) -> Rechecker:
        """A re-executor of stage ``s`` (held in ``ex``) with this epoch's codecs and keys:
        its gate's (the coordinator and its neighbourhood), its own (an arbiter may have
        signed the input itself), and for an arbiter of another stage the keys of the
        evidence's signers that the coordinator's ``Recheck`` carries (``signers``, hex;
        one that does not parse is left out: its frame then counts as not signed)."""
        forward = self.codecs[s].forward if s < self.arbiter.num_stages - 1 else None
        backward = self.codecs[s - 1].backward if s > 0 else None
        tp = self.transport
        keys: dict[str, Any] = {}
        for peer, hex_key in (signers or {}).items():
            try:
                keys[peer] = public_key(hex_key)
            except IdentityError:
                logger.warning("a spot check names a bad key for %s", peer[:60])
        keys |= {**tp.gate.keys, tp.peer_id: tp.identity.public_key}
        return Rechecker(ex, s, keys, forward, backward, self.micro_batches)
