"""One step's spot checks, as the coordinator runs them (``coordinator.auditing``
decides when): gather the signed frames around the checked peer (the *suspect*),
have another peer re-execute the micro-batch (``Recheck``), and, on a mismatch,
settle it with more checkers (see ``coordinator.auditing`` for the whole story).

The answers (``Evidence``, ``Verdict``) come to a box of their own, apart from the
inbox the next step trains through, at most ``AUDIT_BOX_PER_PEER`` waiting per peer."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from coordinator.checkpoint import RunDir
from coordinator.evidence_asks import Wanted, asks, frames_in
from coordinator.host import Host
from coordinator.messaging import Mailbox, get_within
from coordinator.rulings import Shown, convicted, keep_evidence, own, same_weights, undecided
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
#: a micro-batch's evidence: its roles, who signed each, and their frames (head and payload each)
Case = tuple[list[str], dict[str, str], list[torch.Tensor]]
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
            for s, drawn in _together(checks, st.plan.stages):
                st.spot_checks += len(drawn)
                self.host.board.spot_checks = st.spot_checks
                if len(st.plan.stages[s]) > 1:
                    await self._check_one(step, s, *drawn[0])
                else:
                    await self._check_alone(step, s, drawn)
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

    async def _evidence(self, step: int, s: int, drawn: list[tuple[int, bool]]) -> dict[int, Case]:
        """The roles, signers and frames of each drawn micro-batch (and whether its
        backward is checked) around stage ``s``, as their holders show them, all asked at
        once: the checker verifies them, and the coordinator only where the check does
        not pass (``_verify_shown``)."""
        assert self.st.plan is not None
        wanted = {
            mb: (roles_for(s, len(self.st.plan.stages), backward), *self._around(s, mb)) for mb, backward in drawn
        }
        frames = await self._gather(step, s, wanted, verify=False)
        return {mb: (roles, signers, frames[mb]) for mb, (roles, signers, _) in wanted.items()}

    def _verify_shown(self, step: int, s: int, mb: int, roles: list[str], evidence: list[torch.Tensor]) -> None:
        """Check the frames ``_evidence`` gathered (a pair per role, in order) before a
        check that did not pass blames anyone: a holder that showed a frame its signer
        did not send for this micro-batch is excluded (``PeerLost``)."""
        signers, holders = self._around(s, mb)
        for i, role in enumerate(roles):
            if role in holders:  # not param_grads (an arbiter's: checked as gathered)
                self._checked_evidence(holders[role], evidence[2 * i : 2 * i + 2], role, signers[role], (step, mb, s))

    # ------------------------------------------------------------------ checks
    async def _check_alone(self, step: int, s: int, drawn: list[tuple[int, bool]]) -> None:
        """A stage served by one peer: peers of other stages rebuild it with the weights
        the suspect shows and re-execute the drawn micro-batches (their parameter
        gradients, which no one else saw, are not compared); if the first checker
        disagrees on one, more decide. The evidence of all of them is asked at once, and
        the checker gets the first (with the weights) and then the others together."""
        st = self.st
        assert st.plan is not None
        cases = await self._evidence(step, s, drawn)
        suspect = st.plan.stages[s][0]
        if s not in self._shown:  # once for all the micro-batches of this stage checked in this step
            self._shown[s] = await self._weights_of(step, drawn[0][0], suspect)
        shown = self._shown[s]
        if shown is None:
            raise PeerLost({suspect: f"{EXCLUDED}it could not show its weights for a spot check"})
        checkers = self._lone_checkers.get((st.epoch, step, s))
        if checkers is None:  # the first checker of the step's first check asked first for the others too
            checkers = [p for i, group in enumerate(st.plan.stages) if i != s for p in group]
            self.rng.shuffle(checkers)
            self._lone_checkers = {(st.epoch, step, s): checkers}
        async for mb, verdict in self._lone_verdicts(step, s, drawn, cases, checkers[0], shown):
            if not self._judged(step, s, mb, cases[mb], checkers[0], verdict).agree:
                self._disputed(step, s, mb, suspect, checkers[0], (cases[mb][0], cases[mb][2]), verdict)
                ask = functools.partial(self.recheck, step, s, mb, *cases[mb], shown=shown, grads=False)
                more = [(p, functools.partial(ask, p, backward=dict(drawn)[mb])) for p in checkers[1:]]
                raise await self.settle((step, mb), suspect, (checkers[0], verdict), more)

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
        keep_evidence(self.run_dir, step, mb, suspect, *kept)
        text = f"spot check of step {step}, micro-batch {mb} (stage {s}): {checker} says {suspect} is wrong: "
        self.host.board.event("audit", text + verdict.detail)
        self.on_event(text + verdict.detail)

    async def _check_one(self, step: int, s: int, mb: int, backward: bool) -> None:
        st = self.st
        assert st.plan is not None
        roles, signers, evidence = (await self._evidence(step, s, [(mb, backward)]))[mb]
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
                return PeerLost({c: f"{EXCLUDED}{why}{own(v)}" for c, v in against})
            twin = next((c for c, v in against if alike(v.computed, verdict.computed, self._rtol(c, checker))), None)
            against.append((checker, verdict))
            if twin is not None:
                return convicted(suspect, twin, against, self._rtol(twin, checker))
        return undecided(*at, suspect, [c for c, _ in against])

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
        if shown[0] is None or shown[1] is None or not same_weights(shown[0], shown[1]):
            return []
        if backward:
            wanted = {mb: (["param_grads"], {"param_grads": suspect}, {"param_grads": checker})}
            grads = (await self._gather(step, s, wanted))[mb]
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

    async def _gather(self, step: int, s: int, wanted: Wanted, verify: bool = True) -> dict[int, list[torch.Tensor]]:
        """The signed frames of each micro-batch's roles (``wanted``: micro-batch ->
        roles, their signers, their holders), asked at once of the peers that received
        them (each checked to be what its signer sent for that micro-batch, if ``verify``).
        Each answer may come a step timeout after the last that counted, all of them within
        one for each micro-batch."""
        asked = asks(wanted, self._frames_per_answer())
        holders = {holder for holder, _ in asked}
        got: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.asked.update(holders)
        try:  # every holder asked at once, for all its frames: one round trip
            for (holder, first), frames in asked.items():
                kinds, mbs = [ROLES[r][0].KIND for _, r in frames], [mb for mb, _ in frames]
                await self.mailbox.send(holder, Audit(self.cfg.run_id, step, first, kinds, self.st.epoch, mbs))
            pending, deadline = set(asked), self.deadline()
            last = self.clock.now() + len(wanted) * self.cfg.step_timeout_s
            while pending:
                inbound = await self.answer_of((Evidence,), {holder for holder, _ in pending}, deadline)
                key = (inbound.sender, inbound.message.mb)
                if inbound.message.step != step or key not in pending:
                    continue
                pending.discard(key)
                deadline = min(self.deadline(), last)
                frames_shown = frames_in(inbound)
                for mb, role in asked[key]:
                    got[mb, role] = frame = frames_shown.get((ROLES[role][0].KIND, mb), [])
                    if verify or not frame:
                        signer = wanted[mb][1][role]
                        self._checked_evidence(key[0], frame, role, signer, (step, mb, s))
        finally:
            self.asked.difference_update(holders)
        return {mb: [t for role in roles for t in got[mb, role]] for mb, (roles, _, _) in wanted.items()}

    def _frames_per_answer(self) -> int:
        """How many frames across the plan's boundaries one ``Evidence`` holds within the
        payload cap of a peer's answer (``Stages.max_payload_bytes``)."""
        assert self.st.plan is not None
        return max(1, self.stages.max_payload_bytes // self.stages.frame_bytes(self.st.plan.cut))

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
        case = (roles, signers, evidence)
        await self._send_recheck(step, s, mb, case, checker, shown, grads, backward)
        async with contextlib.aclosing(self._verdicts(step, s, [mb], checker)) as verdicts:
            _, verdict = await anext(verdicts)
        return self._judged(step, s, mb, case, checker, verdict)

    async def _lone_verdicts(
        self, step: int, s: int, drawn: list[tuple[int, bool]], cases: dict[int, Case], checker: str, shown: Shown
    ) -> AsyncIterator[tuple[int, Verdict]]:
        """``checker``'s verdicts on the drawn micro-batches of a stage of one peer, in
        their order, each as it and those before it came (a dispute is settled before a
        later one is waited for, as one after another): the first asked alone (its
        ``Recheck`` carries the weights the others use), the others together after it."""
        for part in (drawn[:1], drawn[1:]):
            for mb, backward in part:
                await self._send_recheck(step, s, mb, cases[mb], checker, shown, False, backward)
            async for mb, verdict in self._verdicts(step, s, [mb for mb, _ in part], checker):
                yield mb, verdict

    async def _send_recheck(
        self,
        step: int,
        s: int,
        mb: int,
        case: Case,
        checker: str,
        shown: Shown | None,
        grads: bool,
        backward: bool,
    ) -> None:
        st, cfg, (roles, signers, evidence) = self.st, self.cfg, case
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

    async def _verdicts(self, step: int, s: int, mbs: list[int], checker: str) -> AsyncIterator[tuple[int, Verdict]]:
        """``checker``'s verdicts on micro-batches ``mbs`` of stage ``s``, in that order,
        each as soon as it and those before it came (each to be ``_judged``); each answer
        has a step timeout from the one before."""
        got: dict[int, Verdict] = {}
        suspects, deadline = {mb: self._route(s, mb)["suspect"] for mb in mbs}, self.deadline()
        for mb in mbs:
            while mb not in got:
                verdict: Verdict = (await self.answer_of((Verdict,), {checker}, deadline)).message
                if verdict.step == step and suspects.get(verdict.mb) == verdict.suspect and verdict.mb not in got:
                    got[verdict.mb], deadline = verdict, self.deadline()
            yield mb, got[mb]

    def _judged(self, step: int, s: int, mb: int, case: Case, checker: str, verdict: Verdict) -> Verdict:
        """``verdict``, where the checker could use the evidence; else ``PeerLost``: the
        checker, where the evidence holds up (its holder, where it does not)."""
        if not verdict.checked:
            self._verify_shown(step, s, mb, case[0], case[2])
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


def _together(checks: list[Check], stages: list[list[str]]) -> list[tuple[int, list[tuple[int, bool]]]]:
    """A step's checks as they run: each of a replicated stage alone, those of a stage
    of one peer together (its checker loads the weights once for them), fewer than
    ``AUDIT_BOX_PER_PEER`` at a time (each holder and the checker then has fewer answers
    waiting than the box keeps: room for a late one): (stage, [(micro-batch, backward too)])."""
    out: list[tuple[int, list[tuple[int, bool]]]] = []
    for s, mb, backward in checks:
        last = out[-1] if out else None
        if last is not None and last[0] == s and len(stages[s]) == 1 and len(last[1]) < AUDIT_BOX_PER_PEER - 1:
            last[1].append((mb, backward))
        else:
            out.append((s, [(mb, backward)]))
    return out
