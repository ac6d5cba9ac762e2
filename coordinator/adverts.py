"""The peers' adverts as the coordinator takes them: read from the run's DHT (the
shards of the peers whose hello it took, in one lookup, only those peers' subkeys; a
swarm of over ``POLL_RECORDS`` peers a slice of shards a poll, those of peers it has
no advert of first, the others in turn),
checked (signed, by the key the peer's hello bound to its id, dialled back, fresh,
sane), refused with a word once per peer and period, and kept for planning. A poll
that fails or finds nothing keeps the planned peers' last adverts, on the status
board too: their own traffic says whether they are alive.

How many shards the adverts are cut into grows with the swarm (``Sharding``, published
in the coordinator's record); a run that outgrows its sharding says so and re-shards."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from hivemind.utils import get_dht_time

from coordinator.discovery_cost import POLL_RECORDS, shard_count
from coordinator.reachability import Reach
from coordinator.roster import Endpoint
from coordinator.status import StatusBoard
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.records import read_many
from protocol.trust.advert_check import advert_problem
from protocol.trust.identity import check_record, key_hex
from protocol.trust.run_records import FOLLOW_S, LOG_PERIOD_S, Tally, record_subkey, shard_name, shard_of
from protocol.wire.gate import Gate
from protocol.wire.messages import Advert
from protocol.wire.reject import Reject

logger = logging.getLogger(__name__)


class Sharding:
    """How many shards (``shards``) the run's adverts are cut into, as the coordinator's
    record says: ``discovery_cost.shard_count`` of the admitted peers, grown as the swarm
    grows and never shrunk during a run (an empty shard costs a poll next to nothing).
    After a re-shard the old shards are read too for ``2 * FOLLOW_S``: the time peers
    take to read the new record and move their advert."""

    def __init__(self, board: StatusBoard, clock: Clock = SYSTEM_CLOCK) -> None:
        self.board, self.clock = board, clock
        self.shards = 1
        self._old: int | None = None  # the count before the last re-shard, while peers move
        self._until = 0.0

    def fit(self, peers: int) -> None:
        """Re-shard, saying so, if ``peers`` outgrew the current count."""
        want = shard_count(peers)
        if want <= self.shards:
            return
        text = (
            f"the run outgrew its sharding: {peers} peers in {self.shards} shard(s) of adverts; "
            f"re-sharding into {want} (the coordinator's record says so; peers follow within {FOLLOW_S:.0f} s)"
        )
        logger.warning("%s", text)
        self.board.event("reshard", text)
        self._old, self._until, self.shards = self.shards, self.clock.now() + 2 * FOLLOW_S, want

    def names(self, peers: Iterable[str]) -> list[str]:
        """The shards (key names) where ``peers``' adverts are: each one's shard under the
        current count, and under the old one while peers move."""
        return sorted({name for p in peers for name in self.homes(p)})

    def homes(self, peer: str) -> set[str]:
        """The shards where ``peer``'s advert may be (two while peers move)."""
        counts = [self.shards]
        if self._old is not None and self.clock.now() < self._until:
            counts.append(self._old)
        return {shard_name("adverts", shard_of(peer, k)) for k in counts}


class AdvertBook:
    """The adverts the run plans with (``adverts``, by peer id) and the live ones in the DHT."""

    def __init__(
        self,
        run_id: str,
        gate: Gate,
        reach: Reach,
        board: StatusBoard,
        endpoint: Endpoint,
        clock: Clock = SYSTEM_CLOCK,
        sharding: Sharding | None = None,
    ) -> None:
        self.run_id, self.gate, self.reach, self.board, self.endpoint = run_id, gate, reach, board, endpoint
        self.sharding = sharding if sharding is not None else Sharding(board, clock)
        self.adverts: dict[str, Advert] = {}
        self._refused: dict[str, str] = {}  # peer -> why its advert is ignored (said once)
        self._planned: set[str] = set()  # as ``keep`` was last told
        self._bad = Tally(LOG_PERIOD_S, clock)  # unreadable adverts, by signer: a line per period each
        self._failed = Tally(LOG_PERIOD_S, clock)  # polls that failed: a line per period
        self._by_shard: dict[str, dict[str, Advert]] = {}  # shard -> the adverts its last read found
        self._turn = 0  # where the next slice of shards starts (a swarm over ``POLL_RECORDS``)

    async def live(self) -> dict[str, Advert]:
        """The adverts in the DHT that have not expired, are signed, and whose key the
        peer bound to its libp2p id with its hello, by peer id (a shard not read at this
        poll: as its last read found them). The status board sees them with the planned
        peers' last ones (a poll that failed: unchanged)."""
        assert self.endpoint.dht is not None
        admitted = {record_subkey("adverts", key_hex(k), p): p for p, k in self.gate.keys.items()}
        self.sharding.fit(len(admitted))
        names = self.sharding.names(admitted.values())
        read = self._slice(names, set(admitted.values()))
        if read != names:  # only the peers of the shards read: few enough to be named to the DHT's process
            shards = set(read)
            admitted = {k: p for k, p in admitted.items() if self.sharding.homes(p) & shards}
        try:
            found = await read_many(self.endpoint.dht, self.run_id, read, wanted=admitted)
        except Exception as exc:  # the DHT's hiccup: nothing learnt, no one dropped
            count = self._failed.note("poll")
            if count is not None:
                logger.warning("reading the adverts from the DHT failed (%d time(s)): %r", count, exc)
            return {}
        now = get_dht_time()
        fresh: dict[str, Advert] = {}
        for subkey, value in found.items():
            ad = self._taken(admitted[subkey], subkey, value, now)
            if ad is not None:
                fresh[ad.peer_id] = ad
        self._file(names, read, fresh, set(self.gate.keys), now)
        out = {p: a for shard in self._by_shard.values() for p, a in shard.items()}
        kept = {p: a for p, a in self.adverts.items() if p in self._planned}
        self.board.saw_adverts({**kept, **out})
        return out

    def _slice(self, names: list[str], peers: set[str]) -> list[str]:
        """The shards this poll reads: all of them, or, where more than ``POLL_RECORDS``
        peers are admitted, about that many peers' shards: first those of peers with no
        advert known (new), then the others in turn."""
        if len(peers) <= POLL_RECORDS or len(names) <= 1:
            return names
        size = max(1, len(names) * POLL_RECORDS // len(peers))
        known = {p for shard in self._by_shard.values() for p in shard}
        new = sorted({shard_name("adverts", shard_of(p, self.sharding.shards)) for p in peers - known})[:size]
        start = self._turn % len(names)
        rest = [n for n in names[start:] + names[:start] if n not in new][: size - len(new)]
        self._turn = start + len(rest)
        return sorted({*new, *rest})

    def _file(
        self, names: list[str], read: list[str], fresh: dict[str, Advert], admitted: set[str], now: float
    ) -> None:
        """Remember what each shard read now holds (a peer under its shard at the current
        count), and the adverts a read missed that have not expired (a lookup that timed
        out on a loaded holder; the DHT itself returns an advert until it expires);
        forget the shards no longer read and the peers no longer admitted."""
        for name in read:
            self._by_shard[name] = {p: a for p, a in self._by_shard.get(name, {}).items() if a.expires_at > now}
        for p, ad in fresh.items():  # filed under its shard at the current count (where it moves to)
            self._by_shard.setdefault(shard_name("adverts", shard_of(p, self.sharding.shards)), {})[p] = ad
        wanted = set(names)
        self._by_shard = {
            n: {p: a for p, a in ads.items() if p in admitted} for n, ads in self._by_shard.items() if n in wanted
        }

    def _taken(self, peer_id: str, subkey: str, value: Any, now: float) -> Advert | None:
        """The advert of ``peer_id`` stored under its key ``subkey`` if it counts (None: it does not)."""
        try:
            ad = Advert.from_header(value)
            key = check_record(value)
            if not isinstance(ad, Advert):
                raise ValueError(f"a {ad.KIND} record among the adverts")
        except Exception as exc:
            count = self._bad.note(subkey)
            if count is not None:
                logger.warning("ignoring %d bad advert(s) of %s (key %s...): %s", count, peer_id, subkey[:16], exc)
            return None
        if record_subkey("adverts", key_hex(key), ad.peer_id) != subkey or ad.peer_id != peer_id:
            return None  # from another key than its hello's
        if ad.peer_id not in self.reach.reached:
            return None  # not yet dialled back
        if ad.expires_at <= now:
            return None
        problem = advert_problem(ad)
        if problem:
            self._refuse(ad.peer_id, problem)
            return None
        return ad

    def _refuse(self, peer_id: str, problem: str) -> None:
        """A bad advert is left out of planning; said once per peer and problem."""
        if self._refused.get(peer_id) == problem:
            return
        self._refused[peer_id] = problem
        logger.warning("ignoring the advert of %s: %s", peer_id, problem)
        self.board.reject(peer_id, Reject.BAD_ADVERT.value, problem)

    def keep(self, live: dict[str, Advert], planned: set[str]) -> None:
        """Take the ``live`` adverts; ``planned`` peers keep their last one through a DHT hiccup."""
        self._planned = set(planned)
        self.adverts = {**{p: a for p, a in self.adverts.items() if p in planned}, **live}
