"""The coordinator driver's message side: sends that turn an unreachable peer into
a lost one, the inbox loop every phase waits in (heartbeats, failure reports,
checkpoint parts, dead and stalled peers), and the link watcher."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordinator import replan
from coordinator.outcome import SwarmError
from coordinator.runstate import EXCLUDED, DriverParts, PeerLost
from protocol.net.tasks import honour_cancel, log_failure
from protocol.net.transport import Inbound, PeerUnreachable
from protocol.trust.text import clean
from protocol.wire.gate import poisoned_frame
from protocol.wire.messages import Beat, Evict, Hello, Message, PeerFailure, State

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

#: how long a peer reported unreachable has to show a sign of life (peers beat every second)
BLAME_WAIT_S = 2.5
#: peers that must report the same failure of the model's own code before the run stops on it
MODEL_FAILURE_WITNESSES = 2


class Messaging(DriverParts):
    """Mixed into :class:`coordinator.run.Driver`."""

    _failed: dict[str, str]
    _evicted: set[str]
    _rejoined: set[str]
    _side: set[asyncio.Task[Any]]  # tasks on the side (``_background``)

    async def _send(self, peer: str, msg: Message, values: list[Any] | None = None) -> None:
        """Send to a planned peer; a peer that cannot be reached is lost."""
        assert self.coord.transport is not None
        try:
            await asyncio.wait_for(self.coord.transport.send(peer, msg, values), self.cfg.send_timeout_s)
        except (PeerUnreachable, asyncio.TimeoutError) as exc:
            raise PeerLost({peer: f"unreachable: {exc or 'send timed out'}"}) from None

    async def _send_quietly(self, peer: str, msg: Message) -> None:
        try:
            await self._send(peer, msg)
        except PeerLost as exc:
            logger.info("%s", exc)

    async def _next(
        self, kinds: tuple[type[Message], ...], peers: set[str], until: Callable[[], bool] | None = None
    ) -> Any:
        """The next message of ``kinds`` of this epoch from one of ``peers``; meanwhile
        take checkpoint parts, heartbeats and failure reports, and watch for dead and
        stalled peers (raising PeerLost). Returns None once ``until()`` holds."""
        assert self.coord.transport is not None
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while True:
            self._audit_outcome()  # type: ignore[attr-defined]  # spot checks of the last step, under way
            if until is not None and until():
                return None
            inbox = self.coord.transport.inbox
            if inbox.empty():  # health only once what arrived is read: queued beats count
                self._check_health()
                if time.monotonic() > deadline:  # alive (beating) but stuck: drop who we wait for
                    why = f"no progress for {self.cfg.step_timeout_s:.0f} s"
                    raise PeerLost(dict.fromkeys(peers or self.st.planned, why))
            try:
                inbound = await asyncio.wait_for(inbox.get(), 0.25)
            except asyncio.TimeoutError:
                continue
            found = await self._take(inbound)
            if found and isinstance(inbound.message, kinds) and inbound.sender in peers:
                return inbound

    async def _take(self, inbound: Inbound) -> bool:
        """Handle what any phase handles the same way; True if the caller may want it."""
        st, msg, sender = self.st, inbound.message, inbound.sender
        st.last_heard[sender] = time.monotonic()
        self.coord.board.heard_from(sender)
        if getattr(msg, "run_id", None) != self.cfg.run_id:
            return False
        if isinstance(msg, Hello):
            if msg.again and sender in st.planned:  # it lost its session with us, and with it its stage
                self._rejoined.add(sender)
                raise PeerLost({sender: "it dropped its stage (it lost the coordinator and said hello again)"})
            if sender in st.lost:  # back after a stall, or restarted: a fresh standby peer
                self._back(sender)
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
            self._take_part(inbound)
            return False
        return getattr(msg, "epoch", st.epoch) == st.epoch

    def _model_failed(self, sender: str, reason: str) -> None:
        """A peer says the model's own code raised: the run stops with that line once a
        second peer says the same at the same step (one peer alone may be lying or
        broken: it is dropped, and another runs its stage)."""

        said = self.st.model_failures.setdefault((self.st.step, clean(reason)[:300]), set())
        said.add(sender)
        if len(said) >= MODEL_FAILURE_WITNESSES:
            raise SwarmError(f"the run cannot go on: {clean(reason)[:300]} (reported by {len(said)} peers)")

    def _back(self, peer: str) -> None:
        """A dropped peer said hello again: it waits as a fresh standby peer (unless it
        was excluded for what it sent: that is for the rest of the run)."""
        if self.st.lost.get(peer, "").startswith(EXCLUDED):
            return
        self.st.lost.pop(peer, None)
        self._evicted.discard(peer)
        self.coord.board.peer_state(peer, "standby")
        self.on_event(f"peer {peer} is back; it waits as standby")

    def _background(self, coro: Any) -> None:
        """Run ``coro`` on the side; its failure is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._side.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._side.discard)
        task.add_done_callback(log_failure)

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
            if poisoned_frame(self.cfg.run_id, suspect, self.coord.gate.signer_key(suspect), inbound.values()):
                return {suspect: f"{EXCLUDED}{msg.reason[:200]} (reported by {reporter}, its signed frame checked)"}
            return {
                reporter: f"{EXCLUDED}it reported poison from {suspect} that the signed frame it sent does not show"
            }
        reported = time.monotonic()
        lost = {suspect: f"unreachable (reported by {reporter}: {msg.reason})"}
        while time.monotonic() - reported < BLAME_WAIT_S:
            if not await self.coord.reachable(suspect):
                return lost
            if self.coord.transport.last_activity.get(suspect, 0.0) > reported:
                return {reporter: msg.reason}
            await asyncio.sleep(0.1)
        return lost

    def _check_health(self) -> None:
        st = self.st
        failed = {p: why for p, why in self._failed.items() if p in st.planned}
        if failed:
            raise PeerLost(failed)
        bound = replan.stall_seconds(st.step_seconds, self.cfg.stall_floor_s)
        now = time.monotonic()
        activity = self.coord.transport.last_activity
        heard = {p: max(st.last_heard.get(p, now), activity.get(p, 0.0)) for p in st.planned}
        stalled = {
            p: f"stalled: silent for {now - heard[p]:.0f} s (limit {bound:.0f} s)"
            for p in st.planned
            if now - heard[p] > bound
        }
        if stalled:
            raise PeerLost(stalled)

    async def _watch_links(self) -> None:
        """Planned peers whose connection dropped and who cannot be reached again."""
        while True:
            await asyncio.sleep(0.5)
            try:
                connected = await self.coord.transport.connected()
                for p in self.st.planned - connected - set(self._failed) - set(self.st.lost):
                    if not await self.coord.reachable(p):
                        self._failed[p] = "its connection dropped and it cannot be reached"
            except Exception as exc:  # the daemon may hiccup; the next round retries
                honour_cancel()
                logger.debug("link watch failed: %s", exc)

    def _on_reject(self, sender: str, code: str, detail: str) -> None:
        """A dropped peer's frames of an older epoch: tell it to leave its stage."""
        st = self.st
        if code == "stale_epoch" and sender in st.lost and sender not in st.planned and sender not in self._evicted:
            self._evicted.add(sender)
            reason = f"dropped from the plan ({st.lost[sender]}); the run is at epoch {st.epoch}"
            msg = Evict(self.cfg.run_id, reason, st.epoch)
            self._background(self._send_quietly(sender, msg))
