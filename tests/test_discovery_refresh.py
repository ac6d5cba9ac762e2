"""Adverts stay alive however long a store takes (issue 33: at 80 peers on a loaded
machine, stores took 3-8 s, each copy expired before the next one landed, and the
coordinator's lookups missed 10-30% of the adverts), and a poll's lookups of several
shards run side by side (a slow poll dropped adverts that expired while it ran)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.utils import get_dht_time

from peer.admission import Credentials
from peer.adverts import Adverts, RefreshPace
from peer.config import PeerConfig
from protocol.net.clock import FakeClock
from protocol.net.records import MAX_READ_WORKERS, READ_WORKERS_PER_KEY, read_node
from protocol.trust.identity import Identity
from protocol.wire.messages import PROTOCOL_VERSION, Advert

RUN = "run"


def test_a_copy_lives_its_ttl_from_when_it_is_expected_to_land() -> None:
    pace = RefreshPace(6.0)
    assert pace.period == 2.0 and pace.lifetime() == 6.0  # no store yet: ttl
    pace.stored(2.0)
    assert pace.lifetime() == 10.0  # the last store took 2 s: so may this one and the next
    pace.stored(1.0)
    assert pace.lifetime() == 10.0  # the longest of the last few
    pace.stored(30.0)
    assert pace.lifetime() == 12.0  # at most ttl more: a vanished peer lingers at most 2 ttl
    for _ in range(3):
        pace.stored(0.5)
    assert pace.lifetime() == 7.0
    assert pace.wait(0.5) == 1.5 and pace.wait(5.0) == 0.0  # start to start; at once after a slow store


SLOW = [
    [0.2] * 8,  # a quiet swarm
    [0.2, 3.9, 0.2, 0.2, 3.9, 0.2],  # now and then a store 3.7 s slower than the recent ones
    [2.0, 5.9, 2.0, 2.0, 5.9, 2.0],  # now and then one of the ttl while the others take ttl / 3
    [0.5, 1.0, 1.5, 2.0, 2.5, 2.9, 2.9, 1.0, 0.3],  # a swarm getting loaded, then quiet again
    [2.9] * 8,  # every store takes about ttl / 2
]


@pytest.mark.parametrize("took", SLOW)
def test_an_advert_is_never_expired_between_two_copies_however_slow_its_stores(took: list[float]) -> None:
    """Each copy lands (its store returns) before the one before it expired, with
    stores that take up to the ttl; the old pace (ttl from the start, ttl / 3 after
    the store returned) let copies lapse with two stores of 2 s."""
    clock, stores = FakeClock(), []  # (started, lives until, landed) on the fake clock
    ttl, durations = 6.0, [took[0], *took]

    class DHT:
        def store(self, key: str, value: Any, expires: float, subkey: str, return_future: bool) -> Any:
            return asyncio.ensure_future(self._store(expires))

        async def _store(self, expires: float) -> bool:
            started = clock.now()
            lives = started + (expires - get_dht_time())  # the copy's lifetime, on the fake clock
            await clock.sleep(durations[len(stores)] if len(stores) < len(durations) else 0.2)
            stores.append((started, lives, clock.now()))
            return True

    async def main() -> None:
        ads = Adverts(RUN, ttl, DHT(), Identity.generate(), Credentials(PeerConfig([], RUN), clock), print, clock)  # type: ignore[arg-type]
        ads.advert = Advert("QmPeer", [], "cpu", 1e12, 1 << 30, 1.0, 1.0, "2", PROTOCOL_VERSION, 0.0)
        await asyncio.gather(ads.publish(), clock.advance(took[0]))  # the join's own copy
        loop = asyncio.ensure_future(ads.refresh())
        while len(stores) < len(took) + 1:
            await clock.advance(0.1)
        loop.cancel()

    asyncio.run(main())
    for (_, lives, _), (_, _, landed) in zip(stores, stores[1:]):
        assert landed < lives - 0.1, stores
    starts = [s for s, _, _ in stores]
    for t, (a, b) in zip(durations, zip(starts, starts[1:])):
        assert b - a == pytest.approx(max(2.0, t), abs=0.11)  # start to start, at once after a slow one


def test_a_poll_of_several_shards_looks_them_up_side_by_side() -> None:
    asked: list[tuple[int, int]] = []

    class Node:
        async def get_many(self, keys: list[str], sufficient_expiration_time: float, num_workers: int) -> Any:
            assert sufficient_expiration_time == float("inf")
            asked.append((len(keys), num_workers))
            return {k: SimpleNamespace(value={}) for k in keys}

    for n in (1, 2, 8, 64):
        asyncio.run(read_node(Node(), [f"{RUN}:adverts/{i}" for i in range(n)]))
    assert asked == [(1, READ_WORKERS_PER_KEY), (2, 2 * READ_WORKERS_PER_KEY), (8, 32), (64, MAX_READ_WORKERS)]
