"""What a peer advertises in the DHT (its measured speed, memory, links and
addresses, with a private swarm's certificate), published at the join and
refreshed before each copy expires, under its shard of the run's adverts (as many
shards as the coordinator's record says); and whether the coordinator could dial it
back (said in the advert from its next refresh on)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import hivemind
from hivemind.utils import get_dht_time

from peer.admission import Credentials
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.reach import HOW_TO_BE_REACHABLE
from protocol.net.records import Publisher
from protocol.net.tasks import every
from protocol.trust.identity import Identity
from protocol.trust.run_records import shard_name, shard_of
from protocol.trust.text import clean
from protocol.wire.messages import Advert, Reachability

logger = logging.getLogger(__name__)


class Adverts:
    """Publishes ``advert`` (set it first) every ``ttl / 3`` s, each copy valid for ``ttl``
    s, under shard ``shard_of(its peer id, shards())`` of the run's adverts."""

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
        self._publisher = Publisher(dht, identity, run_id, clock)  # under this peer's key

    async def publish(self) -> None:
        """Store the advert, signed, with this peer's certificate (if any), for ``ttl`` s."""
        assert self.advert is not None
        expires = get_dht_time() + self.ttl
        cert = self.credentials.certificate or {}
        ad = Advert(**{**self.advert.__dict__, "expires_at": expires, "cert": cert, "run_id": self.run_id})
        where = shard_name("adverts", shard_of(ad.peer_id, self.shards()))
        await self._publisher.publish(where, ad.header(), expires)

    async def refresh(self) -> None:
        """Publish again every ``ttl / 3`` s, forever (cancel to stop)."""

        # the DHT may hiccup; the next refresh retries
        await every(self.ttl / 3, self.publish, what="advert refresh", clock=self.clock, level=logging.WARNING)

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
