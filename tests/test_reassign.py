"""Issue 33, assignments sized by what changed: a peer that served the last epoch is
told only what changed in its assignment (``coordinator.assignments.reassignments``,
``protocol.wire.messages.Reassign``); applied to what it holds, that is exactly the
whole assignment, and anything else is refused in one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from coordinator.assignments import assignments, header_bytes, reassignments
from protocol.wire.messages import Assign, Message
from protocol.wire.reassign import Reassign
from protocol.wire.schema import MessageError
from tests.conftest import ROOT

RUN = "r"
JOB = {"model": "gpt", "model_args": "n_layer=2,n_embd=64,n_head=4", "steps": 10, "micro_batches": 64}


def _id(i: int) -> str:
    return f"12D3KooW{i:044d}"


def _assigns(stages: list[list[str]], epoch: int, **shared: Any) -> dict[str, Assign]:
    """Every planned peer's assignment; each peer's address, key and certificate follow from its id."""
    peers = [p for g in stages for p in g]
    k = len(stages)
    fields = {"run_id": RUN, "job": JOB, "cut": [6 * (s + 1) for s in range(k - 1)], "epoch": epoch}
    fields |= {"start_step": 100 * epoch, "specs": [[{"shape": [8, 64], "dtype": "float32"}]] * k, **shared}
    maddrs = {p: [f"/ip4/198.51.100.{int(p[-3:]) % 250}/tcp/31337/p2p/{p}"] for p in peers}
    keys = {p: p[-8:] * 8 for p in peers}
    certs = {p: 1.8e9 + int(p[-4:]) for p in peers}
    return assignments(stages, fields, maddrs, keys, certs, {p for p in peers if int(p[-2:]) % 7 == 0})


def _plan(sizes: list[int], swap: dict[str, str] | None = None) -> list[list[str]]:
    ids = iter(_id(i) for i in range(sum(sizes)))
    return [[(swap or {}).get(p, p) for p in (next(ids) for _ in range(n))] for n in sizes]


def _wire(msg: Message) -> Message:
    """``msg`` as a receiver decodes it from its header."""
    return Message.from_header(msg.header())


def test_every_peer_rebuilds_exactly_its_new_assignment() -> None:
    """One peer of stage 3 replaced by a newcomer, a stage boundary moved, the epoch on:
    each peer that served applies what changed to what it held and gets, field for
    field, the whole assignment; the newcomer gets the whole one."""
    sizes = [4, 4, 4, 4, 4, 4, 4]
    held = _assigns(_plan(sizes), epoch=3)
    gone, new = _id(13), _id(999)
    after = _assigns(_plan(sizes, {gone: new}), epoch=4, cut=[6, 12, 18, 25, 30, 36])
    outgoing = {p: _wire(m) for p, m in reassignments(after, held).items()}
    assert isinstance(outgoing[new], Assign) and outgoing[new] == after[new]
    for p, msg in outgoing.items():
        if p != new:
            assert isinstance(msg, Reassign) and msg.apply(held[p]) == after[p], p
    far = outgoing[_id(0)]  # stage 0: its neighbourhood (stages 0-1) is as it was
    assert isinstance(far, Reassign) and set(far.changed) == {"cut", "start_step"} and not far.patched
    near = outgoing[_id(8)]  # stage 2: names stage 3, and so the peer that changed
    assert isinstance(near, Reassign) and set(near.patched) >= {"maddrs", "keys", "certs"}
    assert near.patched["keys"] == {gone: None, new: after[new].keys[new]}
    assert header_bytes(far) < 200 and header_bytes(near) < header_bytes(after[_id(8)]) / 2


def test_a_peer_with_nothing_held_or_an_older_epoch_gets_the_whole() -> None:
    stages = _plan([2, 2])
    held = _assigns(stages, epoch=3)
    after = _assigns(stages, epoch=4)
    other_run = {p: dataclasses.replace(a, run_id="other") for p, a in held.items()}
    assert all(isinstance(m, Assign) for m in reassignments(after, {}).values())
    assert all(isinstance(m, Assign) for m in reassignments(after, other_run).values())
    assert all(isinstance(m, Assign) for m in reassignments(held, after).values()), "held is not older"


def _reassign(**kw: Any) -> dict[str, Any]:
    return {"kind": "reassign", "v": Reassign(RUN, 2, 1, {}).header()["v"], "run_id": RUN, "epoch": 2, "base": 1} | kw


@pytest.mark.parametrize(
    "fields,why",
    [
        ({"changed": {"run_id": "x"}}, "'run_id' is not a field an assignment may change"),
        ({"changed": {"epoch": 9}}, "'epoch' is not a field"),
        ({"changed": {"nonsense": 1}}, "'nonsense' is not a field"),
        ({"changed": {}, "patched": {"stages": {}}}, "'stages' is not a field an assignment may change so"),
        ({"changed": {"keys": {}}, "patched": {"keys": {}}}, "'keys' is not a field"),
        ({"changed": {}, "base": 2}, "epoch 2 from the assignment of epoch 2"),
        ({"changed": []}, "field 'changed' must be an object"),
    ],
)
def test_a_malformed_reassign_is_refused_in_one_line(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(MessageError, match=why):
        Message.from_header(_reassign(**fields))


def test_what_does_not_build_on_the_held_assignment_is_refused() -> None:
    """Another epoch's base, changes that leave the assignment inconsistent (a peer
    named outside the neighbourhood, a replica count without its peers), a value of
    the wrong type: each raises ``MessageError``, and the peer asks for the whole."""
    stages = _plan([2, 2, 2, 2])
    held = _assigns(stages, epoch=1)[_id(0)]
    with pytest.raises(MessageError, match="builds on epoch 0's assignment; this peer holds epoch 1's"):
        Reassign(RUN, 2, 0, {}).apply(held)
    with pytest.raises(MessageError, match="outside stage 0's neighbourhood"):
        Reassign(RUN, 2, 1, {"stages": [*held.stages[:3], [_id(7), _id(6)]]}).apply(held)
    with pytest.raises(MessageError, match="stage 1 names 2 peers; 3 expected"):
        Reassign(RUN, 2, 1, {"sizes": [2, 3, 2, 2]}).apply(held)
    with pytest.raises(MessageError, match="'keys' names .*, who is not in stages"):
        Reassign(RUN, 2, 1, {}, {"keys": {_id(7): "ab" * 32}}).apply(held)
    with pytest.raises(MessageError, match="start_step"):
        Reassign(RUN, 2, 1, {"start_step": "soon"}).apply(held)
    assert Reassign(RUN, 2, 1, {}).apply(held) == dataclasses.replace(held, epoch=2)


def test_a_peer_takes_a_reassign_before_it_holds_an_assignment() -> None:
    """The peer's gate knows the kind whatever was imported first (a fresh interpreter
    that imports ``peer.checks`` alone): a restarted peer must take a ``Reassign`` to
    ask for the whole."""
    code = "import peer.checks as c; print('reassign' in c._BEFORE_ASSIGN, 'resend' in c.kinds_from('peer'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
