"""Each planned peer's ``Assign`` for a plan epoch, built in one place: the epoch's
shared fields, and of the plan only the peer's neighbourhood (stages ``s - 1`` to
``s + 1``: ids, addresses, keys, certificate ends, who dials out) and every stage's
replica count (``protocol.wire.assign_shape``). A plan whose assignment would not fit
a frame's header (a neighbourhood of thousands of replicas) is refused here, before
anything is sent. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from protocol.wire.assign_shape import neighbourhood
from protocol.wire.encoding import MAX_HEADER_BYTES
from protocol.wire.messages import Assign

#: what a frame's envelope adds to a message's fields in its header (run, sender, kind,
#: routing, sequence number, payload digest; measured about 300 bytes), with room to spare
ENVELOPE_BYTES = 1024


class PlanTooLarge(ValueError):
    """A plan whose assignments cannot be sent; ``str()`` says which stage, and why."""


def header_bytes(msg: Assign) -> int:
    """The bytes ``msg``'s fields take in a frame's JSON header (without the envelope)."""
    return len(json.dumps(msg.header(), separators=(",", ":")).encode())


def assignments(
    stages: list[list[str]],
    shared: Mapping[str, Any],
    maddrs: Mapping[str, list[str]],
    keys: Mapping[str, str],
    certs: Mapping[str, float],
    nat: Collection[str],
) -> dict[str, Assign]:
    """Every planned peer's assignment, in stage and replica order. ``shared``: the
    fields every peer of the epoch gets alike (``run_id``, ``job``, ``cut``, ...);
    ``maddrs``, ``keys``, ``certs``: what the coordinator knows of each planned peer;
    ``nat``: the planned peers no one can dial. Raises ``PlanTooLarge`` if a stage's
    assignment would be over a frame header's cap (the first of each stage is
    measured: its replicas' differ by their replica number alone)."""
    sizes = [len(group) for group in stages]
    nat = set(nat)
    out: dict[str, Assign] = {}
    for s, group in enumerate(stages):
        near = neighbourhood(s, len(stages))
        view: list[list[str]] = [[]] * len(stages)  # one empty list for every stage outside (never changed)
        view[near.start : near.stop] = [list(stages[i]) for i in near]
        ids = [p for i in near for p in stages[i]]
        mine = {
            "maddrs": {p: maddrs[p] for p in ids if p in maddrs},
            "keys": {p: keys[p] for p in ids if p in keys},
            "certs": {p: certs[p] for p in ids if p in certs},
            "nat": sorted(p for p in ids if p in nat),
        }
        for r, p in enumerate(group):
            out[p] = Assign(stage=s, replica=r, stages=view, sizes=sizes, **mine, **shared)
            if r == 0:
                _check_fits(out[p], len(ids))
    return out


def _check_fits(msg: Assign, named: int) -> None:
    size = header_bytes(msg) + ENVELOPE_BYTES
    if size > MAX_HEADER_BYTES:
        near = neighbourhood(msg.stage, len(msg.sizes))
        raise PlanTooLarge(
            f"the plan cannot be dispatched: stage {msg.stage}'s assignment names the {named} peers of stages "
            f"{near.start}-{near.stop - 1} ({size / 1e6:.2f} MB), over the {MAX_HEADER_BYTES} bytes a frame's "
            "header may hold; plan fewer replicas a stage"
        )
