"""The live coordinator asks before it commits to a plan (issue 34 item 2): the probe
request pair on the wire, the peer that answers it within its own caps, and the
planner that sends the requests, folds the answers in and plans once more, all on a
fake transport and a fake clock."""

from __future__ import annotations

import asyncio
import functools
import math
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.intake import Intake
from coordinator.link_asking import ASK_WAIT_S, LinkAsker, ends
from coordinator.opdag import OpDag, build_opdag
from coordinator.planning import Planner
from coordinator.roster import Roster
from coordinator.runstate import RunState
from peer.checks import PlanChecks
from peer.probing import PROBE_TIMEOUT_S, LinkProber
from protocol.model.job import JobSpec
from protocol.net.clock import SYSTEM_CLOCK, FakeClock
from protocol.net.transport import Inbound, PeerUnreachable, Transport
from protocol.trust.identity import Identity, sign_record
from protocol.wire.encoding import Frame
from protocol.wire.gate import MAX_PROBERS, Gate
from protocol.wire.link_probes import ALLOW_S, ProbeLink, ProbeResult
from protocol.wire.messages import Advert, Message, kinds_from
from protocol.wire.reject import Rejected
from protocol.wire.schema import MessageError
from tests.p2p import transports

RUN = "r"
ADDR = "/ip4/127.0.0.1/tcp/4001"


def _advert(peer: str, maddrs: list[str] | None = None, run: str = RUN) -> Advert:
    """``peer``'s advert as the DHT holds it: signed by its key."""
    ad = Advert(peer, maddrs or [ADDR], "cpu", 1e10, 1 << 30, 100.0, 100.0, "2", 4, 0.0, run_id=run)
    record = sign_record(Identity.generate(), ad.header())
    found = Advert.from_header(record)
    assert isinstance(found, Advert)
    return found


def _inbound(sender: str, msg: Message) -> Inbound:
    return Inbound(sender, msg, Frame({"values": []}, b""))


# ------------------------------------------------------------------ the wire
def test_the_probe_messages_round_trip_and_refuse_bad_input() -> None:
    ad = _advert("b").header()
    for msg in (
        ProbeLink(RUN, 7, "b", "probe", ad, 1 << 20),
        ProbeLink(RUN, 8, "a", "answer"),
        ProbeResult(RUN, 7, "b", mbit_s=93.5),
        ProbeResult(RUN, 7, "b", error="cannot open a stream"),
    ):
        assert Message.from_header(msg.header()) == msg
    assert "probelink" in kinds_from("coordinator", early=True) and "proberesult" in kinds_from("peer")
    bad: list[dict[str, Any]] = [
        {**ProbeLink(RUN, 1, "b", "answer").header(), "role": "send"},
        {**ProbeLink(RUN, 1, "b", "answer").header(), "nonce": -1},
        {**ProbeLink(RUN, 1, "b", "answer").header(), "nonce": "1"},
        {**ProbeLink(RUN, 1, "b", "answer").header(), "peer": ""},
        {**ProbeLink(RUN, 1, "b", "answer").header(), "peer": "x" * 200},
        {**ProbeLink(RUN, 1, "b", "answer").header(), "role": "probe"},  # no advert to dial by
        {**ProbeLink(RUN, 1, "b", "probe", ad).header(), "nbytes": -5},
        {**ProbeResult(RUN, 1, "b", mbit_s=1.0).header(), "mbit_s": math.nan},
        {**ProbeResult(RUN, 1, "b", mbit_s=1.0).header(), "mbit_s": -1.0},
        {**ProbeResult(RUN, 1, "b", mbit_s=1.0).header(), "error": "and a failure"},
        {**ProbeResult(RUN, 1, "b", error="x").header(), "error": ""},
        {**ProbeResult(RUN, 1, "b", error="x").header(), "error": "x" * 400},
    ]
    for header in bad:
        with pytest.raises(MessageError):
            Message.from_header(header)


def test_only_the_coordinator_may_ask_a_peer_to_probe() -> None:
    checks = PlanChecks("coord")
    env = SimpleNamespace(kind="probelink", epoch=0)
    msg = ProbeLink(RUN, 1, "b", "answer")
    checks(env, msg, "coord")  # before any assignment too
    with pytest.raises(Rejected, match="before an assignment"):
        checks(env, msg, "stranger")


def test_the_gate_lets_a_named_prober_in_for_a_while_and_bounds_how_many() -> None:
    now = [0.0]
    gate = Gate(RUN, clock=lambda: now[0])
    with pytest.raises(Rejected, match="not admitted"):
        gate.check_prober("a")
    gate.allow_probe("a", ALLOW_S)
    assert gate.may_probe("a") and not gate.may_probe("b")
    gate.check_prober("a")
    now[0] = ALLOW_S + 0.1
    assert not gate.may_probe("a")
    for i in range(MAX_PROBERS + 10):
        gate.allow_probe(f"p{i}", ALLOW_S)
    assert len(gate.probers) == MAX_PROBERS


# ------------------------------------------------------------------ the peer
class _PeerTransport:
    """What ``LinkProber`` uses of a transport: a probe takes ``seconds`` on the fake clock."""

    def __init__(self, clock: FakeClock, mbps: float = 80.0, seconds: float = 0.0) -> None:
        self.peer_id, self.clock, self.mbps, self.seconds = "me", clock, mbps, seconds
        self.gate = Gate(RUN)
        self.measured: list[tuple[str, int]] = []
        self.learnt: dict[str, list[str]] = {}
        self.sent: list[tuple[str, Message]] = []

    def learn(self, peer_id: str, maddrs: list[str]) -> None:
        self.learnt[peer_id] = maddrs

    async def measure_bandwidth(self, peer_id: str, nbytes: int, down: bool = True) -> tuple[float, float]:
        self.measured.append((peer_id, nbytes))
        if self.seconds:
            await self.clock.sleep(self.seconds)
        return self.mbps, 0.0

    async def send(self, peer_id: str, msg: Message) -> int:
        self.sent.append((peer_id, msg))
        return 0


def test_the_peer_probes_the_signed_advert_within_its_own_caps() -> None:
    async def main() -> tuple[_PeerTransport, list[ProbeResult]]:
        clock = FakeClock()
        tp = _PeerTransport(clock, seconds=0.0)
        prober = LinkProber(tp, RUN, lambda: "coord", cap_bytes=1 << 20, clock=clock)  # type: ignore[arg-type]
        good = _advert("b").header()
        forged = {**good, "maddrs": ["/ip4/10.9.9.9/tcp/80"]}  # an address the peer did not sign
        requests = [
            ProbeLink(RUN, 1, "b", "probe", good, nbytes=1 << 40),  # asks far more than the cap
            ProbeLink(RUN, 2, "b", "probe", forged),
            ProbeLink(RUN, 3, "c", "probe", good),  # another peer's advert
            ProbeLink(RUN, 4, "b", "probe", _advert("b", run="other").header()),
            ProbeLink(RUN, 5, "me", "probe", _advert("me").header()),
        ]
        return tp, [await prober.probe(r) for r in requests]

    tp, results = asyncio.run(main())
    assert tp.measured == [("b", 1 << 20)] and tp.learnt == {"b": [ADDR]}
    assert results[0] == ProbeResult(RUN, 1, "b", mbit_s=80.0)
    assert [r.ok for r in results] == [True, False, False, False, False]
    assert "signature" in results[1].error and "not the named peer" in results[2].error
    assert "another run" in results[3].error and "itself" in results[4].error


def test_the_peer_answers_requests_in_turn_and_gives_up_on_a_slow_probe() -> None:
    async def main() -> tuple[_PeerTransport, list[float]]:
        clock = FakeClock()
        tp = _PeerTransport(clock, seconds=PROBE_TIMEOUT_S + 5)
        prober = LinkProber(tp, RUN, lambda: "coord", cap_bytes=1 << 20, clock=clock)  # type: ignore[arg-type]
        serving = asyncio.create_task(prober.serve())
        prober.take(ProbeLink(RUN, 1, "b", "probe", _advert("b").header()))
        prober.take(ProbeLink(RUN, 2, "x", "answer"))  # the other end's part: let x in
        assert tp.gate.may_probe("x")
        times = []
        for _ in range(2):
            await clock.advance(PROBE_TIMEOUT_S - 0.1)
            times.append(len(tp.sent))
            await clock.advance(0.2)
            times.append(len(tp.sent))
        serving.cancel()
        return tp, times

    tp, counts = asyncio.run(main())
    assert counts == [0, 1, 1, 1]
    ((to, result),) = tp.sent
    assert to == "coord" and isinstance(result, ProbeResult) and result.nonce == 1
    assert not result.ok and "timed out" in result.error


# ------------------------------------------------------------------ the coordinator
class _CoordTransport:
    """Sends recorded; a probe request answered at once through ``answer`` (None: never)."""

    def __init__(self, answer: Any) -> None:
        self.sent: list[tuple[str, ProbeLink]] = []
        self.answer = answer
        self.asker: LinkAsker | None = None

    async def send(self, peer_id: str, msg: Message) -> int:
        assert isinstance(msg, ProbeLink)
        self.sent.append((peer_id, msg))
        mbps = self.answer(peer_id, msg.peer) if msg.role == "probe" else None
        if mbps is not None and self.asker is not None:
            self.asker.take(_inbound(peer_id, ProbeResult(RUN, msg.nonce, msg.peer, mbit_s=mbps)))
        return 0


@functools.cache
def _job() -> tuple[JobSpec, OpDag]:
    job = JobSpec(model="branchy", data="branchy")
    return job, build_opdag(job.build_model(), job.first_micro_batch())


def _planner(answer: Any, clock: FakeClock) -> tuple[Planner, _CoordTransport, list[str], list[Advert]]:
    job, dag = _job()
    tp = _CoordTransport(answer)
    host = SimpleNamespace(config=CoordinatorConfig(job, run_id=RUN), reached={}, transport=tp)
    events: list[str] = []
    tp.asker = LinkAsker(host, clock)  # type: ignore[arg-type]
    planner = Planner(host, RunState(), dag, job.micro_batches, tp.asker, events.append)  # type: ignore[arg-type]
    return planner, tp, events, [_advert(p) for p in ("p0", "p1", "p2")]


def test_the_coordinator_probes_the_deciding_links_and_plans_again() -> None:
    """Three alike peers: the guessed plan runs p0-p1-p2 and rests on two guessed links;
    p0-p1 measures 1 Mbit/s, so the plan keeps p0 and p1 apart."""

    def answer(prober: str, target: str) -> float:
        return 1.0 if {prober, target} == {"p0", "p1"} else 100.0

    async def main() -> tuple[Any, ...]:
        clock = FakeClock()
        planner, tp, events, ads = _planner(answer, clock)
        unasked = planner.plan(ads)
        plan = await planner.plan_asking(ads)
        return unasked, plan, tp, events, planner.st, clock.now()

    unasked, plan, tp, events, st, waited = asyncio.run(main())
    assert unasked.stages == [["p0"], ["p1"], ["p2"]] and unasked.deciding == [("p0", "p1"), ("p1", "p2")]
    assert [(to, m.role, m.peer) for to, m in tp.sent] == [
        ("p1", "answer", "p0"),  # the target lets the prober in first
        ("p0", "probe", "p1"),
        ("p2", "answer", "p1"),
        ("p1", "probe", "p2"),
    ]
    assert tp.sent[1][1].advert["peer_id"] == "p1" and tp.sent[1][1].advert["sig"]
    assert st.link_mbps == {("p0", "p1"): 1.0, ("p1", "p2"): 100.0}  # where the epochs' probes land
    assert plan.stages == [["p0"], ["p2"], ["p1"]]
    assert waited == 0.0, "all answered: no wait"
    (line,) = events
    assert "probed 2 of 2" in line and "p0->p1 1.0 Mbit/s (guessed 100.0)" in line
    assert "the plan changed: p0 | p1 | p2 -> p0 | p2 | p1" in line


def test_a_peer_that_never_answers_leaves_the_guess_and_the_plan_after_the_cap() -> None:
    async def main() -> tuple[Any, ...]:
        clock = FakeClock()
        planner, tp, events, ads = _planner(lambda prober, target: None, clock)
        task = asyncio.create_task(planner.plan_asking(ads))
        await clock.advance(ASK_WAIT_S - 0.1)
        early = task.done()
        await clock.advance(0.2)
        return early, task.done() and task.result(), tp, events, planner.st

    early, plan, tp, events, st = asyncio.run(main())
    assert not early and plan and plan.stages == [["p0"], ["p1"], ["p2"]]
    assert len(tp.sent) == 4 and st.link_mbps == {}
    (line,) = events
    assert "probed 0 of 2" in line and f"no answer within {ASK_WAIT_S:.1f} s" in line
    assert line.endswith("planned on the guesses")


def test_the_asker_keeps_only_answers_to_its_requests() -> None:
    async def main() -> list[Any]:
        clock = FakeClock()
        host = SimpleNamespace(config=SimpleNamespace(run_id=RUN), transport=None)
        asker = LinkAsker(host, clock)  # type: ignore[arg-type]
        sent: list[ProbeLink] = []

        async def send(peer_id: str, msg: ProbeLink) -> int:
            sent.append(msg)
            if peer_id == "b":  # b cannot be reached: its link is read as not measured
                raise PeerUnreachable("gone", peer_id)
            return 0

        host.transport = SimpleNamespace(send=send)
        ads = {p: _advert(p) for p in ("a", "b", "c", "n1", "n2")}
        task = asyncio.create_task(asker.ask([("a", "c"), ("b", "c"), ("n1", "n2"), ("a", "z")], ads, {"n1", "n2"}))
        await clock.advance(0.0)
        nonce = next(m.nonce for m in sent if m.role == "probe" and m.peer == "c")
        asker.take(_inbound("c", ProbeResult(RUN, nonce, "c", mbit_s=5.0)))  # from the wrong end
        asker.take(_inbound("a", ProbeResult(RUN, nonce + 99, "c", mbit_s=5.0)))  # no such request
        asker.take(_inbound("a", ProbeResult("other", nonce, "c", mbit_s=5.0)))  # another run
        asker.take(_inbound("a", ProbeResult(RUN, nonce, "c", mbit_s=42.0)))
        await clock.advance(0.0)
        return [task.done(), task.result()]

    done, readings = asyncio.run(main())
    assert done, "every asked link settled: no wait for the cap"
    assert [(r.prober, r.target, r.mbps) for r in readings] == [("a", "c", 42.0), ("b", "c", None)]
    assert "could not ask" in readings[1].error


def test_who_probes_a_link() -> None:
    assert ends(("a", "b"), set()) == ("a", "b")
    assert ends(("a", "b"), {"b"}) == ("b", "a")  # behind a NAT: it dials out
    assert ends(("a", "b"), {"a", "b"}) is None  # forwarded through the coordinator


def test_probe_results_go_to_the_planner_not_the_inbox() -> None:
    got: list[Inbound] = []
    roster = Roster()
    roster.driver = SimpleNamespace(take_probe=got.append)  # type: ignore[assignment]
    intake = Intake(roster, SimpleNamespace())  # type: ignore[arg-type]
    inbound = _inbound("a", ProbeResult(RUN, 1, "c", mbit_s=3.0))
    assert intake.divert(inbound) and got == [inbound]


# ------------------------------------------------------------------ over libp2p
def test_two_peers_that_never_met_measure_their_link_when_the_coordinator_asks() -> None:
    """Three transports on loopback (the coordinator and two peers that admit only it):
    the prober dials the other end at its signed advert's addresses, the other end lets
    the probe in once asked (without admitting it), and the reading reaches the asker."""

    async def main() -> tuple[list[Any], bool]:
        async with transports(3, RUN) as (coord, a, b):
            for t, other in ((a, b), (b, a)):
                t.gate.revoke(other.peer_id)  # strangers to each other, as before a first plan
            host = SimpleNamespace(config=SimpleNamespace(run_id=RUN), transport=coord)
            asker = LinkAsker(host, SYSTEM_CLOCK)  # type: ignore[arg-type]
            probers = {t.peer_id: LinkProber(t, RUN, lambda: coord.peer_id, 1 << 20) for t in (a, b)}

            async def route(t: Transport) -> None:
                while True:
                    inbound = await t.inbox.get()
                    if t is coord:
                        asker.take(inbound)
                    else:
                        probers[t.peer_id].take(inbound.message)

            ads = {t.peer_id: _advert(t.peer_id, [str(m) for m in await t.p2p.get_visible_maddrs()]) for t in (a, b)}
            tasks = [asyncio.create_task(route(t)) for t in (coord, a, b)]
            tasks += [asyncio.create_task(p.serve()) for p in probers.values()]
            try:
                readings = await asker.ask([(a.peer_id, b.peer_id)], ads, ())
            finally:
                for task in tasks:
                    task.cancel()
            return readings, a.peer_id in b.gate.keys

    (reading,), admitted = asyncio.run(main())
    assert reading.mbps is not None and reading.mbps > 0, reading.error
    assert not admitted, "let in to probe, not admitted"
