"""The probe-on-request pair: the coordinator asks the two ends of a link it is about
to plan on to measure it (``ProbeLink``), and the prober answers (``ProbeResult``).
Registered with the other messages when ``protocol.wire`` is imported (its
``__init__`` imports this module); ``messages.py`` is at its size limit.

Who may make a peer send what: only the coordinator sends ``ProbeLink`` (the peer's
gate takes coordinator kinds from the coordinator alone). The prober dials the other
end only at the addresses of that end's own signed advert for this run, carried in
the request (``advert``), never at an address the request names by itself; the bytes
and the time a probe takes are the prober's own caps (``peer.probing``), the request's
``nbytes`` can only lower them. The other end lets the prober's bandwidth probe in for
``ALLOW_S`` (it need not be admitted there), charged to the answerer's probe budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.wire.messages import Message
from protocol.wire.schema import MessageError

#: what a ``ProbeLink`` asks of its receiver: measure the link to ``peer`` (``probe``),
#: or let ``peer`` measure its link to this receiver (``answer``)
PROBE_ROLES = ("probe", "answer")
#: how long the answering end lets the prober's bandwidth probe in
ALLOW_S = 10.0
#: the longest peer id and error text a probe message carries
MAX_ID_CHARS = 128
MAX_ERROR_CHARS = 300


def _check_id(kind: str, name: str, value: str) -> None:
    if not 0 < len(value) <= MAX_ID_CHARS:
        raise MessageError(f"{kind}: '{name}' must be 1 to {MAX_ID_CHARS} characters")


@dataclass(frozen=True)
class ProbeLink(Message, sender="coordinator", early=True):
    """Coordinator -> one end of a link, before it commits to a plan (request ``nonce``):
    ``probe``: measure your upload to ``peer``, found at the addresses of ``advert`` (its
    signed advert record), at most ``nbytes`` (0: your own cap); ``answer``: let ``peer``
    probe you for ``ALLOW_S``."""

    KIND: ClassVar[str] = "probelink"
    run_id: str
    nonce: int
    peer: str
    role: str = "probe"
    advert: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0

    def __post_init__(self) -> None:
        _check_id(self.KIND, "peer", self.peer)
        if self.role not in PROBE_ROLES:
            raise MessageError(f"{self.KIND}: role {self.role!r} is not one of {', '.join(PROBE_ROLES)}")
        if self.nonce < 0 or self.nbytes < 0:
            raise MessageError(f"{self.KIND}: nonce and nbytes must not be negative")
        if self.role == "probe" and not self.advert:
            raise MessageError(f"{self.KIND}: a probe request carries the other end's advert")


@dataclass(frozen=True)
class ProbeResult(Message, sender="peer"):
    """Peer -> coordinator: what the probe of request ``nonce`` to ``peer`` measured
    (``mbit_s``, upload), or why it could not (``error``, ``mbit_s`` 0)."""

    KIND: ClassVar[str] = "proberesult"
    run_id: str
    nonce: int
    peer: str
    mbit_s: float = 0.0
    error: str = ""

    def __post_init__(self) -> None:
        _check_id(self.KIND, "peer", self.peer)
        if self.nonce < 0:
            raise MessageError(f"{self.KIND}: nonce must not be negative")
        if not math.isfinite(self.mbit_s) or self.mbit_s < 0:
            raise MessageError(f"{self.KIND}: mbit_s must be finite and not negative")
        if len(self.error) > MAX_ERROR_CHARS:
            raise MessageError(f"{self.KIND}: error over {MAX_ERROR_CHARS} characters")
        if (self.mbit_s > 0) == bool(self.error):
            raise MessageError(f"{self.KIND}: either a measured rate or an error")

    @property
    def ok(self) -> bool:
        return self.mbit_s > 0
