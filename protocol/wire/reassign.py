"""A new epoch's assignment as what changed since the last one a peer served
(``Reassign``), and a peer's request for the whole one when it does not hold that
(``Resend``). Issue 33: a re-plan of 10,000 peers sent 847 MB of whole assignments
where one peer had been replaced; told by what changed, 3.4 MB. Their kinds register
with every other (``protocol/wire/__init__.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.wire.messages import Assign, Message
from protocol.wire.schema import MessageError

#: what a ``Reassign`` may change: every field of an assignment but its run and epoch
REASSIGNABLE = frozenset(f.name for f in dataclasses.fields(Assign)) - {"run_id", "epoch"}
#: the fields it may change entry by entry (peer id -> value; None: the entry is gone)
PATCHABLE = frozenset({"maddrs", "keys", "certs"})


@dataclass(frozen=True)
class Reassign(Message, sender="coordinator", early=True):
    """Coordinator -> peer: a new epoch's assignment as what changed since the one of
    epoch ``base``, which the peer served (``changed``: Assign fields and their new
    values; ``patched``: of the per-peer fields ``PATCHABLE``, the entries that changed).
    An unchanged peer's is about a hundred bytes where its whole assignment names its
    neighbourhood. A peer that does not hold ``base`` asks for the whole (``Resend``)."""

    KIND: ClassVar[str] = "reassign"
    run_id: str
    epoch: int
    base: int
    changed: dict[str, Any]
    patched: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stray = next((k for k in self.changed if k not in REASSIGNABLE), None)
        stray = stray or next((k for k in self.patched if k not in PATCHABLE or k in self.changed), None)
        if stray is not None:
            raise MessageError(f"reassign: '{stray[:60]}' is not a field an assignment may change so")
        if self.base >= self.epoch:
            raise MessageError(f"reassign: epoch {self.epoch} from the assignment of epoch {self.base}")

    def apply(self, base: Assign) -> Assign:
        """``base`` with what changed: decoded and checked as a whole assignment is
        (``MessageError`` if ``base`` is not the one this builds on, or the result is not consistent)."""
        if base.run_id != self.run_id or base.epoch != self.base:
            held = f"epoch {base.epoch}'s of run {base.run_id[:60]}"
            raise MessageError(f"reassign: builds on epoch {self.base}'s assignment; this peer holds {held}")
        merged = {**base.header(), **self.changed, "epoch": self.epoch}
        for name, entries in self.patched.items():
            kept = {p: v for p, v in merged[name].items() if p not in entries}
            merged[name] = kept | {p: v for p, v in entries.items() if v is not None}
        out = Message.from_header(merged)
        assert isinstance(out, Assign)
        return out


@dataclass(frozen=True)
class Resend(Message, sender="peer"):
    """Peer -> coordinator: a ``Reassign`` of ``epoch`` came, and this peer does not hold
    the assignment it builds on (it restarted, or was dropped since): send the whole."""

    KIND: ClassVar[str] = "resend"
    run_id: str
    epoch: int
