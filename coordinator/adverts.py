"""The peers' adverts as the coordinator takes them: read from the run's DHT (only
those stored under the keys of peers whose hello it took, at most ``MAX_RECORDS``),
checked (signed, by the key the peer's hello bound to its id, dialled back, fresh,
sane), refused with a word once per peer and period, and kept for planning. A poll
that fails or finds nothing keeps the planned peers' last adverts, on the status
board too: their own traffic says whether they are alive."""

from __future__ import annotations

import logging
from typing import Any

from hivemind.utils import get_dht_time

from coordinator.reachability import Reach
from coordinator.roster import Endpoint
from coordinator.status import StatusBoard
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.records import read_records
from protocol.trust.advert_check import advert_problem
from protocol.trust.identity import check_record, key_hex
from protocol.trust.run_records import LOG_PERIOD_S, Tally, record_subkey
from protocol.wire.gate import Gate
from protocol.wire.messages import Advert
from protocol.wire.reject import Reject

logger = logging.getLogger(__name__)


class AdvertBook:
    """The adverts the run plans with (``adverts``, by peer id) and the live ones in the DHT."""

    def __init__(
        self, run_id: str, gate: Gate, reach: Reach, board: StatusBoard, endpoint: Endpoint, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.run_id, self.gate, self.reach, self.board, self.endpoint = run_id, gate, reach, board, endpoint
        self.adverts: dict[str, Advert] = {}
        self._refused: dict[str, str] = {}  # peer -> why its advert is ignored (said once)
        self._planned: set[str] = set()  # as ``keep`` was last told
        self._bad = Tally(LOG_PERIOD_S, clock)  # unreadable adverts, by signer: a line per period each
        self._failed = Tally(LOG_PERIOD_S, clock)  # polls that failed: a line per period

    async def live(self) -> dict[str, Advert]:
        """The adverts in the DHT that have not expired, are signed, and whose key the
        peer bound to its libp2p id with its hello, by peer id. The status board sees
        them with the planned peers' last ones (a poll that failed: unchanged)."""
        assert self.endpoint.dht is not None
        admitted = {record_subkey("adverts", key_hex(k), p): p for p, k in self.gate.keys.items()}
        out: dict[str, Advert] = {}
        try:
            found = await read_records(self.endpoint.dht, self.run_id, "adverts", wanted=admitted)
        except Exception as exc:  # the DHT's hiccup: nothing learnt, no one dropped
            count = self._failed.note("poll")
            if count is not None:
                logger.warning("reading the adverts from the DHT failed (%d time(s)): %r", count, exc)
            return out
        now = get_dht_time()
        for subkey, value in found.items():
            ad = self._taken(admitted[subkey], subkey, value, now)
            if ad is not None:
                out[ad.peer_id] = ad
        kept = {p: a for p, a in self.adverts.items() if p in self._planned}
        self.board.saw_adverts({**kept, **out})
        return out

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
