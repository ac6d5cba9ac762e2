"""Moving a message stream that opened over libp2p onto the direct data path once it
can go there, without reordering its frames.

A stream's first frame often goes before the direct path is open to it: a peer greets
the coordinator before the coordinator has admitted it (no ticket yet), the coordinator
writes to a peer before its dial-back reached it, a bandwidth probe sent before the
plan had its ticket refused (no ticket asked for a while: ``REFUSED_RETRY_S``). The stream is
persistent, so without this it stayed on libp2p for the whole run: every frame through
both p2p daemons (measured: the demo's four daemons at 2-3.6% of a core each, and half
its boundaries and every commit a daemon hop slower).

The sender (``Upgrades``): at a write to a peer whose message stream runs over libp2p,
where a direct stream may be tried now, it opens one on the side; once open, it takes
the old stream's place under the stream's lock and the old one is closed, its frames
written before the close.

The receiver (``InOrder``): a sender's message streams are read one after the other.
A new stream's frames wait until the sender's previous stream has ended (its close,
after its last frame): so a frame sent on the direct stream cannot overtake one still
crossing the daemons (an assignment and the step after it, say). The wait gives up once
no byte came from the sender for ``FENCE_S`` (a previous stream left half-open on a dead
path), or after ``FENCE_MAX_S`` in all; a slow link still delivering the old stream's
tail is waited for."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from protocol.net.direct import Direct, Streams

logger = logging.getLogger(__name__)

#: a sender's new message stream waits for its previous one to end while bytes keep
#: coming from the sender, until none came for ``FENCE_S`` (a previous stream half-open
#: on a dead path ends by itself only at its read timeout), and ``FENCE_MAX_S`` at most
FENCE_S = 2.0
FENCE_MAX_S = 60.0
#: a move that found no direct stream is tried again no sooner than this (``direct``'s own
#: waits after a refusal or a failed dial are longer; this one covers a peer with no IP address)
NOTHING_TO_DIAL_S = 5.0


class InOrder:
    """Each sender's message streams, read in the order they opened. ``heard(sender)``:
    when bytes last arrived from it (``time.monotonic``)."""

    def __init__(self, heard: Callable[[str], float], clock: Callable[[], float] = time.monotonic) -> None:
        self.heard = heard
        self.clock = clock
        self._last: dict[str, asyncio.Future[None]] = {}  # sender -> its latest stream's end

    @contextlib.asynccontextmanager
    async def turn(self, sender: str) -> AsyncIterator[None]:
        """Enter once the sender's previous message stream has ended (see ``FENCE_S``);
        the body reads this one."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before = self._last.get(sender)
        self._last[sender] = done
        try:
            if before is not None:
                await self._after(before, sender)
            yield
        finally:
            done.set_result(None)
            if self._last.get(sender) is done:
                del self._last[sender]

    async def _after(self, before: asyncio.Future[None], sender: str) -> None:
        """Until ``before`` is done, or the sender has sent nothing for ``FENCE_S``."""
        limit = self.clock() + FENCE_MAX_S
        while not before.done():
            await asyncio.wait({before}, timeout=FENCE_S)
            idle = self.clock() - self.heard(sender) >= FENCE_S
            if not before.done() and (idle or self.clock() >= limit):
                logger.info("reading a new message stream of %s before its previous one ended", sender)
                return


class Upgrades:
    """The sender's side: ``maybe(peer)`` at each write on ``peer``'s message stream.

    ``streams`` and ``locks`` are the transport's (key ``peer`` is the message stream);
    ``stay(peer)``: whether the peer's stream must stay as it is (already direct, behind
    a NAT, forwarded); ``addrs(peer)``: where to dial it; ``ask``: a ticket over libp2p;
    ``now_direct(peer)``: called once the direct stream took the old one's place."""

    def __init__(
        self,
        direct: Direct,
        protocol: str,
        streams: dict[str, Streams],
        locks: dict[str, asyncio.Lock],
        stay: Callable[[str], bool],
        addrs: Callable[[str], Awaitable[list[str]]],
        ask: Callable[[str], Awaitable[bytes]],
        now_direct: Callable[[str], Any],
    ) -> None:
        self.direct, self.protocol, self.streams, self.locks = direct, protocol, streams, locks
        self.stay, self.addrs, self.ask, self.now_direct = stay, addrs, ask, now_direct
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._next: dict[str, float] = {}  # peer -> when a move that found nothing to dial may be tried again
        self.closed = False

    def maybe(self, peer: str) -> None:
        """Start moving ``peer``'s message stream onto the direct path, where it may go
        there now and no move is under way."""
        if self.closed or peer in self._tasks or self.stay(peer) or not self.direct.worth_trying(peer, self.protocol):
            return
        if self._next.get(peer, 0.0) > self.direct.clock():
            return
        self._tasks[peer] = asyncio.get_running_loop().create_task(self._move(peer))

    async def _move(self, peer: str) -> None:
        new: Streams | None = None
        placed = False
        try:
            new = await self.direct.open(peer, self.protocol, await self.addrs(peer), self.ask)
            if new is None:  # refused or not reached: ``direct`` says when to try again
                if self.direct.worth_trying(peer, self.protocol):  # no address to dial: no wait set
                    self._next[peer] = self.direct.clock() + NOTHING_TO_DIAL_S
                return
            async with self.locks[peer]:
                old = self.streams.get(peer)
                if old is None or self.stay(peer):  # closed or replaced meanwhile
                    return
                self.streams[peer], placed = new, True
                self.now_direct(peer)
                old[1].close()  # after the frames written on it: the receiver reads them first
            await self._close_lanes(peer)
            logger.debug("the message stream to %s moved onto the direct path", peer)
        except Exception as exc:  # noqa: BLE001 - the libp2p stream goes on as it was
            logger.debug("could not move the message stream to %s onto the direct path: %s", peer, exc)
        finally:
            if new is not None and not placed:
                new[1].close()
            self._tasks.pop(peer, None)

    async def _close_lanes(self, peer: str) -> None:
        """The peer's lane streams: a direct stream carries large frames whole."""
        for key in [k for k in self.streams if k.startswith(peer + "/lane")]:
            async with self.locks[key]:  # after a lane part being written
                lane = self.streams.pop(key, None)
            if lane is not None:
                lane[1].close()

    def drop(self, peer: str) -> None:
        """Stop a move to ``peer`` under way (it left, or was muted)."""
        task = self._tasks.pop(peer, None)
        if task is not None:
            task.cancel()

    def cancel(self) -> None:
        """Stop every move under way, and start none (the transport is closing)."""
        self.closed = True
        for task in list(self._tasks.values()):
            task.cancel()
