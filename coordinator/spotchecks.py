"""One step's spot checks, as the coordinator runs them (``coordinator.auditing``
decides when): gather the signed frames around the checked peer (the *suspect*),
have another peer re-execute the micro-batch (``Recheck``), and, on a mismatch,
settle it with more checkers (see ``coordinator.auditing`` for the whole story).

The answers (``Evidence``, ``Verdict``) come to a box of their own, apart from the
inbox the next step trains through, at most ``AUDIT_BOX_PER_PEER`` waiting per peer."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from coordinator.checkpoint import RunDir
from coordinator.host import Host
from coordinator.messaging import Mailbox, get_within
from coordinator.runstate import EXCLUDED, PeerLost, RunState
from coordinator.stages import Stages
from protocol.net.clock import Clock
from protocol.net.transport import Inbound
from protocol.trust.spotcheck import ROLES, alike, roles_for, tolerance, wrong_frame
from protocol.wire.gate import signed_frame
from protocol.wire.messages import Audit, Evidence, Message, Recheck, Verdict

#: a re-execution of a spot check, asked of one checker
Asker = Callable[[], Awaitable[Verdict]]
#: a sampled spot check: (stage, micro-batch, whether the backward is re-executed too)
Check = tuple[int, int, bool]
#: weights a peer showed: (names, tensors)
Shown = tuple[list[str], list[torch.Tensor]]
#: checkers asked after a first one disputes a micro-batch (each costs a re-execution)
MAX_MORE_CHECKERS = 3
#: spot-check answers waiting to be read from one peer (a peer that sends more loses the surplus)
AUDIT_BOX_PER_PEER = 8
#: how long reading the answer box waits before it looks at the deadline and failed peers again
ANSWER_POLL_S = 0.5

logger = logging.getLogger(__name__)


class SpotChecker:
    def __init__(
        self,
        host: Host,
        st: RunState,
        stages: Stages,
        mailbox: Mailbox,
        run_dir: RunDir,
        rng: random.Random,
        clock: Clock,
        on_event: Callable[[str], None],
    ) -> None:
        self.host = host
        self.cfg = host.config
        self.st = st
        self.stages = stages
        self.mailbox = mailbox
        self.run_dir = run_dir
        self.rng = rng
        self.clock = clock
        self.on_event = on_event
        self.asked: set[str] = set()  # peers asked for evidence (their payloads are expected)
        self.box: asyncio.Queue[Inbound] = asyncio.Queue()  # Evidence and Verdict answers
        self.queued: collections.Counter[str] = collections.Counter()  # answers waiting in the box, by sender
        self.losses: dict[str, float] = {}  # the checked step's losses by micro-batch, as the last stage reported
        self._shown: dict[int, Shown | None] = {}  # a lone stage's weights shown for the checked step
        self._lone_checkers: dict[tuple[int, int, int], list[str]] = {}  # (epoch, step, stage) -> its checkers
        self._loaded: dict[str, tuple[int, int, int]] = {}  # arbiter -> (epoch, stage, step) of its last weights

    async def run(self, step: int, checks: list[Check], losses: dict[str, float]) -> None:
        """Re-execute ``checks`` of ``step`` (``PeerLost`` on a mismatch)."""
        st = self.st
        assert st.plan is not None
        self.losses = losses
        self._empty_box()
        try:
            for s, mb, backward in checks:
                st.spot_checks += 1
                self.host.board.spot_checks = st.spot_checks
                await (self._check_one if len(st.plan.stages[s]) > 1 else self._check_alone)(step, s, mb, backward)
        finally:
            self._shown.clear()  # a stage's weights: not kept past its step's checks

    # ------------------------------------------------------------------ the answer box
    def _empty_box(self) -> None:
        """Forget answers no check waits for (late ones, or a peer's unasked)."""
        while not self.box.empty():
            self.box.get_nowait()
        self.queued.clear()

    def take_answer(self, inbound: Inbound) -> None:
        """A spot-check answer from a planned peer, kept for ``answer_of`` (at most
        ``AUDIT_BOX_PER_PEER`` waiting per peer: a peer flooding answers drops its own)."""
        if self.queued[inbound.sender] < AUDIT_BOX_PER_PEER:
            self.queued[inbound.sender] += 1
            self.box.put_nowait(inbound)

    def deadline(self) -> float:
        """When the answers a check waits for are due (a step timeout from now)."""
        return self.clock.now() + self.cfg.step_timeout_s

    async def answer_of(self, kinds: tuple[type[Message], ...], peers: set[str], deadline: float) -> Inbound:
        """The next answer of ``kinds`` of this epoch from one of ``peers``, by
        ``deadline`` (a peer known to have failed meanwhile is lost at once, and so is one
        that stalled: the coordinator's step waits for its checks, reading no inbox, so this
        is where a stall shows; CI saw a SIGSTOPped peer unnoticed for the 120 s deadline)."""
        while True:
            failed = self.mailbox.failed_among(peers) or self.mailbox.stalled_among(peers)
            if failed:
                raise PeerLost(failed)
            left = deadline - self.clock.now()
            if left <= 0:
                raise PeerLost(dict.fromkeys(peers, f"no answer to a spot check for {self.cfg.step_timeout_s:.0f} s"))
            inbound = await get_within(self.box, min(left, ANSWER_POLL_S), self.clock)
            if inbound is None:
                continue
            self.queued[inbound.sender] -= 1
            msg = inbound.message
            if isinstance(msg, kinds) and inbound.sender in peers and msg.epoch == self.st.epoch:
                return inbound

    # ------------------------------------------------------------------ who and what
    def _route(self, s: int, mb: int) -> dict[str, str]:
        """Who took part in micro-batch ``mb`` around stage ``s``: the suspect, and the
        peers it received from and sent to (``coordinator`` for the first stage's input)."""
        assert self.st.plan is not None
        stages = self.st.plan.stages
        at = {"suspect": stages[s][mb % len(stages[s])]}
        at["prev"] = stages[s - 1][mb % len(stages[s - 1])] if s > 0 else self.mailbox.transport.peer_id
        if s < len(stages) - 1:
            at["next"] = stages[s + 1][mb % len(stages[s + 1])]
        return at

    def _around(self, s: int, mb: int) -> tuple[dict[str, str], dict[str, str]]:
        """Who signed, and who holds, each role's frame of micro-batch ``mb`` around stage ``s``."""
        at = self._route(s, mb)
        nxt = at.get("next", "")
        signers = {"input": at["prev"], "grad_out": nxt, "output": at["suspect"], "grad_in": at["suspect"]}
        holders = {"input": at["suspect"], "grad_out": at["suspect"], "output": nxt, "grad_in": at["prev"]}
        return signers, holders

    async def _evidence(
        self, step: int, s: int, mb: int, backward: bool
    ) -> tuple[list[str], dict[str, str], list[torch.Tensor]]:
        """The roles, signers and frames of micro-batch ``mb`` around stage ``s``, as
        their holders show them: the checker verifies them, and the coordinator only
        where the check does not pass (``_verify_shown``)."""
        assert self.st.plan is not None
        roles, (signers, holders) = roles_for(s, len(self.st.plan.stages), backward), self._around(s, mb)
        return roles, signers, await self._gather(step, s, mb, roles, holders, signers, verify=False)

    def _verify_shown(self, step: int, s: int, mb: int, roles: list[str], evidence: list[torch.Tensor]) -> None:
        """Check the frames ``_evidence`` gathered (a pair per role, in order) before a
        check that did not pass blames anyone: a holder that showed a frame its signer
        did not send for this micro-batch is excluded (``PeerLost``)."""
        signers, holders = self._around(s, mb)
        for i, role in enumerate(roles):
            if role in holders:  # not param_grads (an arbiter's: checked as gathered)
                self._checked_evidence(holders[role], evidence[2 * i : 2 * i + 2], role, signers[role], (step, mb, s))

    # ------------------------------------------------------------------ checks
    async def _check_alone(self, step: int, s: int, mb: int, backward: bool) -> None:
        """A stage served by one peer: peers of other stages rebuild it with the weights
        the suspect shows and re-execute the micro-batch (its parameter gradients, which
        no one else saw, are not compared); if the first disagrees, more decide."""
        st = self.st
        assert st.plan is not None
        roles, signers, evidence = await self._evidence(step, s, mb, backward)
        suspect = st.plan.stages[s][0]
        if s not in self._shown:  # once for all the micro-batches of this stage checked in this step
            self._shown[s] = await self._weights_of(step, mb, suspect)
        shown = self._shown[s]
        if shown is None:
            raise PeerLost({suspect: f"{EXCLUDED}it could not show its weights for a spot check"})
        checkers = self._lone_checkers.get((st.epoch, step, s))
        if checkers is None:  # the first checker of the step's first check asked first for the others too
            checkers = [p for i, group in enumerate(st.plan.stages) if i != s for p in group]
            self.rng.shuffle(checkers)
            self._lone_checkers = {(st.epoch, step, s): checkers}
        case = (roles, signers, evidence)
        ask = functools.partial(self.recheck, step, s, mb, *case, shown=shown, grads=False, backward=backward)
        first = await ask(checkers[0])
        if first.agree:
            return
        self._disputed(step, s, mb, suspect, checkers[0], (roles, evidence), first)
        more = [(p, functools.partial(ask, p)) for p in checkers[1:]]
        raise await self.settle((step, mb), suspect, (checkers[0], first), more)

    def _disputed(
        self,
        step: int,
        s: int,
        mb: int,
        suspect: str,
        checker: str,
        kept: tuple[list[str], list[torch.Tensor]],
        verdict: Verdict,
    ) -> None:
        """Keep the evidence of a disagreement (once the coordinator has checked it) and
        say it on the page and the log."""
        self._verify_shown(step, s, mb, *kept)
        self._keep_evidence(step, mb, suspect, *kept)
        text = f"spot check of step {step}, micro-batch {mb} (stage {s}): {checker} says {suspect} is wrong: "
        self.host.board.event("audit", text + verdict.detail)
        self.on_event(text + verdict.detail)

    async def _check_one(self, step: int, s: int, mb: int, backward: bool) -> None:
        st = self.st
        assert st.plan is not None
        roles, signers, evidence = await self._evidence(step, s, mb, backward)
        suspect, group = self._route(s, mb)["suspect"], st.plan.stages[s]
        others = [p for p in group if p != suspect]
        self.rng.shuffle(others)
        ask = functools.partial(self.recheck, step, s, mb, roles, signers, evidence, backward=backward)
        first = await ask(others[0])
        if first.agree:
            return
        self._disputed(step, s, mb, suspect, others[0], (roles, evidence), first)
        more = [(p, functools.partial(ask, p)) for p in others[1:]]
        if not more:
            more = await self._arbiters(step, s, mb, (roles, signers, evidence), others[0], backward)
        raise await self.settle((step, mb), suspect, (others[0], first), more)

    async def settle(
        self, at: tuple[int, int], suspect: str, first: tuple[str, Verdict], more: list[tuple[str, Asker]]
    ) -> PeerLost:
        """The first checker disagreed with the suspect: more checkers re-execute the
        micro-batch until one agrees with the suspect (those who disputed it are
        excluded) or two of the disputers computed the same (the suspect, and any
        disputer who computed something else, are). With neither, all of them leave the
        plan, none excluded."""
        against = [first]
        for checker, ask in more[:MAX_MORE_CHECKERS]:
            verdict = await ask()
            if verdict.agree:
                why = f"it disputed {suspect}'s work that {checker} re-executed the same "
                return PeerLost({c: f"{EXCLUDED}{why}{_own(v)}" for c, v in against})
            twin = next((c for c, v in against if alike(v.computed, verdict.computed, self._rtol(c, checker))), None)
            against.append((checker, verdict))
            if twin is not None:
                return convicted(suspect, twin, against, self._rtol(twin, checker))
        return _undecided(*at, suspect, [c for c, _ in against])

    async def _arbiters(
        self,
        step: int,
        s: int,
        mb: int,
        case: tuple[list[str], dict[str, str], list[torch.Tensor]],
        checker: str,
        backward: bool,
    ) -> list[tuple[str, Asker]]:
        """Two replicas disagree: peers of another stage can re-execute the micro-batch
        on the stage rebuilt with the weights both show (none if they differ, or there
        is no other stage); with the suspect's parameter gradients, if the backward is
        checked."""
        st, (roles, signers, evidence) = self.st, case
        assert st.plan is not None
        suspect = self._route(s, mb)["suspect"]
        arbiters = [p for i, group in enumerate(st.plan.stages) if i != s for p in group]
        if not arbiters:
            return []
        shown = [await self._weights_of(step, mb, p) for p in (suspect, checker)]
        if shown[0] is None or shown[1] is None or not _same(shown[0], shown[1]):
            return []
        if backward:
            grads = await self._gather(step, s, mb, ["param_grads"], {"param_grads": checker}, {"param_grads": suspect})
            roles, signers, evidence = [*roles, "param_grads"], {**signers, "param_grads": suspect}, [*evidence, *grads]
        self.rng.shuffle(arbiters)
        ask = functools.partial(self.recheck, step, s, mb, roles, signers, evidence, shown=shown[0], backward=backward)
        return [(p, functools.partial(ask, p)) for p in arbiters]

    def _rtol(self, a: str, b: str) -> float:
        """The tolerance between re-executions on the devices of peers ``a`` and ``b``."""
        adverts = self.host.adverts
        devices = [adverts[p].device if p in adverts else "" for p in (a, b)]
        return tolerance(*devices, self.stages.job.precision)

    # ------------------------------------------------------------------ asking the peers
    async def _weights_of(self, step: int, mb: int, peer: str) -> Shown | None:
        """The stage weights ``peer`` holds (this step's, not yet updated)."""
        self.asked.add(peer)
        try:
            await self.mailbox.send(peer, Audit(self.cfg.run_id, step, mb, ["weights"], self.st.epoch))
            deadline = self.deadline()
            while True:
                inbound = await self.answer_of((Evidence,), {peer}, deadline)
                if (inbound.message.step, inbound.message.mb) == (step, mb):
                    break
        finally:
            self.asked.discard(peer)
        msg, values = inbound.message, inbound.values()
        if msg.kinds != ["weights"] or len(values) != len(msg.names):
            return None
        return list(msg.names), values

    async def _gather(
        self,
        step: int,
        s: int,
        mb: int,
        roles: list[str],
        holders: dict[str, str],
        signers: dict[str, str],
        verify: bool = True,
    ) -> list[torch.Tensor]:
        """The signed frames of ``roles``, asked of the peers that received them (each
        checked to be what its signer sent for this micro-batch, if ``verify``)."""
        asked: dict[str, list[str]] = {}
        for role in roles:
            asked.setdefault(holders[role], []).append(role)
        got: dict[str, list[torch.Tensor]] = {}
        self.asked.update(asked)
        try:  # every holder asked at once: one round trip
            for holder, held in asked.items():
                kinds = [ROLES[r][0].KIND for r in held]
                await self.mailbox.send(holder, Audit(self.cfg.run_id, step, mb, kinds, self.st.epoch))
            pending, deadline = set(asked), self.deadline()
            while pending:
                inbound = await self.answer_of((Evidence,), pending, deadline)
                if (inbound.message.step, inbound.message.mb) != (step, mb):
                    continue
                pending.discard(inbound.sender)
                for role in asked[inbound.sender]:
                    got[role] = _frame_of(inbound, role)
                    if verify or not got[role]:
                        self._checked_evidence(inbound.sender, got[role], role, signers[role], (step, mb, s))
        finally:
            self.asked.difference_update(asked)
        return [t for role in roles for t in got[role]]

    def _checked_evidence(
        self, holder: str, pair: list[torch.Tensor], role: str, signer: str, where: tuple[int, int, int]
    ) -> None:
        """Whether ``pair``, the frame of ``role`` that ``holder`` showed, is what its
        signer sent for this (step, micro-batch, stage); else ``holder`` is excluded."""
        tp = self.mailbox.transport
        key = tp.identity.public_key if signer == tp.peer_id else self.host.gate.signer_key(signer)
        found = signed_frame(self.cfg.run_id, signer, key, pair) if pair else None
        step, mb, s = where
        problem = (
            "none came" if found is None else wrong_frame(role, found[0], self.cfg.run_id, step, mb, s, self.st.epoch)
        )
        if problem:
            raise PeerLost({holder: f"{EXCLUDED}it could not show the {role} frame of a spot check: {problem}"})

    async def recheck(
        self,
        step: int,
        s: int,
        mb: int,
        roles: list[str],
        signers: dict[str, str],
        evidence: list[torch.Tensor],
        checker: str,
        shown: Shown | None = None,
        grads: bool = True,
        backward: bool = True,
    ) -> Verdict:
        """``checker``'s verdict on the suspect's micro-batch (an arbiter of another
        stage gets that stage's program and the weights ``shown``, by name, after the
        evidence: neither if it holds them from its last arbitration)."""
        st, cfg = self.st, self.cfg
        assert st.plan is not None
        suspect = self._route(s, mb)["suspect"]
        loss = self.losses.get(str(mb)) if s == len(st.plan.stages) - 1 else None
        names, weights, program, same = self._arbiter_parts(checker, step, s, shown)
        msg = Recheck(
            cfg.run_id,
            step,
            mb,
            suspect,
            roles,
            [signers[r] for r in roles],
            epoch=st.epoch,
            loss=loss,
            tolerance=self._rtol(suspect, checker),
            stage=-1 if shown is None else s,
            weights=names,
            program=len(program),
            grads=grads,
            backward=backward,
            same_weights=same,
            keys={} if shown is None else self.host.keys_of({signers[r] for r in roles}),  # beyond its neighbourhood
        )
        await self.mailbox.send(checker, msg, [*evidence, *weights, *program])
        deadline = self.deadline()
        while True:
            verdict: Verdict = (await self.answer_of((Verdict,), {checker}, deadline)).message
            if (verdict.step, verdict.mb, verdict.suspect) != (step, mb, suspect):
                continue
            if not verdict.checked:  # if the evidence is sound, the checker could not use it
                self._verify_shown(step, s, mb, roles, evidence)
                raise PeerLost({checker: f"it could not run a spot check: {verdict.detail[:200]}"})
            return verdict

    def _arbiter_parts(
        self, checker: str, step: int, s: int, shown: Shown | None
    ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor], bool]:
        """What a Recheck carries to rebuild stage ``s`` on ``checker`` (weight names,
        weights, program; whether it uses the weights it loaded last): nothing for a
        replica; for an arbiter, what it does not hold from its last arbitration (it
        keeps one stage built, with the weights it last loaded)."""
        if shown is None:
            return [], [], [], False
        epoch, last = self.st.epoch, self._loaded.get(checker)
        self._loaded[checker] = (epoch, s, step)
        if last == (epoch, s, step):
            return [], [], [], True
        built = last is not None and last[:2] == (epoch, s)
        assert self.st.plan is not None
        program = [] if built or not self.stages.as_programs else self.stages.programs(self.st.plan.cut)[s]
        return shown[0], shown[1], program, False

    def _keep_evidence(self, step: int, mb: int, suspect: str, roles: list[str], evidence: list[torch.Tensor]) -> None:
        """The disputed micro-batch's signed frames, in the run directory."""
        folder = Path(self.run_dir.path) / "evidence"
        try:
            folder.mkdir(exist_ok=True)
            tensors = {
                f"{role}/{part}": t.contiguous()
                for i, role in enumerate(roles)
                for part, t in zip(("head", "payload"), evidence[2 * i : 2 * i + 2], strict=True)
            }
            save_file(tensors, str(folder / f"step{step}-mb{mb}-{suspect[:16]}.safetensors"))
        except OSError as exc:
            logger.warning("could not keep the evidence of a spot check: %s", exc)


def _frame_of(inbound: Any, role: str) -> list[torch.Tensor]:
    """The (head, payload) of ``role``'s frame in an ``Evidence`` answer ([] if it has none)."""
    msg, values = inbound.message, inbound.values()
    kind = ROLES[role][0].KIND
    i = msg.kinds.index(kind) if kind in msg.kinds and len(values) == 2 * len(msg.kinds) else -1
    return values[2 * i : 2 * i + 2] if i >= 0 else []


def _undecided(step: int, mb: int, suspect: str, checkers: list[str]) -> PeerLost:
    """Checkers disagree with the suspect and with each other, and no more can
    re-execute: all of them leave the plan, none excluded."""
    why = f"disputed a spot check of step {step}, micro-batch {mb}, and no two re-executions agreed"
    return PeerLost({p: why for p in [suspect, *checkers]})


def convicted(suspect: str, twin: str, against: list[tuple[str, Verdict]], rtol: float) -> PeerLost:
    """Two checkers (``twin`` and the last) computed the same, and not what the suspect
    showed: the suspect is excluded, and so is any disputer who computed a third result."""
    (last, verdict), said = against[-1], dict(against)
    found = f"{said[twin].detail} (re-executed by {twin}; and by {last}: {verdict.detail})"
    lost = {suspect: f"{EXCLUDED}spot check: {found}"}
    for c, v in against[:-1]:
        if not alike(v.computed, verdict.computed, rtol):
            neither = f"its re-execution of {suspect}'s work matched neither it nor {twin} and {last}"
            lost[c] = f"{EXCLUDED}{neither} {_own(v)}"
    return PeerLost(lost)


def _own(verdict: Verdict) -> str:
    """What a disputing checker's own re-execution gave, for its exclusion's line (a
    checker that fakes a loss is named with it)."""
    return f"(its own verdict: {verdict.detail[:200]})"


def _same(a: Shown, b: Shown) -> bool:
    """Whether two replicas showed the same weights, bit for bit."""
    same = (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    return a[0] == b[0] and all(same)
