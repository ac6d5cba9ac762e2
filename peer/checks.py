"""What a peer expects to receive, from whom, given its assignment: the plan's
half of the envelope checks (the rest is in ``protocol.wire.gate.Gate``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from protocol.wire.codecs import Codec, CodecError
from protocol.wire.envelope import Envelope
from protocol.wire.expect import match_values
from protocol.wire.messages import Assign, LinkPlan, Message, kinds_from
from protocol.wire.reject import Reject, Rejected

#: control messages only the coordinator sends
_FROM_COORDINATOR = kinds_from("coordinator")

#: what the coordinator may send before the dispatcher has taken an assignment in
_BEFORE_ASSIGN = kinds_from("coordinator", early=True)


@dataclass
class PlanChecks:
    """The peer's expectations; ``step`` is the step it is working on."""

    coordinator: str
    assign: Assign | None = None
    codecs: list[Codec] = field(default_factory=list)  # the link plan's, per boundary
    step: int = 0
    my_mbs: frozenset[int] = frozenset()
    eval_mbs: range = range(0)  # this replica's validation micro-batches

    def __call__(self, env: Envelope, message: Message, sender: str) -> None:
        a = self.assign
        if env.kind in _FROM_COORDINATOR and sender == self.coordinator:
            # a stage's state follows its assignment at once: the gate may check it before
            # the dispatcher has taken the assignment in (the two are in order on one stream)
            if a is None and env.kind not in _BEFORE_ASSIGN:
                raise Rejected(Reject.UNEXPECTED, f"{env.kind} before an assignment")
            if isinstance(message, LinkPlan) and a is not None and message.epoch == a.epoch:
                self._take_codecs(message, len(a.stages) - 1)
            return
        if a is None:
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} from {sender} before an assignment")
        s, k = a.stage, len(a.stages)
        if env.epoch != a.epoch:
            code = Reject.STALE_EPOCH if env.epoch < a.epoch else Reject.UNEXPECTED
            raise Rejected(code, f"{env.kind} of epoch {env.epoch}; this peer serves epoch {a.epoch}")
        if env.kind == "act":
            upstream = [self.coordinator] if s == 0 else a.stages[s - 1]
            self._route(env, sender, upstream, (self.step, self.step + 1))
            codec = None if s == 0 else self._codec(s - 1, "forward")
            if a.specs:
                match_values(env.values, a.specs[s], codec)
        elif env.kind == "evalact":
            upstream = [self.coordinator] if s == 0 else a.stages[s - 1]
            self._route(env, sender, upstream, (self.step,), self.eval_mbs)
            codec = None if s == 0 else self._codec(s - 1, "forward")
            if a.specs:
                match_values(env.values, a.specs[s], codec)
        elif env.kind == "grad":
            if s == k - 1:
                raise Rejected(Reject.UNEXPECTED, "gradients sent to the last stage")
            self._route(env, sender, a.stages[s + 1], (self.step,))
            if a.specs:
                match_values(env.values, a.specs[s + 1], self._codec(s, "backward"), gradients=True)
        elif env.kind == "rgrad":
            group = a.stages[s]
            # a faster replica may already be one step ahead
            if (
                sender not in group
                or sender == self.peer_id
                or env.stage != s
                or env.step not in (self.step, self.step + 1)
                or env.mb % len(group) != group.index(sender)
            ):
                raise Rejected(
                    Reject.UNEXPECTED, f"replica gradients for stage {env.stage} step {env.step} micro-batch {env.mb}"
                )
        else:
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} from {sender}")

    def _take_codecs(self, links: LinkPlan, boundaries: int) -> None:
        """The link plan's codecs, as its frame is let in: the upstream stage may send
        this epoch's first activations in them before this peer's epoch has taken the
        plan from its mailbox, and they were refused against an empty list (the step
        then waited out its 300 s). A plan that does not parse is left to the epoch,
        which refuses the run."""
        try:
            codecs = [Codec.from_json(c) for c in links.codecs]
        except CodecError:
            return
        if len(codecs) == boundaries:
            self.codecs = codecs

    @property
    def peer_id(self) -> str:
        assert self.assign is not None
        return self.assign.stages[self.assign.stage][self.assign.replica]

    def _codec(self, boundary: int, direction: str) -> dict[str, Any] | None:
        """The codec the plan puts on a boundary's activations (``forward``) or
        gradients (``backward``)."""
        if boundary >= len(self.codecs):
            return None
        return getattr(self.codecs[boundary], direction).to_json()

    def _route(
        self, env: Envelope, sender: str, senders: list[str], steps: tuple[int, ...], mbs: Collection[int] | None = None
    ) -> None:
        assert self.assign is not None
        if sender not in senders:
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} from {sender}, who does not feed stage {self.assign.stage}")
        if env.stage != self.assign.stage:
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} for stage {env.stage}; this peer serves {self.assign.stage}")
        if env.step not in steps:
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} for step {env.step}; this peer is at step {self.step}")
        if env.mb not in (self.my_mbs if mbs is None else mbs):
            raise Rejected(Reject.UNEXPECTED, f"{env.kind} for micro-batch {env.mb}, not one of this replica's")
