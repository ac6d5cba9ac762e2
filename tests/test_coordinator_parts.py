"""The coordinator's network components without a network: a transport handed in, a
fake clock, a driver seen only through the roster (coordinator.swarm is a shell over
them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.admission import BAN_FILE, TELL_EVERY_S
from coordinator.assign import Assignment
from coordinator.config import CoordinatorConfig
from coordinator.outcome import SwarmError
from coordinator.runstate import BANNED, EXCLUDED, RunState
from coordinator.swarm import Coordinator
from protocol.model.graph import Cut
from protocol.model.job import JobSpec
from protocol.net.clock import FakeClock
from protocol.trust.identity import Identity
from protocol.wire.messages import Abort, Advert, Evidence
from protocol.wire.reject import Reject, Rejected

JOB = JobSpec(model_args="n_layer=2,n_embd=64,n_head=4", steps=5)


class FakeTransport:
    """Records what is sent; every peer is connected."""

    def __init__(self) -> None:
        self.peer_id = "coordinator"
        self.sent: list[tuple[str, Any]] = []
        self.dials_in: set[str] = set()

    async def send(self, peer: str, msg: Any, values: Any = None) -> None:
        self.sent.append((peer, msg))

    async def connected(self) -> set[str]:
        return {"p0"}

    async def connect(self, peer: str) -> None:
        raise ConnectionError(peer)


class EmptyDht:
    """A DHT that holds nothing."""

    def get(self, key: str, latest: bool, return_future: bool) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def _coordinator(clock: FakeClock | None = None, **cfg: Any) -> tuple[Coordinator, FakeTransport]:
    transport = FakeTransport()
    config = CoordinatorConfig(job=JOB, run_id="r", status=False, **cfg)
    coord = Coordinator(config, transport=transport, clock=clock or FakeClock())  # type: ignore[arg-type]
    coord.endpoint.identity = Identity.generate()
    return coord, transport


def _driving(stages: list[list[str]], lost: dict[str, str] | None = None) -> SimpleNamespace:
    st = RunState(plan=Assignment(Cut((40,)), stages), lost=lost or {})
    failed: list[tuple[str, str]] = []
    return SimpleNamespace(
        st=st,
        max_payload_bytes=1000,
        auditing={"p1"},
        failed=failed,
        take_answer=lambda inbound: None,
        fail=lambda peer, why: failed.append((peer, why)),
    )


def test_waiting_for_peers_gives_up_at_its_deadline_on_the_injected_clock() -> None:
    async def go() -> None:
        clock = FakeClock()
        coord, _ = _coordinator(clock, peer_wait_s=30.0, min_peers=2)
        coord.endpoint.dht = EmptyDht()  # type: ignore[assignment]
        counts: list[int] = []
        waiting = asyncio.create_task(coord.wait_for_peers(counts.append))
        await clock.advance(29.0)
        assert not waiting.done() and counts == [0], "the count is said once, when it changes"
        await clock.advance(2.0)
        with pytest.raises(SwarmError, match="only 0 of 2 peers joined within 30 s"):
            await waiting

    asyncio.run(go())


def test_peers_send_only_their_kinds_and_payloads_only_as_planned() -> None:
    coord, _ = _coordinator()
    intake, roster = coord.intake, coord.roster

    def env(kind: str, nbytes: int, **body: Any) -> Any:
        return SimpleNamespace(kind=kind, payload_bytes=nbytes, body=body)

    with pytest.raises(Rejected) as err:
        intake.expect(env("assign", 0), None, "p0")  # type: ignore[arg-type]
    assert err.value.code == Reject.UNEXPECTED
    intake.expect(env("beat", 0), None, "p0")  # type: ignore[arg-type]
    with pytest.raises(Rejected, match="payload"):
        intake.expect(env("state", 10), None, "p0")  # type: ignore[arg-type]  # no run yet: no payloads
    assert not intake.lane_ok("p0", 10)
    roster.driver = _driving([["p0"], ["p1"]])  # type: ignore[assignment]
    intake.expect(env("state", 1000), None, "p0")  # type: ignore[arg-type]
    intake.expect(env("evidence", 10), None, "p1")  # type: ignore[arg-type]  # it checks a step
    for kind, nbytes, sender, body in [
        ("state", 1001, "p0", {}),
        ("state", 10, "outsider", {}),
        ("evidence", 10, "p0", {}),
        ("failure", 10, "p0", {}),
    ]:
        with pytest.raises(Rejected) as err:
            intake.expect(env(kind, nbytes, **body), None, sender)  # type: ignore[arg-type]
        assert err.value.code == Reject.OVERSIZED, (kind, sender)
    intake.expect(env("failure", 10, poison=True), None, "p0")  # type: ignore[arg-type]
    assert intake.lane_ok("p0", 1000) and not intake.lane_ok("p0", 1001) and not intake.lane_ok("outsider", 1)


def test_frames_are_relayed_only_between_planned_peers_behind_nats() -> None:
    coord, _ = _coordinator()
    coord.roster.driver = _driving([["p0"], ["p1"]])  # type: ignore[assignment]
    coord.reached.update({"p0": False, "p1": True})
    assert not coord.intake.relay_ok("p0", "p1", 10), "p1 can be dialled"
    coord.reached["p1"] = False
    assert coord.intake.relay_ok("p0", "p1", 10)
    assert not coord.intake.relay_ok("p0", "p1", 1001), "no larger than a payload the coordinator takes"
    coord.reached["x"] = False
    assert not coord.intake.relay_ok("p0", "x", 10), "x is not planned"


def test_spot_check_answers_go_to_the_driver_only_from_planned_peers() -> None:
    coord, _ = _coordinator()
    answer = SimpleNamespace(sender="p0", message=Evidence.__new__(Evidence))
    assert not coord.intake.divert(answer), "no run: into the inbox"  # type: ignore[arg-type]
    driving = _driving([["p0"], ["p1"]])
    taken: list[Any] = []
    driving.take_answer = taken.append
    coord.roster.driver = driving  # type: ignore[assignment]
    assert coord.intake.divert(answer) and taken == [answer]  # type: ignore[arg-type]
    stranger = SimpleNamespace(sender="x", message=answer.message)
    assert coord.intake.divert(stranger) and taken == [answer], "dropped"  # type: ignore[arg-type]


def test_a_refused_sender_is_told_why_at_most_once_a_minute(tmp_path: Path) -> None:
    async def go() -> None:
        clock = FakeClock()
        coord, transport = _coordinator(clock)
        coord.admission.open(tmp_path)
        (tmp_path / BAN_FILE).write_text("QmBad\n")
        for _ in range(3):
            assert "banned" in coord.admission.check("QmBad", {"pubkey": "ab"})
        await clock.advance(TELL_EVERY_S - 1)
        assert "banned" in coord.admission.check("QmBad", {"pubkey": "ab"})
        await clock.advance(2)
        assert "banned" in coord.admission.check("QmBad", {"pubkey": "ab"})
        await clock.advance(0)  # the telling tasks run
        await coord.admission.aclose(1.0)
        told = [(p, type(m)) for p, m in transport.sent]
        assert told == [("QmBad", Abort), ("QmBad", Abort)]
        assert coord.admission.check("QmGood", {"pubkey": "cd"}) == "", "a public swarm admits the rest"

    asyncio.run(go())


def test_an_excluded_peer_is_refused_for_what_it_sent(tmp_path: Path) -> None:
    async def go() -> None:
        coord, transport = _coordinator()
        coord.admission.open(tmp_path)
        lost = {"p2": EXCLUDED + "it sent NaN"}
        coord.roster.driver = _driving([["p0"], ["p1"]], lost)  # type: ignore[assignment]
        assert coord.admission.check("p2", {"pubkey": "ab"}) == "p2 was excluded: it sent NaN"
        await coord.admission.aclose(1.0)

    asyncio.run(go())


def test_a_ban_revokes_admission_and_drops_a_planned_peer(tmp_path: Path) -> None:
    async def go() -> None:
        coord, transport = _coordinator()
        coord.admission.open(tmp_path)
        keys = {p: Identity.generate() for p in ("p0", "p1", "other")}
        for p, identity in keys.items():
            coord.gate.admit(p, identity.public_key)
        driving = _driving([["p0"], ["p1"]])
        coord.roster.driver = driving  # type: ignore[assignment]
        (tmp_path / BAN_FILE).write_text(f"p1\n{keys['other'].public_hex}\n")
        await coord.admission.enforce_bans()
        assert coord.banned == {"p1", "other"}, "by id or by key"
        assert "p1" not in coord.gate.keys and "other" not in coord.gate.keys and "p0" in coord.gate.keys
        assert driving.failed == [("p1", BANNED)]
        assert {p for p, m in transport.sent if isinstance(m, Abort)} == {"p1", "other"}

    asyncio.run(go())


def test_planned_peers_keep_their_advert_through_a_dht_hiccup() -> None:
    coord, _ = _coordinator()

    def ad(peer: str) -> Advert:
        return Advert(peer, [], "cpu", 1e10, 1 << 30, 100.0, 100.0, "2", 1, 1e12)

    coord.adverts = {"p0": ad("p0"), "gone": ad("gone")}
    coord.keep_adverts({"new": ad("new")}, {"p0"})
    assert set(coord.adverts) == {"p0", "new"}


def test_reachable_is_a_connection_now_or_one_made_in_time() -> None:
    async def go() -> None:
        coord, _ = _coordinator()
        assert await coord.reachable("p0")
        assert not await coord.reachable("p1", timeout=0.1)

    asyncio.run(go())
