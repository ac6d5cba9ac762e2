"""What a peer advertises in the DHT (its measured speed, memory, links and
addresses, with a private swarm's certificate), published at the join and
refreshed before each copy expires, under its shard of the run's adverts (as many
shards as the coordinator's record says); and whether the coordinator could dial it
back (said in the advert from its next refresh on)."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable

import hivemind
from hivemind.utils import get_dht_time

from peer.admission import Credentials
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.reach import HOW_TO_BE_REACHABLE
from protocol.net.records import Publisher, refresh_period
from protocol.net.tasks import honour_cancel
from protocol.trust.identity import Identity
from protocol.trust.run_records import shard_name, shard_of
from protocol.trust.text import clean
from protocol.wire.messages import Advert, Reachability

logger = logging.getLogger(__name__)

#: how many of the last stores' durations a copy's lifetime allows for
RECENT_STORES = 3


class RefreshPace:
    """When an advert's copies are stored, and for how long each is stamped, so that a
    copy is still alive when the next one lands, on a swarm whose stores take seconds.
    A store on a loaded swarm takes seconds (a lookup of the key's nearest
    nodes, then each of them): stamped ``ttl`` from its start and repeated ``ttl / 3``
    after the previous store *returned*, a copy expired before the next one landed once
    two stores took ``ttl / 3`` each (at 80 nodes on 2 loaded cores they took 3-8 s, and
    lookups missed 10-30% of the adverts: every holder had dropped them as expired).
    So a refresh is due ``ttl / 3`` after the previous one *began* (at once where that
    store took longer), and a copy is stamped to live ``ttl`` plus the time the next copy
    may take to land after it: this store's and the next one's, each estimated as the
    longest of the last ``RECENT_STORES`` stores, at most ``ttl`` more in all. Copies so
    stay alive while stores take up to ``ttl / 2`` each and through one that takes ``ttl``
    while the recent ones took ``ttl / 3``; a vanished peer's last copy lingers at most
    ``2 * ttl``."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._took: deque[float] = deque(maxlen=RECENT_STORES)

    @property
    def period(self) -> float:
        """Seconds from one store's start to the next one's."""
        return refresh_period(self.ttl)

    def lifetime(self) -> float:
        """Seconds the copy stored now is stamped to live, from now."""
        return self.ttl + min(2 * max(self._took, default=0.0), self.ttl)

    def stored(self, took: float) -> None:
        """Note that a store took ``took`` s."""
        self._took.append(max(0.0, took))

    def wait(self, took: float) -> float:
        """Seconds to wait for the next store after one that began ``took`` s ago."""
        return max(0.0, self.period - took)


class Adverts:
    """Publishes ``advert`` (set it first) every ``ttl / 3`` s, each copy valid for ``ttl``
    s from when it lands (``RefreshPace``), under shard ``shard_of(its peer id,
    shards())`` of the run's adverts."""

    def __init__(
        self,
        run_id: str,
        ttl: float,
        dht: hivemind.DHT,
        identity: Identity,
        credentials: Credentials,
        say: Callable[[str], None],
        clock: Clock = SYSTEM_CLOCK,
        shards: Callable[[], int] = lambda: 1,
    ) -> None:
        self.run_id = run_id
        self.ttl = ttl
        self.dht = dht
        self.identity = identity
        self.credentials = credentials
        self.say = say
        self.clock = clock
        self.shards = shards
        self.advert: Advert | None = None
        self.pace = RefreshPace(ttl)
        self._began: float | None = None  # when the last publish began (clock time)
        self._publisher = Publisher(dht, identity, run_id, clock)  # under this peer's key

    async def publish(self) -> None:
        """Store the advert, signed, with this peer's certificate (if any), for ``ttl`` s
        (and the time the last stores took: ``RefreshPace.lifetime``)."""
        assert self.advert is not None
        expires = get_dht_time() + self.pace.lifetime()
        self._began = started = self.clock.now()
        cert = self.credentials.certificate or {}
        ad = Advert(**{**self.advert.__dict__, "expires_at": expires, "cert": cert, "run_id": self.run_id})
        where = shard_name("adverts", shard_of(ad.peer_id, self.shards()))
        try:
            await self._publisher.publish(where, ad.header(), expires)
        finally:
            self.pace.stored(self.clock.now() - started)

    async def refresh(self) -> None:
        """Publish again ``ttl / 3`` s after each publish began (the join's own too),
        forever (cancel to stop); a failed one is said and the next retries (the DHT may
        hiccup)."""
        while True:
            began = self._began
            await self.clock.sleep(self.pace.period if began is None else self.pace.wait(self.clock.now() - began))
            try:
                await self.publish()
            except Exception as exc:
                honour_cancel()
                logger.warning("advert refresh failed: %s", exc)

    def take_reachability(self, msg: Reachability) -> None:
        """Say whether the coordinator could dial this peer back, and what to do if not
        (and say it in the advert too, from its next refresh on)."""
        if self.advert is not None:
            self.advert = dataclasses.replace(self.advert, reach="direct" if msg.direct else "nat")
        if msg.direct:
            self.say(f"reachable: the coordinator {clean(msg.detail)[:200]}")
            return
        port = msg.ports[0] if msg.ports else "<port>"
        self.say(
            f"behind a NAT: the coordinator {clean(msg.detail)[:300]}. This peer dials out to the peers it works "
            f"with (peers that can be dialled forward frames between two that cannot). To be reachable: "
            + HOW_TO_BE_REACHABLE.format(port=port)
        )
