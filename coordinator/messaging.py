"""The coordinator's mailbox for one run: sends that turn an unreachable peer into a
lost one, the inbox loop every phase waits in (heartbeats, failure reports,
checkpoint parts, dead and stalled peers), the link watcher, and the tasks it runs
on the side. It owns what it learns of the peers' health: when each was last
heard, failures found between phases, peers that lost their stage, evictions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from coordinator import replan
from coordinator.host import Host
from coordinator.outcome import SwarmError
from coordinator.runstate import EXCLUDED, PeerLost, RunState
from protocol.net.clock import Clock
from protocol.net.outgoing import Outgoing
from protocol.net.tasks import cancel_all, every, log_failure, wait_until
from protocol.net.transport import Inbound, PeerUnreachable, Transport
from protocol.trust.text import clean
from protocol.wire.gate import poisoned_frame
from protocol.wire.messages import Beat, Evict, Hello, Message, PeerFailure, State

logger = logging.getLogger(__name__)

#: how long a peer reported unreachable has to show a sign of life (peers beat every second)
BLAME_WAIT_S = 2.5
#: peers that must report the same failure of the model's own code before the run stops on it
MODEL_FAILURE_WITNESSES = 2
#: how often the inbox loop looks at the peers' health while nothing arrives
HEALTH_POLL_S = 0.25
#: how often the link watcher looks for dropped connections
LINK_WATCH_S = 0.5


T = TypeVar("T")


async def get_within(queue: asyncio.Queue[T], seconds: float, clock: Clock) -> T | None:
    """The next item of ``queue``, or None once ``seconds`` have passed on ``clock``
    without one. An item already waiting is taken after one turn of the loop (others
    run between items, as they would while waiting)."""
    if not queue.empty():
        await asyncio.sleep(0)  # a yield, not a wait
        return None if queue.empty() else queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    nap = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({get, nap}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        nap.cancel()
        if not get.done():
            get.cancel()  # an item not taken stays in the queue
    return get.result() if get.done() and not get.cancelled() else None


async def send_each(
    transport: Transport, messages: Mapping[str, Message], within: float, at_once: int
) -> dict[str, str]:
    """Send each peer of ``messages`` its message (no payload), ``at_once`` sends at a
    time, started in the mapping's order, each given ``within`` seconds; each distinct
    message object is sealed (signed) once and the same frame goes to every peer it is
    for (a frame names no receiver; each receiver's replay window sees it once). The
    peers it did not reach (gone, stopped or too slow), with why."""
    slots = asyncio.Semaphore(at_once)
    missed: dict[str, str] = {}
    sealed: dict[int, Outgoing] = {}

    async def one(peer: str, msg: Message) -> None:
        async with slots:
            try:
                frame = sealed.get(id(msg))
                if frame is None:
                    frame = sealed[id(msg)] = transport.prepare(peer, msg)
                async with asyncio.timeout(within):  # no task of its own, as wait_for makes
                    await transport.transmit(dataclasses.replace(frame, peer_id=peer))
            except (PeerUnreachable, ConnectionError, asyncio.TimeoutError) as exc:
                missed[peer] = str(exc) or "send timed out"

    await asyncio.gather(*(one(p, m) for p, m in messages.items()))
    return missed


class Mailbox:
    def __init__(self, host: Host, st: RunState, clock: Clock, on_event: Callable[[str], None]) -> None:
        self.host = host
        self.cfg = host.config
        self.st = st
        self.clock = clock
        self.on_event = on_event
        self.failed: dict[str, str] = {}  # found between phases (link watcher, bans), not yet handled
        self.rejoined: set[str] = set()  # planned peers that said hello again (their stage is gone)
        self.last_heard: dict[str, float] = {}  # peer -> when it was last heard (clock seconds)
        self.model_failures: dict[tuple[int, str], set[str]] = {}  # (step, reason) -> reporters
        self._evicted: set[str] = set()
        self._side: set[asyncio.Task[Any]] = set()  # tasks on the side (``background``)
        self._polls: list[Callable[[], None]] = []
        self._parts: list[Callable[[Inbound], None]] = []

    def on_wait(self, poll: Callable[[], None]) -> None:
        """Call ``poll`` each time the inbox loop turns (it may raise ``PeerLost``)."""
        self._polls.append(poll)

    def on_part(self, take: Callable[[Inbound], None]) -> None:
        """Hand checkpoint state that arrives to ``take``."""
        self._parts.append(take)

    @property
    def transport(self) -> Transport:
        assert self.host.transport is not None
        return self.host.transport

    # ------------------------------------------------------------------ sends
    async def send(self, peer: str, msg: Message, values: list[Any] | None = None) -> None:
        """Send to a planned peer; a peer that cannot be reached is lost."""
        try:
            await asyncio.wait_for(self.transport.send(peer, msg, values), self.cfg.send_timeout_s)
        except (PeerUnreachable, asyncio.TimeoutError) as exc:
            raise PeerLost({peer: f"unreachable: {exc or 'send timed out'}"}) from None

    async def send_quietly(self, peer: str, msg: Message) -> None:
        try:
            await self.send(peer, msg)
        except PeerLost as exc:
            logger.info("%s", exc)

    async def tell(self, peers: Collection[str], msg: Message, within: float, at_once: int) -> set[str]:
        """Send ``msg`` to each of ``peers``, ``at_once`` sends at a time, each given
        ``within`` seconds; the peers it did not reach (gone, stopped or too slow: skipped)."""
        missed = await send_each(self.transport, dict.fromkeys(peers, msg), within, at_once)
        for peer, why in missed.items():
            logger.info("could not tell %s the %s: %s", peer, msg.KIND, why)
        return set(missed)

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the side; its failure is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._side.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._side.discard)
        task.add_done_callback(log_failure)

    async def close(self, grace: float) -> None:
        """End the tasks on the side (within ``grace`` seconds each)."""
        await cancel_all(self._side, grace)

    # ------------------------------------------------------------------ the inbox loop
    async def next(
        self, kinds: tuple[type[Message], ...], peers: set[str], until: Callable[[], bool] | None = None
    ) -> Any:
        """The next message of ``kinds`` of this epoch from one of ``peers``; meanwhile
        take checkpoint parts, heartbeats and failure reports, and watch for dead and
        stalled peers (raising PeerLost). Returns None once ``until()`` holds."""
        deadline = self.clock.now() + self.cfg.step_timeout_s
        while True:
            for poll in self._polls:  # spot checks of the last step, under way
                poll()
            if until is not None and until():
                return None
            inbox = self.transport.inbox
            if inbox.empty():  # health only once what arrived is read: queued beats count
                self.check_health()
                if self.clock.now() > deadline:  # alive (beating) but stuck: drop who we wait for
                    why = f"no progress for {self.cfg.step_timeout_s:.0f} s"
                    raise PeerLost(dict.fromkeys(peers or self.st.planned, why))
            inbound = await self._get(inbox)
            if inbound is None:
                continue
            found = await self._take(inbound)
            if found and isinstance(inbound.message, kinds) and inbound.sender in peers:
                return inbound

    async def _get(self, inbox: asyncio.Queue[Inbound]) -> Inbound | None:
        """The next inbound message, or None after ``HEALTH_POLL_S`` without one."""
        return await get_within(inbox, HEALTH_POLL_S, self.clock)

    async def _take(self, inbound: Inbound) -> bool:
        """Handle what any phase handles the same way; True if the caller may want it."""
        st, msg, sender = self.st, inbound.message, inbound.sender
        self.last_heard[sender] = self.clock.now()
        self.host.board.heard_from(sender)
        if getattr(msg, "run_id", None) != self.cfg.run_id:
            return False
        if isinstance(msg, Hello):
            if msg.again and sender in st.planned:  # it lost its session with us, and with it its stage
                self.rejoined.add(sender)
                raise PeerLost({sender: "it dropped its stage (it lost the coordinator and said hello again)"})
            if sender in st.lost:  # back after a stall, or restarted: a fresh standby peer
                self.back(sender)
            return False
        if isinstance(msg, Beat):
            return False
        if sender not in st.planned:
            logger.warning("ignoring a %s from %s, who is not in the plan", msg.KIND, sender)
            return False
        if isinstance(msg, PeerFailure):
            if msg.epoch != st.epoch or msg.suspect in st.lost:
                return False  # about an epoch that already ended, or a peer already dropped
            if msg.model:
                self._model_failed(sender, msg.reason)
            raise PeerLost(await self._blame(sender, msg, inbound))
        if isinstance(msg, State) and msg.checkpoint:
            for take in self._parts:
                take(inbound)
            return False
        return getattr(msg, "epoch", st.epoch) == st.epoch

    def _model_failed(self, sender: str, reason: str) -> None:
        """A peer says the model's own code raised: the run stops with that line once a
        second peer says the same at the same step (one peer alone may be lying or
        broken: it is dropped, and another runs its stage)."""
        said = self.model_failures.setdefault((self.st.step, clean(reason)[:300]), set())
        said.add(sender)
        if len(said) >= MODEL_FAILURE_WITNESSES:
            raise SwarmError(f"the run cannot go on: {clean(reason)[:300]} (reported by {len(said)} peers)")

    def back(self, peer: str) -> None:
        """A dropped peer said hello again: it waits as a fresh standby peer (unless it
        was excluded for what it sent: that is for the rest of the run)."""
        if self.st.lost.get(peer, "").startswith(EXCLUDED):
            return
        self.st.lost.pop(peer, None)
        self._evicted.discard(peer)
        self.host.board.peer_state(peer, "standby")
        self.on_event(f"peer {peer} is back; it waits as standby")

    async def _blame(self, reporter: str, msg: PeerFailure, inbound: Inbound) -> dict[str, str]:
        """A peer reported that it cannot reach ``suspect``: the suspect is lost if the
        coordinator cannot reach it either, or if it shows no sign of life (a
        heartbeat, any bytes) within ``BLAME_WAIT_S``; a suspect that does is alive,
        and the reporter is the one that failed. (A process killed a moment ago may
        still have its connection for a fraction of a second: its silence decides.)"""
        suspect = msg.suspect
        if not suspect or suspect not in self.st.planned:
            return {reporter: msg.reason}
        if msg.poison:  # the suspect's own signed frame must show the NaN, or the reporter lied
            if poisoned_frame(self.cfg.run_id, suspect, self.host.gate.signer_key(suspect), inbound.values()):
                return {suspect: f"{EXCLUDED}{msg.reason[:200]} (reported by {reporter}, its signed frame checked)"}
            return {
                reporter: f"{EXCLUDED}it reported poison from {suspect} that the signed frame it sent does not show"
            }
        reported = self.clock.now()
        lost = {suspect: f"unreachable (reported by {reporter}: {msg.reason})"}

        async def verdict() -> dict[str, str] | None:
            if not await self.host.reachable(suspect):
                return lost
            if self.transport.last_activity.get(suspect, 0.0) > reported:
                return {reporter: msg.reason}
            return None

        return await wait_until(verdict, BLAME_WAIT_S, interval=0.1, clock=self.clock) or lost

    # ------------------------------------------------------------------ health
    def heard_all(self, peers: set[str]) -> None:
        """``peers`` count as heard from now (their stall clock starts)."""
        self.last_heard.update(dict.fromkeys(peers, self.clock.now()))

    def fail(self, peer: str, why: str) -> None:
        """Drop a planned peer at the next health check (as if its link had died)."""
        self.failed.setdefault(peer, why)

    def failed_among(self, peers: set[str]) -> dict[str, str]:
        """The peers of ``peers`` known to have failed, with why."""
        return {p: why for p, why in self.failed.items() if p in peers}

    def check_health(self) -> None:
        st = self.st
        failed = self.failed_among(st.planned)
        if failed:
            raise PeerLost(failed)
        stalled = self.stalled_among(st.planned)
        if stalled:
            raise PeerLost(stalled)

    def stalled_among(self, peers: Iterable[str]) -> dict[str, str]:
        """The peers of ``peers`` silent (no message read, no byte received) for longer
        than the stall bound (``replan.stall_seconds``), with why. Bytes count as they
        arrive, read or not: a wait that does not read the inbox (a spot check's) may ask."""
        bound = replan.stall_seconds(self.st.step_seconds, self.cfg.stall_floor_s)
        now, activity = self.clock.now(), self.transport.last_activity
        heard = {p: max(self.last_heard.get(p, now), activity.get(p, 0.0)) for p in peers}
        return {
            p: f"stalled: silent for {now - t:.0f} s (limit {bound:.0f} s)" for p, t in heard.items() if now - t > bound
        }

    async def watch_links(self) -> None:
        """Planned peers whose connection dropped and who cannot be reached again."""

        async def look() -> None:
            connected = await self.transport.connected()
            for p in self.st.planned - connected - set(self.failed) - set(self.st.lost):
                if not await self.host.reachable(p):
                    self.failed[p] = "its connection dropped and it cannot be reached"

        await every(LINK_WATCH_S, look, what="link watch", clock=self.clock)

    def on_reject(self, sender: str, code: str, detail: str) -> None:
        """A dropped peer's frames of an older epoch: tell it to leave its stage."""
        st = self.st
        if code == "stale_epoch" and sender in st.lost and sender not in st.planned and sender not in self._evicted:
            self._evicted.add(sender)
            reason = f"dropped from the plan ({st.lost[sender]}); the run is at epoch {st.epoch}"
            msg = Evict(self.cfg.run_id, reason, st.epoch)
            self.background(self.send_quietly(sender, msg))
