"""An ``Assign`` names its peer's neighbourhood only (stages ``s - 1`` to ``s + 1``) and
every stage's replica count (``protocol.wire.assign_shape``, built by
``coordinator.assignments``): its size is bounded by the neighbourhood, not the plan
(before, each named every planned peer and from ~2,650 of them was over a frame
header's cap); decoding refuses one that is not consistent; a peer's gate admits the
neighbourhood and the coordinator, no one else; the dispatcher sends them in bounded
parallel, and refuses a plan whose assignment would not fit a frame."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator import discovery_cost as dc
from coordinator.assignments import ENVELOPE_BYTES, PlanTooLarge, assignments, header_bytes
from coordinator.outcome import SwarmError
from peer.checks import PlanChecks
from peer.config import PeerConfig
from peer.epoch import EpochEnv, EpochRunner
from protocol.trust.identity import Identity
from protocol.wire.encoding import MAX_HEADER_BYTES
from protocol.wire.envelope import Sealer
from protocol.wire.gate import Gate
from protocol.wire.messages import PROTOCOL_VERSION, Assign, LinkPlan, Message
from protocol.wire.reject import Reject, Rejected
from protocol.wire.schema import MessageError

RUN = "r"
JOB = {"model": "gpt", "model_args": "n_layer=2,n_embd=64,n_head=4", "steps": 10, "micro_batches": 64}


def _id(i: int) -> str:
    """A libp2p peer id's length (52 characters)."""
    return f"12D3KooW{i:044d}"


def _plan(sizes: list[int]) -> list[list[str]]:
    ids = iter(_id(i) for i in range(sum(sizes)))
    return [[next(ids) for _ in range(n)] for n in sizes]


def _assigns(stages: list[list[str]], keys: dict[str, str] | None = None) -> dict[str, Assign]:
    """Every planned peer's assignment with the fields a live coordinator fills."""
    peers = [p for g in stages for p in g]
    k = len(stages)
    shared = {
        "run_id": RUN,
        "job": JOB,
        "cut": [6 * (s + 1) for s in range(k - 1)],
        "specs": [[{"shape": [8, 1024, 1600], "dtype": "float32"}] for _ in range(k)],
        "link_mbps": [0.0] * (k - 1),
        "epoch": 3,
    }
    maddrs = {p: [f"/ip4/198.51.{i % 250}.{i % 200}/tcp/{30000 + i}/p2p/{p}"] for i, p in enumerate(peers)}
    keys = keys if keys is not None else {p: f"{i:064x}" for i, p in enumerate(peers)}
    certs = {p: 1.8e9 + i for i, p in enumerate(peers)}
    return assignments(stages, shared, maddrs, keys, certs, set(peers[::10]))


def test_a_middle_peer_of_a_ten_thousand_peer_plan_names_its_neighbourhood_only() -> None:
    stages = _plan([10] * 1000)  # 1,000 stages of 10 replicas
    assigns = _assigns(stages)
    a = assigns[stages[500][3]]
    assert (a.stage, a.replica, a.sizes) == (500, 3, [10] * 1000)
    assert [i for i, g in enumerate(a.stages) if g] == [499, 500, 501]
    named = set(stages[499] + stages[500] + stages[501])
    assert set(a.maddrs) == set(a.keys) == set(a.certs) == named and set(a.nat) <= named
    # 30 peers of ~395 bytes (12 kB), and 1,000 stages' counts, boundaries and specs (~57 bytes each)
    assert header_bytes(a) < 80_000 and header_bytes(a) == pytest.approx(dc.largest_assign_bytes([10] * 1000), 0.05)
    # the first and last stages name two stages
    assert [i for i, g in enumerate(assigns[stages[0][0]].stages) if g] == [0, 1]
    assert [i for i, g in enumerate(assigns[stages[-1][0]].stages) if g] == [998, 999]


@pytest.mark.parametrize("planned", [10_000, 100_000])
def test_the_bound_holds_at_ten_and_a_hundred_thousand_planned_peers(planned: int) -> None:
    """A plan as the planner shapes it (a stage has at most its step's micro-batches of
    replicas: 64 here, ``discovery_cost.even_plan``): the largest assignment stays far
    under the cap, and the formula prices what ``coordinator.assignments`` builds (its
    three middle stages, built alone, name what a peer of a whole plan names)."""
    sizes = dc.even_plan(planned)
    assert max(sizes) == 64 and sum(sizes) == planned
    k = len(sizes)
    near = _plan(sizes[k // 2 - 1 : k // 2 + 2])  # the peers a middle stage's assignment names
    stages = [[] for _ in range(k // 2 - 1)] + near + [[] for _ in range(k - k // 2 - 2)]
    a = _one(stages, sizes, stages[k // 2][0])
    assert len(a.keys) == 192 and a.sizes == sizes
    assert header_bytes(a) + ENVELOPE_BYTES < MAX_HEADER_BYTES / 4
    assert header_bytes(a) == pytest.approx(dc.largest_assign_bytes(sizes), rel=0.05)
    assert dc.largest_assign_bytes(sizes) < dc.HEADER_CAP_BYTES / 4


def _one(stages: list[list[str]], sizes: list[int], peer: str) -> Assign:
    """``peer``'s assignment in a plan of ``sizes`` of which ``stages`` holds its
    neighbourhood's ids only (a whole plan of 100,000 is not built)."""
    s = next(i for i, g in enumerate(stages) if peer in g)
    named = [p for g in stages for p in g]
    k = len(sizes)
    return Assign(
        RUN,
        s,
        stages[s].index(peer),
        JOB,
        [6 * (i + 1) for i in range(k - 1)],
        stages,
        sizes,
        {p: [f"/ip4/198.51.{i % 250}.{i % 200}/tcp/{30000 + i}/p2p/{p}"] for i, p in enumerate(named)},
        keys={p: f"{i:064x}" for i, p in enumerate(named)},
        specs=[[{"shape": [8, 1024, 1600], "dtype": "float32"}] for _ in range(k)],
        link_mbps=[0.0] * (k - 1),
        epoch=3,
        certs={p: 1.8e9 + i for i, p in enumerate(named)},
        nat=named[::10],
    )


def test_a_plan_whose_assignment_would_not_fit_a_frame_is_refused_by_name() -> None:
    """Three stages of a thousand replicas: a middle peer would name 3,000 (1.2 MB)."""
    with pytest.raises(PlanTooLarge) as refused:
        _assigns(_plan([1000, 1000, 1000]))
    assert "stage 1's assignment names the 3000 peers of stages 0-2 (1.19 MB)" in str(refused.value)
    assert "plan fewer replicas a stage" in str(refused.value)
    assert dc.largest_assign_bytes([1000] * 3) > dc.HEADER_CAP_BYTES
    assert len(_assigns(_plan([800, 800, 800]))) == 2400  # ~0.95 MB: still sent


def _header(**change: Any) -> dict[str, Any]:
    a = _assigns(_plan([2, 2, 2, 2]))[_id(3)]  # stage 1, replica 1: names stages 0-2
    return {**a.header(), **change}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"sizes": [2, 3, 2, 2]}, "stage 1 names 2 peers; 3 expected"),
        ({"stages": [[_id(0), _id(1)], [_id(2), _id(3)], [_id(4), _id(5)], [_id(6), _id(7)]]}, "stage 3 names peers"),
        ({"sizes": [2, 2, 2]}, "4 stages of peers for 3 replica counts"),
        ({"sizes": [2, 2, 2, 0]}, "a stage of 0 replicas"),
        ({"replica": 2}, "replica 2 of stage 1 is not in a plan of 4 stages"),
        ({"stage": 4}, "replica 1 of stage 4 is not in"),
        ({"cut": [6, 12]}, "a cut of 2 boundaries for 4 stages"),
        ({"keys": {_id(6): "00" * 32}}, "'keys' names " + _id(6)),
        ({"nat": [_id(7)]}, "'nat' names " + _id(7)),
        ({"specs": [[]]}, "1 stage specs for 4 stages"),
        ({"stages": [[_id(0), _id(0)], [_id(2), _id(3)], [_id(4), _id(5)], []]}, "a peer named twice"),
        ({"sizes": "4"}, "field 'sizes' must be a list"),
    ],
)
def test_decoding_refuses_an_inconsistent_assignment_in_one_line(change: dict[str, Any], why: str) -> None:
    with pytest.raises(MessageError) as refused:
        Message.from_header(_header(**change))
    assert why in str(refused.value) and "\n" not in str(refused.value)


def test_an_assignment_without_counts_or_of_version_4_is_refused() -> None:
    header = _header()
    del header["sizes"]
    with pytest.raises(MessageError, match="assign lacks field 'sizes'"):
        Message.from_header(header)
    with pytest.raises(MessageError, match=f"protocol version 4, this peer speaks {PROTOCOL_VERSION}"):
        Message.from_header(_header(v=4))
    assert Message.from_header(_header()) == _assigns(_plan([2, 2, 2, 2]))[_id(3)]


def test_a_peer_gate_refuses_an_inconsistent_assignment_frame_without_a_crash() -> None:
    coordinator = Identity.generate()
    gate = Gate(RUN)
    gate.admit("coord", coordinator.public_key)
    gate.expect = PlanChecks("coord")
    good = _assigns(_plan([2, 2, 2, 2]))[_id(3)]
    bad = dataclasses.replace(good, stages=good.stages)  # rebuilt: consistent
    assert gate.open(Sealer(coordinator, "coord").seal(bad, [], [])[0], "coord").message == good
    object.__setattr__(bad, "sizes", [2, 5, 2, 2])  # as a sender that skips the check would
    with pytest.raises(Rejected) as refused:
        gate.open(Sealer(coordinator, "coord").seal(bad, [], [])[0], "coord")
    assert refused.value.code is Reject.BAD_BODY and "stage 1 names 2 peers; 5 expected" in str(refused.value)


def _runner(a: Assign, me: str) -> tuple[EpochRunner, Any]:
    """An epoch of ``a`` on a peer whose transport is a stand-in (its gate real)."""
    coordinator = Identity.generate()
    tp = SimpleNamespace(
        peer_id=me, gate=Gate(RUN), learned={}, rates={}, identity=Identity.generate(), dials_in=set(), forward_via={}
    )
    tp.learn = lambda p, addrs: tp.learned.__setitem__(p, addrs)
    tp.set_rate = lambda p, mbps: tp.rates.__setitem__(p, mbps)
    env = EpochEnv(
        PeerConfig(initial_peers=[]),
        tp,  # type: ignore[arg-type]
        "coord",
        coordinator.public_key,
        PlanChecks("coord"),
        SimpleNamespace(device="cpu"),  # type: ignore[arg-type]
        asyncio.Queue(),
        (),
    )
    return EpochRunner(SimpleNamespace(), env, a, SimpleNamespace()), tp  # type: ignore[arg-type]


def test_a_peer_admits_exactly_its_neighbourhood_and_the_coordinator() -> None:
    stages = _plan([3] * 6)
    identities = {p: Identity.generate() for g in stages for p in g}
    assigns = _assigns(stages, {p: i.public_hex for p, i in identities.items()})
    me = stages[2][1]
    runner, tp = _runner(assigns[me], me)
    runner._setup()
    neighbours = set(stages[1] + stages[2] + stages[3]) - {me}
    assert set(tp.gate.keys) == neighbours | {"coord"}
    assert set(tp.gate.until) == neighbours and set(tp.learned) == neighbours | {me}
    assert all(tp.gate.keys[p] == identities[p].public_key for p in neighbours)
    first, tp0 = _runner(assigns[stages[0][0]], stages[0][0])
    first._setup()
    assert set(tp0.gate.keys) == set(stages[0] + stages[1]) - {stages[0][0]} | {"coord"}


def test_a_peer_probes_the_replicas_round_its_group() -> None:
    """The gradients' links are measured as the activations' are: guessed from uplinks,
    replicas on two sites 5 Mbit/s apart were priced as 1 Gbit/s. Each replica probes
    the next ones round its group, at most half of it: every pair of up to 9."""
    from peer.probing import SIBLING_PROBES, replicas_probed

    nine = _plan([9])[0]
    assert SIBLING_PROBES == 4 and replicas_probed(nine, 0) == nine[1:5]
    assert replicas_probed(nine, 8) == nine[:4]  # round the group
    pairs = {frozenset((nine[r], p)) for r in range(9) for p in replicas_probed(nine, r)}
    assert len(pairs) == 9 * 8 // 2  # every pair of the nine
    three = _plan([3])[0]
    assert replicas_probed(three, 2) == three[:1]  # half of a group of three: one
    assert replicas_probed(three[:2], 1) == three[:1] and replicas_probed(three[:1], 0) == []


def test_a_replica_that_does_not_answer_its_probe_does_not_hold_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next stage's links are the plan's: a broken one ends the epoch, as before.
    A replica's is priced from a guess without it: one that breaks is left out, and
    the replicas' probes together stop at ``SIBLING_PROBES_S``."""
    from peer import probing
    from protocol.net.transport import PeerUnreachable

    stages = _plan([3, 1])
    assigns = _assigns(stages)
    me = stages[0][0]
    runner, tp = _runner(assigns[me], me)
    broken, stalled, sent = {stages[0][1]}, set(), []

    async def measure(pid: str, nbytes: int, down: bool = True) -> tuple[float, float]:
        if pid in broken:
            raise PeerUnreachable(f"bandwidth probe with peer {pid} broke", pid)
        if pid in stalled:
            await asyncio.sleep(3600)
        return 100.0, 0.0

    async def send(to: str, msg: Message) -> None:
        sent.append(msg)

    tp.measure_bandwidth, tp.send = measure, send
    asyncio.run(runner._ready(None, 0.1))  # type: ignore[arg-type]
    assert sent[-1].next_mbps == {stages[1][0]: 100.0}  # the broken replica left out
    broken, stalled = set(), {stages[0][1]}
    monkeypatch.setattr(probing, "SIBLING_PROBES_S", 0.05)
    asyncio.run(runner._ready(None, 0.1))  # type: ignore[arg-type]
    assert sent[-1].next_mbps == {stages[1][0]: 100.0}  # the stalled one given up on
    broken = {stages[1][0]}
    with pytest.raises(PeerUnreachable):
        asyncio.run(runner._ready(None, 0.1))  # type: ignore[arg-type]


def test_the_dispatcher_sends_each_peer_its_neighbourhood_in_bounded_parallel(tmp_path: Path) -> None:
    from tests.test_coordinator_inbox import _driver, _host

    driver = _driver(tmp_path, [["a", "b"], ["c"], ["d", "e"]])
    driver.st.restore = "keep"  # assignments alone: no program or state follows
    asyncio.run(driver.dispatcher._send_stages())
    sent = {p: m for p, m, _ in _host(driver).transport.sent}
    assert list(sent) == ["a", "b", "c", "d", "e"]  # stage order
    assert all(isinstance(m, Assign) and m.sizes == [2, 1, 2] for m in sent.values())
    assert sent["a"].stages == [["a", "b"], ["c"], []] and sent["c"].stages == [["a", "b"], ["c"], ["d", "e"]]
    assert sent["e"].stages == [[], ["c"], ["d", "e"]] and sent["e"].replica == 1


def test_the_link_plan_is_sealed_once_for_every_planned_peer(tmp_path: Path) -> None:
    from tests.test_commit_fanout import Slow
    from tests.test_coordinator_inbox import _driver, _host

    driver = _driver(tmp_path, [["a", "b"], ["c"], ["d", "e"]])
    transport = Slow()
    _host(driver).transport = transport
    asyncio.run(driver.dispatcher._send_all(dict.fromkeys(driver.st.planned, LinkPlan(RUN, [], 1))))
    assert {p for p, _, _ in transport.sent} == {"a", "b", "c", "d", "e"} and len(transport.sealed) == 1


def test_the_dispatcher_refuses_a_plan_it_cannot_send(tmp_path: Path) -> None:
    from tests.test_coordinator_inbox import _driver, _host

    stages = _plan([7000, 7000, 7000])  # 14,000 peers' ids alone are over a frame's cap
    driver = _driver(tmp_path, stages)
    driver.st.restore = "keep"
    with pytest.raises(SwarmError, match="the plan cannot be dispatched: stage 0's assignment names the 14000 peers"):
        asyncio.run(driver.dispatcher._send_stages())
    assert _host(driver).transport.sent == []


def test_an_arbiter_of_a_far_stage_checks_the_evidence_with_the_keys_its_recheck_carries() -> None:
    """An arbiter's gate holds its neighbourhood's keys only; the frames it re-executes
    are signed by the suspect's neighbours: the ``Recheck`` carries their keys. A key
    that does not parse is left out (the frame counts as not signed), and one of a peer
    its gate holds cannot replace the gate's."""
    from peer.spotcheck import SpotChecks
    from protocol.wire.codecs import Codec
    from tests.test_spotcheck import IDS, _evidence

    msg, evidence, own, checker = _evidence(noise=0.0)
    me = Identity.generate()
    tp = SimpleNamespace(peer_id="far", identity=me, gate=Gate(RUN))
    tp.gate.admit("coord", IDS["coord"].public_key)  # and its own neighbours, none of them a signer
    builder = SimpleNamespace(a=None, job=SimpleNamespace(micro_batches=2), num_stages=2, other=None)
    spot = SpotChecks(tp, "coord", None, builder)  # type: ignore[arg-type]
    spot.codecs = [Codec()]
    alone = spot.rechecker(checker.ex, 0).verdict(msg, evidence, own)
    assert not alone.checked and "not signed by" in alone.detail
    keys = {p: IDS[p].public_hex for p in ("suspect", "next")}
    assert spot.rechecker(checker.ex, 0, keys).verdict(msg, evidence, own).agree
    bad = spot.rechecker(checker.ex, 0, {**keys, "next": "zz"}).verdict(msg, evidence, own)
    assert "the grad_out frame is not signed by next" in bad.detail
    tp.gate.admit("next", IDS["next"].public_key)  # a neighbour: the gate's key counts, not the claim
    wrong = {**keys, "next": Identity.generate().public_hex}
    assert spot.rechecker(checker.ex, 0, wrong).verdict(msg, evidence, own).agree


def test_the_coordinator_gives_an_arbiter_the_signers_keys_and_a_replica_none(tmp_path: Path) -> None:
    from protocol.wire.messages import Recheck, Verdict
    from tests.test_coordinator_inbox import _driver, _host, _inbound

    driver = _driver(tmp_path, [["p0"], ["p1"]])
    _host(driver).keys_of = lambda peers: {p: f"key of {p}" for p in peers}  # type: ignore[method-assign]
    checker = driver.auditor.checker
    signers = {"input": "p0", "output": "p1"}
    driver.take_answer(_inbound("p0", Verdict("r", 3, 0, "p1", True)))
    asyncio.run(checker.recheck(3, 1, 0, ["input", "output"], signers, [], "p0", ([], [])))  # an arbiter
    driver.take_answer(_inbound("p0", Verdict("r", 3, 0, "p1", True)))
    asyncio.run(checker.recheck(3, 1, 0, ["input", "output"], signers, [], "p0"))  # a replica of the stage
    rechecks = [m for _, m, _ in _host(driver).transport.sent if isinstance(m, Recheck)]
    assert [r.keys for r in rechecks] == [{"p0": "key of p0", "p1": "key of p1"}, {}]


def test_a_certificate_renewal_tells_each_peer_when_its_neighbourhood_ends_not_the_plan() -> None:
    """Renewals told every admitted peer when every planned peer's certificate ends (a
    message that grew with the plan, over a frame's cap from ~15,000 planned peers);
    a peer's gate takes only its neighbourhood's, so only those are sent."""
    from coordinator.admission import Admission
    from coordinator.assign import Assignment
    from coordinator.config import CoordinatorConfig
    from coordinator.roster import Endpoint, Roster
    from coordinator.status import StatusBoard
    from protocol.model.graph import Cut
    from protocol.wire.messages import Certificate
    from tests.test_coordinator_inbox import JOB as INBOX_JOB
    from tests.test_coordinator_inbox import FakeTransport

    stages = [["a"], ["b", "c"], ["d"], ["e"]]
    gate = Gate(RUN)
    for p in "abcdef":  # f: a standby peer
        gate.admit(p, Identity.generate().public_key)
    transport = FakeTransport()
    roster = Roster()
    roster.driver = SimpleNamespace(st=SimpleNamespace(plan=Assignment(Cut((10, 20, 30)), stages)))  # type: ignore[assignment]
    config = CoordinatorConfig(job=INBOX_JOB, run_id=RUN)
    admission = Admission(config, gate, StatusBoard(RUN, 1), Endpoint(Identity.generate(), None, transport), roster)  # type: ignore[arg-type]
    asyncio.run(admission.certify(list("abcdef")))
    told = {p: m.expires for p, m, _ in transport.sent if isinstance(m, Certificate)}
    assert {p: sorted(e) for p, e in told.items()} == {
        "a": ["a", "b", "c"],
        "b": ["a", "b", "c", "d"],
        "c": ["a", "b", "c", "d"],
        "d": ["b", "c", "d", "e"],
        "e": ["d", "e"],
        "f": [],
    }
    assert told["d"]["e"] == gate.until["e"]
