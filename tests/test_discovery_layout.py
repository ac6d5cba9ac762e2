"""The sharded advert layout live (issue 33, item 1): the coordinator's record says
how many shards the adverts are cut into, each peer stores its advert under its
shard, the coordinator reads the admitted peers' shards in one lookup (a swarm over
``MAX_RECORDS`` peers a slice a poll), and a run that outgrows its sharding says so
and re-shards while peers follow the record."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.utils import get_dht_time

from coordinator.adverts import AdvertBook, Sharding
from coordinator.discovery_cost import shard_count
from coordinator.status import StatusBoard
from peer.admission import Credentials
from peer.adverts import Adverts
from peer.config import PeerConfig
from peer.link import CoordinatorLink
from protocol.net.clock import FakeClock
from protocol.trust.identity import Identity, sign_record
from protocol.trust.run_records import FOLLOW_S, MAX_SHARDS, record_subkey, shard_name, shard_of
from protocol.wire.gate import Gate
from protocol.wire.messages import PROTOCOL_VERSION, Advert, CoordinatorRecord, dht_key

RUN = "run"


def test_a_peers_shard_is_a_stable_hash_of_its_id_within_the_count() -> None:
    peers = [f"Qm{i:04d}" for i in range(2000)]
    spread = Counter(shard_of(p, 16) for p in peers)
    assert set(spread) == set(range(16)) and max(spread.values()) < 2 * 2000 / 16
    assert [shard_of(p, 16) for p in peers] == [shard_of(p, 16) for p in peers]
    assert all(shard_of(p, 1) == 0 for p in peers[:10])
    for bad in (0, -1, MAX_SHARDS + 1):
        with pytest.raises(ValueError, match="shard count"):
            shard_of("Qm", bad)


def test_a_run_that_outgrows_its_sharding_says_so_and_reads_the_old_shards_while_peers_move(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    board = StatusBoard(RUN, 10)
    sharding = Sharding(board, clock)
    peers = [f"Qm{i}" for i in range(100)]
    sharding.fit(10)
    assert sharding.shards == 1 and sharding.names(peers) == ["adverts/0"]
    with caplog.at_level(logging.WARNING, logger="coordinator.adverts"):
        sharding.fit(100)
    k = shard_count(100)
    assert sharding.shards == k > 1
    assert "outgrew its sharding: 100 peers in 1 shard(s)" in caplog.text and f"into {k}" in caplog.text
    assert [e["kind"] for e in board.events].count("reshard") == 1
    assert sharding.names(peers) == sorted(shard_name("adverts", i) for i in range(k))
    assert sharding.names(["Qm1"]) == sorted({"adverts/0", shard_name("adverts", shard_of("Qm1", k))})
    asyncio.run(clock.advance(2 * FOLLOW_S))
    assert sharding.names(["Qm1"]) == [shard_name("adverts", shard_of("Qm1", k))], "the old shard no longer read"
    sharding.fit(3)
    assert sharding.shards == k, "never shrunk during a run"


class _ShardedDHT:
    """The run's adverts by shard key, as the DHT's process reads them."""

    def __init__(self) -> None:
        self.shards: dict[str, dict[str, Any]] = {}
        self.asked: list[list[str]] = []

    def run_coroutine(self, read: Any, return_future: bool) -> Any:
        shards, asked = self.shards, self.asked

        class Node:
            async def get_many(self, keys: list[str], sufficient_expiration_time: float, num_workers: int = 4) -> Any:
                asked.append(list(keys))
                out = {}
                for key in keys:
                    found = shards.get(key, {})
                    value = {k: SimpleNamespace(value=v, expiration_time=1.0) for k, v in found.items()}
                    out[key] = SimpleNamespace(value=value) if value else None
                return out

        return asyncio.ensure_future(read(None, Node()))


def _advert(who: Identity, peer_id: str, ttl: float = 60.0) -> dict[str, Any]:
    ad = Advert(peer_id, ["/ip4/127.0.0.1/tcp/4001"], "cpu", 1e12, 1 << 30, 100.0, 100.0, "2", PROTOCOL_VERSION, 0.0)
    return sign_record(who, {**ad.header(), "expires_at": get_dht_time() + ttl, "run_id": RUN})


def _book(n: int, shards: int) -> tuple[AdvertBook, _ShardedDHT]:
    """A coordinator's advert book with ``n`` admitted peers, each advert in its shard of ``shards``."""
    gate, board, dht = Gate(RUN), StatusBoard(RUN, 10), _ShardedDHT()
    reached = {}
    for i in range(n):
        who, peer = Identity.generate(), f"Qm{i:03d}"
        gate.admit(peer, who.public_key)
        reached[peer] = True
        key = dht_key(RUN, shard_name("adverts", shard_of(peer, shards)))
        dht.shards.setdefault(key, {})[record_subkey("adverts", who.public_hex, peer)] = _advert(who, peer)
    book = AdvertBook(RUN, gate, SimpleNamespace(reached=reached), board, SimpleNamespace(dht=dht), FakeClock())
    return book, dht


def test_the_coordinator_reads_every_admitted_peers_shard_in_one_lookup() -> None:
    """40 peers outgrow one shard: the book re-shards and reads every shard in one read."""
    k = shard_count(40)
    book, dht = _book(40, k)
    assert len(asyncio.run(book.live())) == 40
    assert book.sharding.shards == k > 1
    assert dht.asked == [sorted(dht_key(RUN, shard_name("adverts", i)) for i in range(k))]


def test_an_advert_a_poll_missed_counts_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that timed out on a loaded holder misses adverts: the book keeps each
    one it saw until the advert itself expires (as the DHT would have returned it)."""
    book, dht = _book(3, 1)
    (shard,) = dht.shards.values()
    subkey = next(k for k in shard if k.endswith("/Qm000"))
    who = Identity.generate()
    book.gate.admit("Qm000", who.public_key)
    shard.pop(subkey)
    shard[record_subkey("adverts", who.public_hex, "Qm000")] = _advert(who, "Qm000", ttl=5.0)
    assert len(asyncio.run(book.live())) == 3
    saved = dict(shard)
    shard.clear()  # the next lookup finds nothing (asked twice)
    assert len(asyncio.run(book.live())) == 3, "kept: none of them expired"
    shard.update(saved)
    shard.pop(record_subkey("adverts", who.public_hex, "Qm000"))
    later = get_dht_time() + 10.0
    monkeypatch.setattr("coordinator.adverts.get_dht_time", lambda: later)
    assert sorted(asyncio.run(book.live())) == ["Qm001", "Qm002"], "Qm000's advert expired"


def test_a_swarm_over_the_read_limit_is_read_a_slice_of_shards_a_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """More admitted peers than a poll may read (here 8): each poll reads about that
    many peers' shards, those of peers with no advert yet first, the others in turn; the
    book keeps what each shard's last read found."""
    monkeypatch.setattr("coordinator.adverts.POLL_RECORDS", 8)
    monkeypatch.setattr("coordinator.adverts.shard_count", lambda n: 4)
    book, dht = _book(20, 4)

    async def polls() -> list[int]:
        return [len(await book.live()) for _ in range(5)]

    seen = asyncio.run(polls())
    assert all(len(keys) == 1 for keys in dht.asked), dht.asked  # 4 shards * 8 // 20 peers: 1 a poll
    assert {k for keys in dht.asked[:4] for k in keys} == {dht_key(RUN, f"adverts/{i}") for i in range(4)}
    assert seen[0] < 20 and seen[3:] == [20, 20]
    newcomer = next(f"Qm-new{i}" for i in range(100) if shard_of(f"Qm-new{i}", 4) != shard_of("Qm000", 4))
    who = Identity.generate()
    book.gate.admit(newcomer, who.public_key)
    book.reach.reached[newcomer] = True
    home = dht_key(RUN, shard_name("adverts", shard_of(newcomer, 4)))
    dht.shards[home][record_subkey("adverts", who.public_hex, newcomer)] = _advert(who, newcomer)
    assert newcomer in asyncio.run(book.live()) and dht.asked[-1] == [home], "a new peer's shard is read first"


def _link(record: CoordinatorRecord, coordinator: Identity, clock: FakeClock) -> tuple[CoordinatorLink, list[Any]]:
    """A serving peer's link whose DHT answers with ``record``s (signed by ``coordinator``)."""
    answers: list[Any] = [record]

    class DHT:
        def run_coroutine(self, read: Any, return_future: bool) -> Any:
            class Node:
                async def get_many(
                    self, keys: list[str], sufficient_expiration_time: float, num_workers: int = 4
                ) -> Any:
                    signed = sign_record(coordinator, answers[-1].header())
                    item = SimpleNamespace(value=signed, expiration_time=1.0)
                    return {keys[0]: SimpleNamespace(value={coordinator.public_hex: item})}

            return asyncio.ensure_future(read(None, Node()))

    cfg = PeerConfig([], RUN, coordinator_key=coordinator.public_hex)
    link = CoordinatorLink(cfg, DHT(), None, Identity.generate(), Credentials(cfg, clock), lambda _: None, clock)  # type: ignore[arg-type]
    link.record, link.key = record, coordinator.public_key
    return link, answers


def test_a_serving_peer_follows_a_reshard_from_the_coordinators_record_and_refuses_a_wild_count() -> None:
    coordinator, clock = Identity.generate(), FakeClock()
    expires = get_dht_time() + 60
    record = CoordinatorRecord("coord", [], RUN, expires, 1)
    link, answers = _link(record, coordinator, clock)
    assert link.shards == 1
    answers.append(CoordinatorRecord("coord", [], RUN, expires, 8))
    asyncio.run(link.follow())
    assert link.shards == 8
    answers.append(CoordinatorRecord("coord", [], RUN, expires, MAX_SHARDS + 1))  # no such shard count
    asyncio.run(link.follow())
    assert link.shards == 8
    answers.append(CoordinatorRecord("another-node", [], RUN, expires, 2))  # the coordinator restarted: reattach's
    asyncio.run(link.follow())
    assert link.shards == 8 and link.peer_id == "coord"


def test_a_peer_stores_its_advert_under_its_shard_of_the_count_its_coordinator_says() -> None:
    stored: list[str] = []

    class DHT:
        def store(self, key: str, value: Any, expires: float, subkey: str, return_future: bool) -> Any:
            stored.append(key)
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            future.set_result(True)
            return future

    shards = [1]
    cfg = PeerConfig([], RUN)
    clock = FakeClock()
    ads = Adverts(RUN, 6.0, DHT(), Identity.generate(), Credentials(cfg, clock), print, clock, shards=lambda: shards[0])  # type: ignore[arg-type]
    ads.advert = Advert("QmPeer", [], "cpu", 1e12, 1 << 30, 1.0, 1.0, "2", PROTOCOL_VERSION, 0.0)
    asyncio.run(ads.publish())
    shards[0] = 64
    asyncio.run(ads.publish())
    assert stored == [dht_key(RUN, "adverts/0"), dht_key(RUN, shard_name("adverts", shard_of("QmPeer", 64)))]
