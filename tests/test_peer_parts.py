"""The peer's parts driven on a fake clock through their public methods: the
certificate watch of a private swarm, the coordinator watch and its heartbeats,
and the bounded wait for a certificate after the hello."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest

from peer.admission import CERT_WAIT_S, Credentials
from peer.checks import PlanChecks
from peer.config import JoinError, PeerConfig
from peer.link import BEAT_S, LOST_AFTER_S, CoordinatorLink
from peer.node import PeerNode
from protocol.net.clock import FakeClock
from protocol.net.transport import Inbound
from protocol.trust.admission import CERT_TTL_S, issue_certificate
from protocol.trust.identity import Identity
from protocol.wire.encoding import Frame
from protocol.wire.gate import Gate
from protocol.wire.messages import Beat, Certificate, CoordinatorRecord, Finish

RUN = "r"


def _private(clock: FakeClock) -> Credentials:
    return Credentials(PeerConfig([], RUN, swarm_secret="ab" * 32), clock)


def test_a_certificate_not_renewed_for_its_lifetime_asks_once_then_leaves() -> None:
    async def main() -> tuple[list[float], list[str], float]:
        clock, coordinator = FakeClock(), Identity.generate()
        creds = _private(clock)
        cert = issue_certificate(coordinator, RUN, "me", "ab" * 32, now=1000.0)
        gate = Gate(RUN)
        creds.take(Certificate(RUN, cert, {}), coordinator.public_hex, "me", "coord", gate)
        assert creds.certificate == cert and creds.certified_at == 0.0
        hellos: list[float] = []
        revoked: list[str] = []

        async def hello() -> None:
            hellos.append(clock.now())
            raise ConnectionError("the coordinator does not answer")  # the watch goes on

        watch = asyncio.create_task(creds.watch(hello, lambda: False, revoked.append))
        await clock.advance(CERT_TTL_S + CERT_WAIT_S + 5)
        assert watch.done() and watch.exception() is None
        return hellos, revoked, clock.now()

    hellos, revoked, _ = asyncio.run(main())
    assert hellos == [CERT_TTL_S + 1.0], "asked once, at the first look past its lifetime"
    assert len(revoked) == 1 and "admission certificate ran out" in revoked[0]


def test_a_paused_watch_restarts_the_certificates_clock() -> None:
    async def main() -> list[float]:
        clock, coordinator = FakeClock(), Identity.generate()
        creds = _private(clock)
        cert = issue_certificate(coordinator, RUN, "me", "x", 1.0)
        creds.take(Certificate(RUN, cert, {}), coordinator.public_hex, "me", "coord", Gate(RUN))
        paused, hellos = [True], []

        async def hello() -> None:
            hellos.append(clock.now())

        watch = asyncio.create_task(creds.watch(hello, lambda: paused[0], lambda _: None))
        await clock.advance(3 * CERT_TTL_S)  # the coordinator lost: no hello, however long
        paused[0] = False
        await clock.advance(CERT_TTL_S + 2)
        watch.cancel()
        return hellos

    assert asyncio.run(main()) == [4 * CERT_TTL_S + 1.0]


def test_no_certificate_within_the_wait_is_a_join_error_and_a_public_swarm_waits_for_none() -> None:
    async def main() -> None:
        clock = FakeClock()
        await Credentials(PeerConfig([], RUN), clock).wait()  # public: at once
        waiting = asyncio.create_task(_private(clock).wait())
        await clock.advance(CERT_WAIT_S + 1)
        with pytest.raises(JoinError, match="no admission certificate"):
            waiting.result()

    asyncio.run(main())


class _Unreachable:
    """A transport whose coordinator cannot be reached; counts what is sent."""

    def __init__(self) -> None:
        self.gate = Gate(RUN)
        self.sent: list[Any] = []
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.up = False

    async def connected(self) -> set[str]:
        return {"coord"} if self.up else set()

    async def connect(self, peer_id: str) -> None:
        if not self.up:
            raise ConnectionError(f"{peer_id} is down")

    async def send(self, peer_id: str, msg: Any, values: Any = None) -> int:
        if not self.up:
            raise ConnectionError(f"{peer_id} is down")
        self.sent.append(msg)
        self.bytes_sent[peer_id] += 100
        return 100

    async def aclose(self) -> None:
        pass


def _link(clock: FakeClock, tp: _Unreachable) -> CoordinatorLink:
    cfg = PeerConfig([], RUN)
    link = CoordinatorLink(cfg, None, tp, Identity.generate(), Credentials(cfg, clock), lambda _: None, clock)  # type: ignore[arg-type]
    link.record = CoordinatorRecord("coord", [], RUN, 0.0)
    return link


def test_the_coordinator_counts_as_lost_after_it_is_unreachable_for_a_while_and_heartbeats_pause() -> None:
    async def main() -> tuple[list[tuple[float, str]], int, int]:
        clock, tp = FakeClock(), _Unreachable()
        link = _link(clock, tp)
        lost: list[tuple[float, str]] = []
        watch = asyncio.create_task(link.watch(lambda why: lost.append((clock.now(), why))))
        beats = asyncio.create_task(link.beat(lambda: Beat(RUN, 3, 1)))
        await clock.advance(LOST_AFTER_S + 5)
        assert link.reattaching
        tp.up = True
        await clock.advance(5 * BEAT_S)  # reattaching: no heartbeats, and lost only once
        paused = len(tp.sent)
        link.reattaching = False
        await clock.advance(3 * BEAT_S)
        watch.cancel()
        beats.cancel()
        return lost, paused, len(tp.sent)

    lost, paused, sent = asyncio.run(main())
    assert [t for t, _ in lost] == [1.0 + LOST_AFTER_S] and "cannot be reached for 3 s" in lost[0][1]
    assert paused == 0 and sent == 3


def test_a_planned_peers_own_messages_to_the_coordinator_stand_in_for_its_heartbeat() -> None:
    """Issue 33: while a planned peer sends the coordinator step reports at least once a
    beat period, it sends no heartbeat; once it falls quiet, the heartbeats resume."""

    async def main() -> list[str]:
        clock, tp = FakeClock(), _Unreachable()
        tp.up = True
        link = _link(clock, tp)
        beats = asyncio.create_task(link.beat(lambda: Beat(RUN, 3, 1)))
        await clock.advance(BEAT_S)
        for _ in range(5):  # a step report every half beat period
            await tp.send("coord", "done")
            await clock.advance(BEAT_S / 2)
        await clock.advance(3 * BEAT_S)  # quiet again
        beats.cancel()
        return [m if isinstance(m, str) else m.KIND for m in tp.sent]

    sent = asyncio.run(main())
    first, last = sent.index("done"), len(sent) - 1 - sent[::-1].index("done")
    assert sent[first : last + 1] == ["done"] * 5, sent  # no beat while it reported
    assert sent[last + 1 :].count("beat") >= 2, sent


def test_the_end_of_the_run_stops_a_reattach_at_once() -> None:
    """Issue 30: a peer waiting for a lost coordinator to come back (after a stall,
    say) that is told the run ended leaves at once with the run's normal exit, not
    after its --coordinator-grace."""

    async def main() -> tuple[int | None, list[str]]:
        clock, tp = FakeClock(), _Unreachable()
        node = PeerNode(PeerConfig([], RUN, coordinator_grace=120.0), clock=clock)
        told: list[str] = []
        node.on_event = told.append
        node.transport, node.link, node.checks = tp, _link(clock, tp), PlanChecks("coord")  # type: ignore[assignment]

        async def no_record() -> dict[str, CoordinatorRecord]:
            return {}

        node.link.records, node.link.key = no_record, Identity.generate().public_key  # type: ignore[method-assign]
        node._lost("its connection dropped")
        serving = asyncio.create_task(node.serve())
        await clock.advance(30.0)
        assert not serving.done() and any("waiting up to 120 s" in t for t in told)
        node._route(Inbound("coord", Finish(RUN, False, 0), Frame({"values": []}, memoryview(b""))))
        code = await asyncio.wait_for(serving, 5)  # on the real clock: the fake one stands still
        await node.aclose()
        return code, told

    code, told = asyncio.run(main())
    assert code == 0 and told[-1] == "the run is finished"


class _Joins:
    """Stands in for ``start_dht``: its first ``refusals`` starts fail as hivemind's
    dial-back check fails (``peer.joining.DIAL_BACK_FAILED``), the rest succeed."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.tries = refusals, 0

    def __call__(self, **kwargs: Any) -> str:
        self.tries += 1
        if self.tries <= self.refusals:
            raise Exception("Peer Qm can't access this node. Probably, libp2p has failed to bypass the firewall")
        return "joined"


@pytest.mark.parametrize("refusals, joined", [(1, True), (2, True), (3, False)])
def test_a_join_refused_by_the_dial_back_check_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, refusals: int, joined: bool
) -> None:
    """The node joined through pings the newcomer back, and on a busy machine that ping
    can time out: the join is tried again (``JOIN_TRIES`` in all, within the join's
    timeout); a third refusal is the one-line error, with the tries counted."""
    from peer import joining

    fake = _Joins(refusals)
    monkeypatch.setattr(joining, "start_dht", fake)
    cfg = PeerConfig(["/ip4/127.0.0.1/tcp/1/p2p/Qm"], RUN, join_timeout=30.0)
    if joined:
        assert asyncio.run(joining.join_dht(cfg, [])) == "joined" and fake.tries == refusals + 1
        return
    with pytest.raises(JoinError, match=r"can't access this node.*\(3 tries\)$"):
        asyncio.run(joining.join_dht(cfg, []))
    assert fake.tries == joining.JOIN_TRIES == 3


def test_a_join_not_ready_within_its_timeout_says_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from peer import joining
    from protocol.net.dhtstart import DhtNotReady

    tries: list[float] = []

    def not_ready(timeout: float, **kwargs: Any) -> None:
        tries.append(timeout)
        raise DhtNotReady(f"the DHT's process was not ready within {timeout:.0f} s")

    monkeypatch.setattr(joining, "start_dht", not_ready)
    with pytest.raises(JoinError, match=r"^could not join the DHT within 30 s: "):
        asyncio.run(joining.join_dht(PeerConfig(["/ip4/127.0.0.1/tcp/1/p2p/Qm"], RUN, join_timeout=30.0), []))
    assert len(tries) == 1 and 29 < tries[0] <= 30  # the join's own timeout is the DHT's deadline


def test_a_join_that_fails_otherwise_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from peer import joining

    tries: list[int] = []

    def wrong_run(**kwargs: Any) -> None:
        tries.append(1)
        raise Exception("the record validators do not match")

    monkeypatch.setattr(joining, "start_dht", wrong_run)
    with pytest.raises(JoinError, match=r"through /ip4/127\.0\.0\.1/tcp/1/p2p/Qm: the record validators do not match$"):
        asyncio.run(joining.join_dht(PeerConfig(["/ip4/127.0.0.1/tcp/1/p2p/Qm"], RUN), []))
    assert len(tries) == 1
