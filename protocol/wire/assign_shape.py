"""What an ``Assign`` (``protocol.wire.messages``) tells a peer, and the checks that
keep it consistent: a peer serving stage ``s`` exchanges frames with the peers of
stages ``s - 1``, ``s`` and ``s + 1`` only (activations from the stage before,
gradients from the stage after, its replicas' gradients), so only that
neighbourhood is named (ids in replica order, addresses, public keys, certificate
ends, which of them dial out); of every other stage the assignment gives how many
replicas serve it (``sizes``: the 1F1B rule compares them), and nothing else. One
assignment is thus bounded by its neighbourhood, whatever the plan's size. Spot
checks go through the coordinator, and an arbiter of another stage gets the keys of
the evidence's signers in its ``Recheck``."""

from __future__ import annotations

from typing import Any

from protocol.wire.schema import MessageError

#: the most replicas an assignment says a stage has (a count, never allocated: a bound
#: on a stranger's numbers all the same)
MAX_REPLICAS = 1 << 20


def neighbourhood(stage: int, num_stages: int) -> range:
    """The stages whose peers a peer of ``stage`` exchanges frames with (its own too)."""
    return range(max(0, stage - 1), min(num_stages, stage + 2))


def check_assign(a: Any) -> None:
    """Raise ``MessageError`` (one line) unless ``a`` is consistent: a replica count
    per stage, the neighbourhood's ids exactly as many as its counts and no other
    stage's, and addresses, keys, certificates and NAT marks only of peers it names.
    Linear in the plan's stages in C (``len``, ``min``, ``sum``), in its neighbourhood in Python."""
    k = len(a.sizes)
    if k == 0 or len(a.stages) != k:
        raise MessageError(f"assign: {len(a.stages)} stages of peers for {k} replica counts")
    if not 1 <= min(a.sizes) <= max(a.sizes) <= MAX_REPLICAS:
        bad = min(a.sizes) if min(a.sizes) < 1 else max(a.sizes)
        raise MessageError(f"assign: a stage of {bad} replicas (1 to {MAX_REPLICAS})")
    if not 0 <= a.stage < k or not 0 <= a.replica < a.sizes[a.stage]:
        raise MessageError(f"assign: replica {a.replica} of stage {a.stage} is not in a plan of {k} stages")
    if len(a.cut) != k - 1:
        raise MessageError(f"assign: a cut of {len(a.cut)} boundaries for {k} stages")
    if a.specs and len(a.specs) != k:
        raise MessageError(f"assign: {len(a.specs)} stage specs for {k} stages")
    near = neighbourhood(a.stage, k)
    for i in near:
        if len(a.stages[i]) != a.sizes[i]:
            raise MessageError(f"assign: stage {i} names {len(a.stages[i])} peers; {a.sizes[i]} expected")
    if sum(map(len, a.stages)) != sum(a.sizes[i] for i in near):
        far = next(i for i, g in enumerate(a.stages) if g and i not in near)
        raise MessageError(f"assign: stage {far} names peers, outside stage {a.stage}'s neighbourhood")
    ids = {p for i in near for p in a.stages[i]}
    if len(ids) != sum(a.sizes[i] for i in near):
        raise MessageError("assign: a peer named twice")
    for field in ("maddrs", "keys", "certs", "nat"):
        stray = next((p for p in getattr(a, field) if p not in ids), None)
        if stray is not None:
            raise MessageError(f"assign: '{field}' names {stray[:60]}, who is not in stages {list(near)}")
