"""How the coordinator asks holders for a spot check's evidence (``coordinator.spotchecks``
gathers it): one ``Audit`` per holder for all its frames of a draw, as few as fit under
the payload cap a peer's answer may take, and each answer read back by micro-batch."""

from __future__ import annotations

from typing import Any

import torch

#: micro-batch -> its roles, who signed each role's frame, who holds it
Wanted = dict[int, tuple[list[str], dict[str, str], dict[str, str]]]
#: one Audit's frames: (micro-batch, role), a micro-batch's never split between two
Ask = list[tuple[int, str]]


def asks(wanted: Wanted, per_answer: int) -> dict[tuple[str, int], Ask]:
    """Each holder's frames of ``wanted`` in Audits of at most ``per_answer`` frames
    (at least one micro-batch's each, as one answer held before them), keyed by
    (holder, the first micro-batch asked): what its answer names as its ``mb``."""
    held: dict[str, dict[int, list[str]]] = {}
    for mb, (roles, _, holders) in wanted.items():
        for role in roles:
            held.setdefault(holders[role], {}).setdefault(mb, []).append(role)
    out: dict[tuple[str, int], Ask] = {}
    for holder, by_mb in held.items():
        chunk: Ask = []
        for mb, roles in by_mb.items():
            if chunk and len(chunk) + len(roles) > per_answer:
                out[holder, chunk[0][0]], chunk = chunk, []
            chunk += [(mb, role) for role in roles]
        out[holder, chunk[0][0]] = chunk
    return out


def frames_in(inbound: Any) -> dict[tuple[str, int], list[torch.Tensor]]:
    """The (head, payload) of each frame in an ``Evidence`` answer, by (kind, micro-batch)
    (none where its lists do not pair up with its values)."""
    msg, values = inbound.message, inbound.values()
    mbs = msg.mbs or [msg.mb] * len(msg.kinds)
    if len(mbs) != len(msg.kinds) or len(values) != 2 * len(msg.kinds):
        return {}
    return {(k, mb): values[2 * i : 2 * i + 2] for i, (k, mb) in enumerate(zip(msg.kinds, mbs, strict=True))}
