"""The coordinator's inbox discipline, without a network: only the peers it awaits
may answer, and only the last stage's losses count."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.assign import Assignment
from coordinator.swarm import Coordinator, CoordinatorConfig, SwarmError
from protocol.graph import Cut
from protocol.job import JobSpec
from protocol.messages import PeerFailure, StepDone
from protocol.transport import Inbound
from protocol.wire import Frame


def _coordinator() -> Coordinator:
    coord = Coordinator(CoordinatorConfig(job=JobSpec(), run_id="r", status=False))
    coord.transport = SimpleNamespace(inbox=asyncio.Queue())  # type: ignore[assignment]
    coord._assignment = Assignment(Cut((5,)), [["p0"], ["p1"]])
    return coord


def _inbound(sender: str, message: object) -> Inbound:
    return Inbound(sender, message, Frame({"values": []}, memoryview(b"")))  # type: ignore[arg-type]


def test_only_awaited_peers_answer() -> None:
    async def go() -> None:
        coord = _coordinator()
        inbox = coord.transport.inbox  # type: ignore[union-attr]
        forged = StepDone("r", 0, 1, 0, {"0": 0.001})
        await inbox.put(_inbound("intruder", forged))  # admitted by a hello, but not in the plan
        await inbox.put(_inbound("p0", StepDone("r", 0, 0, 0)))  # in the plan, already answered
        await inbox.put(_inbound("p1", StepDone("r", 0, 1, 0, {"0": 2.5})))
        got = await coord._next((StepDone,), 5, {"p1"})
        assert got.sender == "p1" and got.message.losses == {"0": 2.5}

    asyncio.run(go())


def test_failure_of_a_planned_peer_stops_the_run_and_strangers_are_ignored() -> None:
    async def go() -> None:
        coord = _coordinator()
        inbox = coord.transport.inbox  # type: ignore[union-attr]
        await inbox.put(_inbound("intruder", PeerFailure("r", 0, "made up")))
        await inbox.put(_inbound("p0", PeerFailure("r", 0, "next stage unreachable")))
        with pytest.raises(SwarmError, match="p0 \\(stage 0, replica 0\\) failed: next stage unreachable"):
            await coord._next((StepDone,), 5, {"p1"})

    asyncio.run(go())
