"""The coordinator's signed record in the run's DHT (``CoordinatorRecord``): where its
libp2p node is, which run it coordinates and how many shards the run's adverts are
cut into (``adverts.Sharding``: peers follow a re-shard from the next copy), republished
before it expires so that joining peers find it."""

from __future__ import annotations

import asyncio
import logging
import secrets

from hivemind.utils import get_dht_time

from coordinator.adverts import Sharding
from coordinator.roster import Endpoint
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.records import Publisher, refresh_period
from protocol.net.tasks import cancel_all, every
from protocol.wire.messages import CoordinatorRecord

logger = logging.getLogger(__name__)


class Beacon:
    """Publishes the coordinator's record now and every third of its lifetime."""

    def __init__(
        self, run_id: str, ttl: float, endpoint: Endpoint, clock: Clock = SYSTEM_CLOCK, sharding: Sharding | None = None
    ) -> None:
        self.run_id, self.ttl, self.endpoint, self.clock = run_id, ttl, endpoint, clock
        self.sharding = sharding  # None: one shard
        self._refresh: asyncio.Task[None] | None = None
        self._publisher: Publisher | None = None  # made once the endpoint is up
        self.incarnation = secrets.token_hex(8)  # this process's: peers of an earlier one hello again

    async def start(self) -> None:
        """Publish the record, then keep it fresh in the background."""
        await self.publish()
        self._refresh = asyncio.create_task(
            # a warning: peers stop finding the run
            every(
                refresh_period(self.ttl),
                self.publish,
                what="coordinator record refresh",
                clock=self.clock,
                level=logging.WARNING,
            )
        )

    async def aclose(self, timeout: float) -> None:
        await cancel_all([self._refresh] if self._refresh is not None else [], timeout)

    async def publish(self) -> None:
        ep = self.endpoint
        assert ep.dht is not None and ep.transport is not None and ep.identity is not None
        expires = get_dht_time() + self.ttl
        shards = self.sharding.shards if self.sharding is not None else 1
        rec = CoordinatorRecord(
            ep.transport.peer_id, ep.visible_maddrs(), self.run_id, expires, shards, self.incarnation
        )
        if self._publisher is None:  # under its own key: another's claim of the run cannot hide it
            self._publisher = Publisher(ep.dht, ep.identity, self.run_id, self.clock)
        await self._publisher.publish("coordinator", rec.header(), expires)
