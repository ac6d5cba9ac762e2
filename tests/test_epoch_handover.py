"""A peer's hand-over from one plan epoch to the next, driven through ``PeerNode``'s
routing and serve loop with a stand-in epoch runner and compute: every runner
started reads its own epoch's messages, an assignment that a newer one overtook is
not served, an eviction leaves a newer epoch's assignment (and its heartbeats) in
place, and an epoch that fails just as a control item arrives is still reported.

(The bug: a CI run hung in test_pinning's allowlist test. A replica refused its
stage and the coordinator re-planned at once; the other replica's next assignment
arrived while its serve loop was still stopping the last epoch for the first one.
The first epoch's runner then got the newer epoch's mailbox, took its stage
program, and the newer epoch's runner waited out its 600 s message timeout for a
program that had come; the coordinator waited 300 s for its Ready.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from peer.checks import PlanChecks
from peer.config import PeerConfig
from peer.mailbox import Mailbox
from peer.node import PeerNode
from peer.stage import ForeignCode, RunRefused
from protocol.net.clock import FakeClock
from protocol.net.transport import Inbound
from protocol.wire.encoding import Frame
from protocol.wire.gate import Gate
from protocol.wire.messages import Assign, Beat, Evict, Message, PeerFailure, StageProgram, Standby
from protocol.wire.reassign import Reassign

RUN = "r"


class _Link:
    """The coordinator link, quiet: no watch or heartbeat ever fires; it keeps the
    failures reported and counts the hellos said again."""

    peer_id, key, reattaching = "coord", None, False

    def __init__(self) -> None:
        self.reports: list[PeerFailure] = []
        self.hellos = 0
        self.asked: list[int] = []  # the epochs whose whole assignment this peer asked for

    async def ask_whole(self, run_id: str, epoch: int) -> None:
        self.asked.append(epoch)

    async def hello(self, again: bool = True) -> None:
        self.hellos += 1

    async def report(self, failure: PeerFailure, evidence: Any = None) -> None:
        self.reports.append(failure)

    async def watch(self, lost: Callable[[str], None]) -> None:
        await asyncio.Event().wait()

    async def beat(self, beat: Callable[[], Any]) -> None:
        await asyncio.Event().wait()


class _Transport:
    def __init__(self) -> None:
        self.gate = Gate(RUN)

    async def aclose(self) -> None:
        pass


class _Compute:
    """The compute thread's calls run at once, on the loop (the test is loop turns only)."""

    async def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def shutdown(self) -> None:
        pass


class _Runner:
    """Reads its epoch's stage program (``read``: (its epoch, the program's)), then
    serves, or refuses the stage (raises ``refuse[its epoch]``)."""

    read: list[tuple[int, int]] = []
    refuse: dict[int, Exception] = {}

    def __init__(self, host: Any, env: Any, a: Assign, mailbox: Mailbox) -> None:
        self.a, self.mailbox = a, mailbox

    async def run(self) -> None:
        inb = await self.mailbox.get("program")
        _Runner.read.append((self.a.epoch, inb.message.epoch))
        if self.a.epoch in _Runner.refuse:
            raise _Runner.refuse[self.a.epoch]
        await asyncio.Event().wait()


def _inbound(msg: Message) -> Inbound:
    return Inbound("coord", msg, Frame({"values": []}, memoryview(b"")))


def _assign(epoch: int) -> Inbound:
    return _inbound(Assign(RUN, 0, 0, {}, [], [["me"]], [1], {}, epoch=epoch, restore="state", program=True))


def _program(epoch: int) -> Inbound:
    return _inbound(StageProgram(RUN, 0, [], epoch))


def _node(monkeypatch: Any) -> PeerNode:
    monkeypatch.setattr("peer.node.EpochRunner", _Runner)
    _Runner.read, _Runner.refuse = [], {}
    node = PeerNode(PeerConfig([], RUN), clock=FakeClock())
    node.transport, node.link, node.checks = _Transport(), _Link(), PlanChecks("coord")  # type: ignore[assignment]
    node.compute = _Compute()  # type: ignore[assignment]
    return node


async def _turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _arriving_while_stopping(node: PeerNode, later: list[Inbound]) -> None:
    """``later`` arrives while the serve loop stops the last epoch for the first control
    item (the window: the loop has taken the first assignment, not yet served it)."""
    stop = node._stop_epoch

    async def stop_then_arrive() -> None:
        await stop()
        while later:
            node._route(later.pop(0))

    node._stop_epoch = stop_then_arrive  # type: ignore[method-assign]


@pytest.mark.parametrize("starved", [True, False], ids=["both-queued-before-the-loop-runs", "while-it-stops"])
def test_an_assignment_overtaken_by_the_next_epochs_is_not_served(monkeypatch: Any, starved: bool) -> None:
    """Epoch 1's assignment and program arrive before the serve loop served epoch 0's:
    queued with it (the peer's process starved while the coordinator re-planned: the
    CI hang), or while the loop stops the last epoch for it. Only epoch 1 is served,
    and its runner reads epoch 1's program."""

    async def main() -> tuple[list[tuple[int, int]], list[str]]:
        node = _node(monkeypatch)
        told: list[str] = []
        node.on_event = told.append
        later = [_assign(1), _program(1)]
        for inbound in [_assign(0), _program(0), *(later if starved else [])]:
            node._route(inbound)
        if not starved:
            _arriving_while_stopping(node, later)
        serving = asyncio.create_task(node.serve())
        await _turns()
        serving.cancel()
        await node.aclose()
        return _Runner.read, told

    read, told = asyncio.run(main())
    assert read == [(1, 1)], read
    assert [t for t in told if "serving stage" in t] == ["epoch 1: serving stage 0 (replica 0) of 1 from step 0"]


def test_an_assignment_overtaken_by_a_standby_notice_is_not_served(monkeypatch: Any) -> None:
    """Epoch 1 leaves this peer out (Standby) while the loop stops for epoch 0's
    assignment: no runner starts, and the peer waits as standby."""

    async def main() -> tuple[list[tuple[int, int]], bool, list[str]]:
        node = _node(monkeypatch)
        told: list[str] = []
        node.on_event = told.append
        node._route(_assign(0))
        node._route(_program(0))
        _arriving_while_stopping(node, [_inbound(Standby(RUN, 1))])
        serving = asyncio.create_task(node.serve())
        await _turns()
        running = node._epoch_task is not None
        serving.cancel()
        await node.aclose()
        return _Runner.read, running, told

    read, running, told = asyncio.run(main())
    assert read == [] and not running, (read, told)
    assert told == ["epoch 1: the plan does not use this peer; waiting as standby"], told


def test_each_epoch_in_turn_reads_its_own_program(monkeypatch: Any) -> None:
    """Without an overtaking assignment, epoch 0 is served, then epoch 1 (the runners
    read their own epochs' programs)."""

    async def main() -> list[tuple[int, int]]:
        node = _node(monkeypatch)
        node._route(_assign(0))
        node._route(_program(0))
        serving = asyncio.create_task(node.serve())
        await _turns()
        node._route(_assign(1))
        node._route(_program(1))
        await _turns()
        serving.cancel()
        await node.aclose()
        return _Runner.read

    assert asyncio.run(main()) == [(0, 0), (1, 1)]


@pytest.mark.parametrize("when", ["queued-with-the-eviction", "while-it-stops", "served-before-it"])
def test_an_eviction_overtaken_by_a_newer_assignment_leaves_it_in_place(monkeypatch: Any, when: str) -> None:
    """Epoch 0's peer is evicted (the run is at epoch 1); epoch 2's assignment is routed
    before the eviction is handled, while it stops epoch 0, or even served before it.
    The coordinator took the peer back: the eviction leaves epoch 2's assignment and
    runner in place (the peer beats for epoch 2, which it serves) and says no hello
    again (that would drop it from epoch 2)."""

    async def main() -> tuple[list[tuple[int, int]], int, Beat | None, int]:
        node = _node(monkeypatch)
        node._route(_assign(0))
        node._route(_program(0))
        serving = asyncio.create_task(node.serve())
        await _turns()
        evict, later = _inbound(Evict(RUN, "stalled", 1)), [_assign(2), _program(2)]
        if when == "while-it-stops":
            _arriving_while_stopping(node, later)
            node._route(evict)
        else:
            for inbound in [*later, evict] if when == "served-before-it" else [evict, *later]:
                node._route(inbound)
                await _turns(50 if when == "served-before-it" else 0)
        await _turns()
        serving_epoch = node._task_epoch if node._epoch_task is not None and not node._epoch_task.done() else -1
        beat = node._beat()
        serving.cancel()
        await node.aclose()
        return _Runner.read, serving_epoch, beat, node.link.hellos  # type: ignore[union-attr]

    read, serving_epoch, beat, hellos = asyncio.run(main())
    assert read == [(0, 0), (2, 2)] and serving_epoch == 2, (read, serving_epoch)
    assert beat == Beat(RUN, 0, 2) and hellos == 0, (beat, hellos)


def test_an_eviction_drops_the_assignment_it_is_about(monkeypatch: Any) -> None:
    """Without a newer assignment the evicted peer stops serving, sends no heartbeats,
    and says hello again."""

    async def main() -> tuple[bool, Beat | None, int, list[str]]:
        node = _node(monkeypatch)
        told: list[str] = []
        node.on_event = told.append
        node._route(_assign(0))
        node._route(_program(0))
        serving = asyncio.create_task(node.serve())
        await _turns()
        node._route(_inbound(Evict(RUN, "stalled", 1)))
        await _turns()
        running, beat = node._epoch_task is not None, node._beat()
        serving.cancel()
        await node.aclose()
        return running, beat, node.link.hellos, told  # type: ignore[union-attr]

    running, beat, hellos, told = asyncio.run(main())
    assert not running and beat is None and hellos == 1, (running, beat, hellos)
    assert told[-1] == "dropped from the run: stalled; joining again as a standby peer", told


@pytest.mark.parametrize(
    ("refusal", "reason"),
    [(ForeignCode("no opt-in"), "refused the stage: no opt-in"), (RunRefused("a bad codec"), "a bad codec")],
    ids=["foreign", "other"],
)
def test_a_failure_ending_with_a_control_item_is_reported(monkeypatch: Any, refusal: Exception, reason: str) -> None:
    """Epoch 0 refuses its stage just as epoch 1's assignment arrives (the serve loop
    finds both at once): the refusal is reported for epoch 0; code this peer never
    runs ends its serving (exit code 2), any other refusal lets it serve epoch 1."""

    async def main() -> tuple[list[PeerFailure], int | None, list[tuple[int, int]]]:
        node = _node(monkeypatch)
        _Runner.refuse[0] = refusal
        node._route(_assign(0))
        serving = asyncio.create_task(node.serve())
        await _turns()
        node._route(_program(0))
        node._route(_assign(1))
        node._route(_program(1))
        await _turns()
        code = serving.result() if serving.done() else None
        serving.cancel()
        await node.aclose()
        return node.link.reports, code, _Runner.read  # type: ignore[union-attr]

    reports, code, read = asyncio.run(main())
    assert [(r.epoch, r.reason) for r in reports] == [(0, reason)], reports
    if isinstance(refusal, ForeignCode):
        assert code == 2 and read == [(0, 0)], (code, read)
    else:
        assert code is None and read == [(0, 0), (1, 1)], (code, read)


def test_an_epoch_told_as_what_changed_is_served_as_its_whole_assignment(monkeypatch: Any) -> None:
    """Epoch 1 comes as what changed since epoch 0's assignment (issue 33): the peer
    serves the assignment it builds, its runner reads epoch 1's program, and a repeat
    of it is ignored."""

    async def main() -> tuple[list[tuple[int, int]], Assign | None, list[int]]:
        node = _node(monkeypatch)
        node._route(_assign(0))
        node._route(_program(0))
        serving = asyncio.create_task(node.serve())
        await _turns()
        changed = _inbound(Reassign(RUN, 1, 0, {"start_step": 40, "restore": "keep"}))
        node._route(changed)
        node._route(_program(1))
        node._route(changed)
        await _turns()
        serving.cancel()
        await node.aclose()
        return _Runner.read, node.checks.assign if node.checks else None, node.link.asked  # type: ignore[union-attr]

    read, held, asked = asyncio.run(main())
    assert read == [(0, 0), (1, 1)] and asked == []
    assert held == Assign(RUN, 0, 0, {}, [], [["me"]], [1], {}, epoch=1, start_step=40, restore="keep", program=True)


@pytest.mark.parametrize(
    "before,reassign",
    [
        ([], Reassign(RUN, 1, 0, {})),  # nothing held (a restarted peer)
        ([_assign(0)], Reassign(RUN, 2, 1, {})),  # built on an epoch this peer did not serve
        ([_assign(0)], Reassign(RUN, 1, 0, {"sizes": [2]})),  # inconsistent once applied
        ([_assign(0), _inbound(Evict(RUN, "stalled", 0))], Reassign(RUN, 1, 0, {})),  # dropped since
    ],
    ids=["nothing-held", "another-base", "inconsistent", "evicted-since"],
)
def test_what_cannot_be_built_is_asked_for_whole(monkeypatch: Any, before: list[Inbound], reassign: Reassign) -> None:
    """A ``Reassign`` that does not build on what the peer holds enters no epoch: the
    peer asks for the whole assignment (``Resend``), which the coordinator sends."""

    async def main() -> tuple[list[int], int]:
        node = _node(monkeypatch)
        serving = asyncio.create_task(node.serve())
        for inbound in before:
            node._route(inbound)
            await _turns()
        node._route(_inbound(reassign))
        await _turns()
        serving.cancel()
        await node.aclose()
        return node.link.asked, node.epoch  # type: ignore[union-attr]

    asked, epoch = asyncio.run(main())
    assert asked == [reassign.epoch] and epoch < reassign.epoch
