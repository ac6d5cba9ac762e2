"""Hellos from senders nobody admitted are limited per sender and in all (issue 35): one
over its sender's bucket is dropped before its signature is checked, the table of
senders stays bounded whatever the number of identities, and the drops are logged once
per sender per period."""

from __future__ import annotations

import logging

import pytest

import protocol.wire.gate as gate_module
from protocol.trust.identity import Identity
from protocol.wire.envelope import Sealer
from protocol.wire.gate import HELLO_DROPPED, Gate
from protocol.wire.hello_limits import LOG_EVERY_S, HelloLimits
from protocol.wire.messages import Hello
from protocol.wire.reject import Reject, Rejected

RUN = "run-1"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_sender_gets_its_burst_then_its_rate() -> None:
    clock = Clock()
    limits = HelloLimits(rate=0.5, burst=4, total_rate=1000, total_burst=1000, clock=clock)
    assert [limits.allow("a") for _ in range(6)] == [True] * 4 + [False] * 2
    assert limits.allow("b"), "another sender has its own bucket"
    clock.t += 1.9
    assert not limits.allow("a")
    clock.t += 0.1
    assert limits.allow("a") and not limits.allow("a"), "one more each 2 s"
    clock.t += 100
    assert sum(limits.allow("a") for _ in range(10)) == 4, "the burst, no more, after a long quiet"
    assert limits.dropped == 2 + 1 + 1 + 6


def test_all_senders_together_share_one_bucket() -> None:
    clock = Clock()
    limits = HelloLimits(rate=1, burst=2, total_rate=10, total_burst=20, clock=clock)
    allowed = sum(limits.allow(f"id-{i}") for i in range(1000))
    assert allowed == 20, "fresh identities buy no more than the shared burst"
    clock.t += 1.0
    assert sum(limits.allow(f"new-{i}") for i in range(1000)) == 10


def test_the_table_of_senders_stays_bounded() -> None:
    clock = Clock()
    limits = HelloLimits(rate=1, burst=2, total_rate=1e9, total_burst=1e9, max_senders=100, clock=clock)
    for i in range(100):
        assert limits.allow(f"id-{i}")
    assert not limits.allow("newcomer"), "the table is full and nobody's bucket has refilled"
    assert all(not limits.allow(f"more-{i}") for i in range(10_000)) and len(limits.buckets) == 100
    clock.t += 2.0  # their buckets refill: idle senders make room
    assert limits.allow("newcomer") and len(limits.buckets) <= 100
    assert len(limits._drops) <= 100


def test_drops_are_logged_once_per_sender_per_period(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limits = HelloLimits(rate=1, burst=1, total_rate=1e9, total_burst=1e9, clock=clock)
    with caplog.at_level(logging.WARNING, logger="protocol.wire.hello_limits"):
        for _ in range(1000):
            limits.allow("flooder")
        clock.t += LOG_EVERY_S
        limits.allow("flooder")
        limits.allow("flooder")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "flooder" in lines[0]
    assert "998 more since the last line" in lines[1], lines


def _hello(identity: Identity, sender: str, proof: str = "") -> bytes:
    head, _ = Sealer(identity, sender).seal(Hello(RUN, identity.public_hex, proof=proof), [], [])
    return head


def test_a_hello_over_its_senders_limit_is_dropped_before_its_signature_is_checked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    gate = Gate(RUN, clock=clock)
    gate.accept_hello = True
    gate.admission = lambda sender, hello: "a private swarm: no proof"
    gate.hellos = HelloLimits(rate=0.5, burst=3, clock=clock)
    checked: list[int] = []
    real_verify = gate_module.verify

    def counting(*args: object) -> bool:
        checked.append(1)
        return real_verify(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gate_module, "verify", counting)
    outsider = Identity.generate()
    frames = [_hello(outsider, "outsider") for _ in range(50)]
    codes, details = [], []
    with caplog.at_level(logging.WARNING):
        for frame in frames:
            try:
                gate.check_head(frame, "outsider")
            except Rejected as exc:
                gate.reject("outsider", exc)
                codes.append(exc.code)
                details.append(exc.detail)
    assert codes == [Reject.NOT_ADMITTED] * 50
    assert len(checked) == 3, "only the burst's signatures are checked"
    assert details.count(HELLO_DROPPED) == 47 and gate.hellos.dropped == 47
    gate_lines = [r for r in caplog.records if r.name == "protocol.wire.gate" and "rejected" in r.getMessage()]
    limit_lines = [r for r in caplog.records if r.name == "protocol.wire.hello_limits"]
    assert len(gate_lines) == 3 and len(limit_lines) == 1, "the drops: one line, not one each"
    clock.t += 2.0
    honest = Identity.generate()
    gate.admission = None
    gate.check_head(_hello(honest, "honest"), "honest")
    assert "honest" in gate.keys and len(checked) == 4, "an honest newcomer is checked and admitted"


def test_a_flood_of_unproven_hellos_leaves_the_members_bucket_alone() -> None:
    """A private swarm: hellos without the proof of its secret, from fresh identities as
    fast as they come, use up only the unproven bucket; a member's hello still gets in."""
    clock = Clock()
    gate = Gate(RUN, clock=clock)
    gate.accept_hello = True
    gate.proven = lambda sender, hello: hello.get("proof") == "member"
    gate.admission = lambda sender, hello: "" if hello.get("proof") == "member" else "a private swarm: no proof"
    refused, outsider = 0, Identity.generate()
    for i in range(1000):  # each a new peer id: no sender's own bucket ever runs out
        try:
            gate.check_head(_hello(outsider, f"outsider-{i}"), f"outsider-{i}")
        except Rejected as exc:
            refused += exc.code is Reject.NOT_ADMITTED
    assert refused == 1000 and gate.hellos.dropped >= 1000 - 20, "past the unproven burst, dropped unchecked"
    member = Identity.generate()
    gate.check_head(_hello(member, "member", proof="member"), "member")
    assert "member" in gate.keys, "the members' bucket was never drawn on"
