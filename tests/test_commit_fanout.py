"""A step's commits go out in bounded parallel (``coordinator.messaging.send_each``),
one signed frame for every peer that gets the same body: a slow peer no longer holds
the others' commits, a peer that cannot be reached is still lost with the rollback
its spot checks need, the first stage's commit still starts first, and one frame
opens at every receiver (a frame names no receiver) but only once at each. The
outbound side is priced in ``discovery_cost``. The pipeline's tests run on the
driver of ``tests/test_coordinator_inbox.py`` (fake host, transport and clock)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator import discovery_cost as dc
from coordinator.messaging import send_each
from coordinator.runstate import PeerLost
from protocol.model.recipe import Update
from protocol.net.transport import PeerUnreachable
from protocol.trust.identity import Identity
from protocol.wire.envelope import Sealer
from protocol.wire.gate import Gate
from protocol.wire.messages import Commit, Message
from protocol.wire.reject import Reject, Rejected
from tests.test_coordinator_inbox import FakeFrame, FakeTransport, _driver, _host


class Slow(FakeTransport):
    """A transport whose sends to some peers hang (``stuck``) or fail (``gone``); it
    counts the frames it seals and notes when each send starts and ends."""

    def __init__(self, stuck: set[str] = frozenset(), gone: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.stuck, self.gone = stuck, gone
        self.sealed: list[Message] = []
        self.events: list[tuple[str, str]] = []
        self.release = asyncio.Event()

    def prepare(self, peer: str, msg: Message) -> FakeFrame:
        self.sealed.append(msg)
        return super().prepare(peer, msg)

    async def send(self, peer: str, msg: Message, values: list[Any] | None = None) -> int:
        self.events.append(("start", peer))
        if peer in self.gone:
            raise PeerUnreachable("no route", peer)
        if peer in self.stuck:
            await self.release.wait()
        self.events.append(("end", peer))
        return await super().send(peer, msg, values)


def _commit_driver(tmp_path: Path, transport: Slow, timeout: float = 30.0) -> Any:
    """Three stages: s0 = (c, a), s1 = (b,), s2 = (d, e): ids sort apart from stage order."""
    driver = _driver(tmp_path, [["c", "a"], ["b"], ["d", "e"]], spot_check=0.0, send_timeout_s=timeout)
    _host(driver).transport = transport
    return driver


def test_a_slow_peer_does_not_hold_the_others_commits_and_each_body_is_signed_once(tmp_path: Path) -> None:
    async def go() -> Slow:
        transport = Slow(stuck={"c"})
        driver = _commit_driver(tmp_path, transport)
        commit = asyncio.ensure_future(driver.pipeline._commit(7, Update(), False, 0, [(2, 0, False)]))
        for _ in range(20):
            await asyncio.sleep(0)
        # the first stage's commits start first; the stuck one (c) holds no one
        assert [p for e, p in transport.events if e == "start"] == ["c", "a", "b", "d", "e"]
        assert {p for p, _, _ in transport.sent} == {"a", "b", "d", "e"} and not commit.done()
        transport.release.set()
        await commit
        return transport

    transport = asyncio.run(go())
    got = {p: m for p, m, _ in transport.sent}
    assert all(isinstance(m, Commit) and m.step == 7 for m in got.values())
    assert {p for p, m in got.items() if m.audit} == {"d", "e"}  # the checked stage keeps its weights
    assert len(transport.sealed) == 2  # one frame for the checked stage's peers, one for the rest


@pytest.mark.parametrize("checked", [True, False])
def test_a_peer_lost_before_its_commit_is_lost_with_the_rollback_its_checks_need(tmp_path: Path, checked: bool) -> None:
    """Every reachable peer still gets its commit (the step counted); the unreachable
    and the too slow are lost together, rolled back to the step where it was checked."""
    transport = Slow(stuck={"b"}, gone={"d"})
    driver = _commit_driver(tmp_path, transport, timeout=0.05)
    checks = [(0, 0, False)] if checked else []
    with pytest.raises(PeerLost) as lost:
        asyncio.run(driver.pipeline._commit(4, Update(), False, 0, checks))
    assert set(lost.value.lost) == {"b", "d"}
    assert lost.value.lost["d"] == "unreachable: no route"
    assert lost.value.lost["b"].startswith("unreachable: ")
    assert lost.value.rollback_to == (4 if checked else None)
    assert {p for p, _, _ in transport.sent} == {"a", "c", "e"}


def test_send_each_keeps_at_most_its_bound_under_way() -> None:
    class Counting(FakeTransport):
        def __init__(self) -> None:
            super().__init__()
            self.now = self.most = 0

        async def send(self, peer: str, msg: Message, values: list[Any] | None = None) -> int:
            self.now += 1
            self.most = max(self.most, self.now)
            await asyncio.sleep(0)
            self.now -= 1
            return await super().send(peer, msg, values)

    transport = Counting()
    msg = Commit("r", 0)
    missed = asyncio.run(send_each(transport, {f"p{i}": msg for i in range(50)}, 1.0, 4))  # type: ignore[arg-type]
    assert missed == {} and transport.most == 4 and len(transport.sent) == 50


def test_one_sealed_commit_opens_at_every_receiver_once() -> None:
    """The shared frame: no receiver in it, so each peer's gate takes it, and a peer
    that forwards its copy to another gets it refused as a replay once that one has its own."""
    coordinator = Identity.generate()
    head, _ = Sealer(coordinator, "coordinator").seal(Commit("r", 3, 1, audit=True), [], [])
    gates = [Gate("r"), Gate("r")]
    for gate in gates:
        gate.admit("coordinator", coordinator.public_key)
        gate.epoch = 1
        assert gate.open(head, "coordinator").message == Commit("r", 3, 1, audit=True)
    with pytest.raises(Rejected) as again:
        gates[0].open(head, "coordinator")
    assert again.value.code is Reject.REPLAY


def test_the_outbound_side_is_priced_and_fits_one_core_at_ten_thousand() -> None:
    inbound = dc.control_cpu(10_000, 10_000, 0.0, 5.0, 10.0) - 2000 * dc.COMMIT_CPU_S
    assert inbound == pytest.approx(2000 * dc.CONTROL_MESSAGE_CPU_S)  # step reports, their heartbeats
    assert dc.control_cpu(10_000, 10_000, 0.0, 5.0, 10.0) <= 1.0  # with a commit to each a step
    assert dc.swarm_cost(10_000, 10_000, 5.0).coordinator_cpu <= 1.0


@pytest.mark.parametrize("planned", [10_000, 100_000])
def test_an_assignment_is_bounded_by_its_neighbourhood_at_any_plan_size(planned: int) -> None:
    """Each planned peer's assignment names its own and the neighbouring stages' peers
    (before: every planned peer, over a frame header's cap from ~2,650): on a plan as
    the planner shapes it (a stage of at most 64 replicas, its step's micro-batches) the
    largest stays far under the cap at 10,000 and 100,000 planned peers, and a re-plan
    costs each peer its neighbourhood's bytes (linear in the peers for a given shape)."""
    sizes = dc.even_plan(planned)
    assert max(sizes) <= 64 and sum(sizes) == planned
    assert dc.largest_assign_bytes(sizes) < dc.HEADER_CAP_BYTES / 4
    assert dc.largest_assign_bytes(sizes) == dc.assign_bytes(3 * 64, len(sizes))
    cost = dc.swarm_cost(planned, planned, 5.0)
    assert cost.assign_sendable and cost.assign_kB < 200
    assert dc.replan_cpu(dc.even_plan(2 * 6400, 64)) < 2.2 * dc.replan_cpu(dc.even_plan(6400, 64))


def test_an_absurd_plan_is_priced_as_not_sendable() -> None:
    """Three stages of 1,000 replicas: the middle peer would name 3,000 (the
    coordinator refuses such a plan: ``tests/test_assign_neighbourhood.py``)."""
    assert dc.largest_assign_bytes([1000, 1000, 1000]) > dc.HEADER_CAP_BYTES
    assert not dc.with_assignments(dc.swarm_cost(3000, 3000, 5.0), [1000, 1000, 1000]).assign_sendable


def test_sim_says_what_a_replan_sends_and_when_a_plan_cannot_be_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from fusionllm.plan_cmds import _sim_text

    monkeypatch.setattr("fusionllm.plan_cmds._sim_left_out", lambda *a: {})
    topo = SimpleNamespace(name="t", peers=[SimpleNamespace(id=f"p{i}") for i in range(10_000)])

    def text(sizes: list[int], replans: int = 0) -> str:
        ids = iter(range(sum(sizes)))
        plan = SimpleNamespace(groups=[[f"p{next(ids)}" for _ in range(n)] for n in sizes])
        run = SimpleNamespace(first_plan=plan, mean_s=2.0, replans=[(0, "x")] * replans, redone=0, goodput=0.5)
        run.predicted_s = run.lower_bound_s = 1.0
        run.probes_asked, run.iteration_s = 0, [2.0] * 50  # 100 simulated seconds
        results = {"even": (run, 0.1)}
        return _sim_text(SimpleNamespace(iterations=50), topo, SimpleNamespace(num_ops=3), results, set())

    wide = dc.even_plan(10_000)  # 157 stages of at most 64
    assert f"the largest {dc.largest_assign_bytes(wide) / 1e3:.4g} kB, {dc.replan_cpu(wide):.3g} CPU-s" in text(wide)
    assert "the largest 85.21 kB" in text(wide)  # at 10,000 planned peers
    assert "(over the frame header cap: the plan is refused)" in text([1000, 1000, 1000])
    # 3,000 planned peers' reports and commits every 2 s, and 4 re-plans in 100 s
    shape = [1000, 1000, 1000]
    steady = dc.control_cpu(10_000, 3000, 0.0, 2.0, dc.STANDBY_BEAT_S)
    assert f"control plane {steady:.3g} coordinator CPU-s/s" in text(shape)
    assert f"control plane {steady + 4 * dc.replan_cpu(shape) / 100:.3g} coordinator CPU-s/s" in text(shape, 4)


def test_replans_are_amortised_over_the_time_between_them() -> None:
    steady = dc.control_cpu(1000, 1000, 0.0, 5.0, 10.0)
    assert dc.control_cpu(1000, 1000, 0.0, 5.0, 10.0, replan_s=600.0) == pytest.approx(
        steady + dc.replan_cpu(dc.even_plan(1000)) / 600
    )
    assert dc.swarm_cost(1000, 1000, 5.0, 600.0).coordinator_cpu > dc.swarm_cost(1000, 1000, 5.0).coordinator_cpu


def test_a_real_transport_writes_one_sealed_frame_to_each_peer_it_is_for() -> None:
    """``send_each`` on the live ``Transport`` (its writes to the p2p daemon captured):
    the peers of one body get the same bytes, each counted as sent to it, and each
    receiver's gate opens them."""
    from types import SimpleNamespace

    from protocol.net.transport import Transport

    who = Identity.generate()
    p2p = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "coordinator"))
    transport = Transport(p2p, who, Gate("r"))  # type: ignore[arg-type]
    written: dict[str, bytes] = {}

    async def write(key: str, peer: str, protocol: str, buffers: list[bytes]) -> int:
        written[peer] = b"".join(bytes(b) for b in buffers)
        return len(written[peer])

    transport._write = write  # type: ignore[method-assign]
    plain = Commit("r", 3, 1)
    kept = Commit("r", 3, 1, audit=True)
    assert asyncio.run(send_each(transport, {"a": plain, "b": plain, "c": kept}, 1.0, 2)) == {}
    assert written["a"] == written["b"] != written["c"]
    assert dict(transport.bytes_sent) == {p: len(written[p]) for p in "abc"}
    for peer, frame in written.items():
        gate = Gate("r")
        gate.admit("coordinator", who.public_key)
        gate.epoch = 1
        assert gate.open(frame, "coordinator").message == (kept if peer == "c" else plain)
