"""Whom a refused frame is counted against: the sender, the peer that forwarded it,
or (on a direct stream, plain TCP, where anyone on the path could have put bytes)
no one, with the sender's direct streams closed where bytes were altered."""

from __future__ import annotations

from protocol.net.direct import Direct
from protocol.wire.gate import Gate
from protocol.wire.reject import Reject, Rejected

#: rejections after which a stream cannot be trusted to stay in step
FATAL = (Reject.MALFORMED, Reject.TRUNCATED, Reject.OVERSIZED, Reject.BAD_ENVELOPE)
#: rejections raised before a frame's signature proves who sent it: on a forwarded
#: stream they are the forwarder's to answer for, not the named sender's
UNSIGNED = (
    *FATAL,
    Reject.VERSION,
    Reject.WRONG_RUN,
    Reject.SENDER_MISMATCH,
    Reject.NOT_ADMITTED,
    Reject.BAD_SIGNATURE,
    Reject.EXPIRED,
)

#: on a direct stream, signs of bytes altered on the way (not of a stale but honest frame)
TAMPERED = (
    Reject.MALFORMED,
    Reject.OVERSIZED,
    Reject.BAD_ENVELOPE,
    Reject.SENDER_MISMATCH,
    Reject.BAD_SIGNATURE,
    Reject.BAD_DIGEST,
)


def charge(gate: Gate, direct_path: Direct, exc: Rejected, sender: str, via: str | None, direct: bool) -> str:
    """Count ``exc`` against whom it proves at fault, and return them: a fault no
    signature proves (``UNSIGNED``, a digest that does not match) is a forwarded frame's
    forwarder's, and on a direct stream no one's: counted, and where the bytes were
    altered (``TAMPERED``) the sender's direct streams closed and refused a while (on
    libp2p its faults are its own again); the rest are the sender's."""
    unproven = exc.code in UNSIGNED or exc.code is Reject.BAD_DIGEST
    if direct and unproven:  # on the status page too: a member's frames refused over its direct stream
        gate.count_unblamed(sender, exc, "on a direct stream: not held against it")
        if exc.code in TAMPERED:
            direct_path.demote(sender)
        return ""
    blame = via if via is not None and unproven else sender
    gate.reject(blame, exc)
    return blame
