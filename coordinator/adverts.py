"""The peers' adverts as the coordinator takes them: read from the run's DHT, checked
(signed, by the key the peer's hello bound to its id, dialled back, fresh, sane),
refused with a word once, and kept for planning."""

from __future__ import annotations

import logging
from typing import Any

from hivemind.utils import get_dht_time

from coordinator.reachability import Reach
from coordinator.roster import Endpoint
from coordinator.status import StatusBoard
from protocol.net.records import read_records
from protocol.trust.advert_check import advert_problem
from protocol.trust.identity import check_record, key_hex
from protocol.wire.gate import Gate
from protocol.wire.messages import Advert
from protocol.wire.reject import Reject

logger = logging.getLogger(__name__)


class AdvertBook:
    """The adverts the run plans with (``adverts``, by peer id) and the live ones in the DHT."""

    def __init__(self, run_id: str, gate: Gate, reach: Reach, board: StatusBoard, endpoint: Endpoint) -> None:
        self.run_id, self.gate, self.reach, self.board, self.endpoint = run_id, gate, reach, board, endpoint
        self.adverts: dict[str, Advert] = {}
        self._refused: dict[str, str] = {}  # peer -> why its advert is ignored (said once)

    async def live(self) -> dict[str, Advert]:
        """The adverts in the DHT that have not expired, are signed, and whose key the
        peer bound to its libp2p id with its hello, by peer id."""
        assert self.endpoint.dht is not None
        out: dict[str, Advert] = {}
        now = get_dht_time()
        for subkey, value in (await read_records(self.endpoint.dht, self.run_id, "adverts")).items():
            ad = self._taken(subkey, value, now)
            if ad is not None:
                out[ad.peer_id] = ad
        self.board.saw_adverts(out)
        return out

    def _taken(self, subkey: str, value: Any, now: float) -> Advert | None:
        """The advert stored under ``subkey`` if it counts (None: it does not)."""
        try:
            ad = Advert.from_header(value)
            key = check_record(value)
        except Exception as exc:
            logger.warning("ignoring a bad advert under %r: %s", subkey, exc)
            return None
        if not isinstance(ad, Advert):
            logger.warning("ignoring a %s record under %r among the adverts", ad.KIND, subkey)
            return None
        bound = self.gate.keys.get(ad.peer_id)
        if bound is None or key_hex(bound) != key_hex(key) or ad.peer_id not in self.reach.reached:
            return None  # no hello yet (or from another key): not admitted; or not yet dialled back
        if ad.expires_at <= now or ad.peer_id != subkey:
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
        self.adverts = {**{p: a for p, a in self.adverts.items() if p in planned}, **live}
