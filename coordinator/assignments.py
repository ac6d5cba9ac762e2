"""Each planned peer's ``Assign`` for a plan epoch, built in one place: the epoch's
shared fields, and of the plan only the peer's neighbourhood (stages ``s - 1`` to
``s + 1``: ids, addresses, keys, certificate ends, who dials out) and every stage's
replica count (``protocol.wire.assign_shape``). A plan whose assignment would not fit
a frame's header (a neighbourhood of thousands of replicas) is refused here, before
anything is sent. A peer that served the last epoch gets what changed since its last
assignment (``reassignments``). Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from protocol.wire.assign_shape import neighbourhood
from protocol.wire.encoding import MAX_HEADER_BYTES
from protocol.wire.messages import Assign
from protocol.wire.reassign import PATCHABLE, REASSIGNABLE, Reassign
from protocol.wire.schema import fields_of

#: what a frame's envelope adds to a message's fields in its header (run, sender, kind,
#: routing, sequence number, payload digest; measured about 300 bytes), with room to spare
ENVELOPE_BYTES = 1024


class PlanTooLarge(ValueError):
    """A plan whose assignments cannot be sent; ``str()`` says which stage, and why."""


def header_bytes(msg: Assign | Reassign) -> int:
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


def reassignments(new: Mapping[str, Assign], held: Mapping[str, Assign]) -> dict[str, Assign | Reassign]:
    """Each planned peer's message for a new epoch: the fields of its assignment ``new``
    that differ from the one it ``held`` (the last it served), or the whole assignment
    where it held none. Replicas of a stage share their neighbourhood's objects, and so
    does each epoch's, so each pair of values is compared once (a plan of 10,000 peers
    compares about a stage's worth of values a stage, not a neighbourhood a peer)."""
    same: dict[tuple[int, int], bool] = {}

    def equal(a: Any, b: Any) -> bool:
        key = (id(a), id(b))
        if key not in same:
            same[key] = a == b
        return same[key]

    out: dict[str, Assign | Reassign] = {}
    for p, a in new.items():
        old = held.get(p)
        if old is None or old.run_id != a.run_id or old.epoch >= a.epoch:
            out[p] = a
            continue
        mine, theirs = fields_of(a), fields_of(old)
        changed = {k: v for k, v in mine.items() if k in REASSIGNABLE and not equal(v, theirs[k])}
        patched = {k: _patch(theirs[k], changed.pop(k)) for k in PATCHABLE & changed.keys()}
        out[p] = Reassign(a.run_id, a.epoch, old.epoch, changed, patched)
    return out


def _patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``new`` that ``old`` lacks or holds otherwise, and None for each it lost."""
    gone = dict.fromkeys(old.keys() - new.keys())
    return {p: v for p, v in new.items() if old.get(p) != v} | gone
