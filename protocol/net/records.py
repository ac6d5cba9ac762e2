"""Signed records in the run's DHT: the one publisher and the one reader that the
coordinator (its record) and every peer (its advert) use.

A record is stored as one subkey of a dictionary key ``<run>:<name>``, the subkey
being its signer's key (hex; ``record_subkey``); every node's ``RunRecords`` refuses anything else. A
reader still checks what it takes (``check_record``, then the message's own decode):
a node outside the swarm's rule may answer. A read is bounded: it runs in the DHT's
own process and hands back at most ``MAX_RECORDS`` records, only the subkeys asked
for where the reader knows whom it expects."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Collection
from typing import Any

from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.trust.identity import Identity, sign_record
from protocol.trust.run_records import LOG_PERIOD_S, Tally, record_subkey
from protocol.wire.messages import dht_key

logger = logging.getLogger(__name__)

#: the longest a DHT store or get may take. DHT calls are awaited as futures, never run on
#: executor threads: a thread blocked on a DHT that shut down kept the event loop from closing
DHT_TIMEOUT_S = 30.0
#: the most records one read hands back to the reader's process
MAX_RECORDS = 1024
#: the most subkeys a read names to the DHT's process: hivemind's pipe into that process
#: reads without blocking, so a call's arguments must stay small (a larger ``wanted`` is
#: applied in the reader's process, to at most ``limit`` records)
MAX_WANTED = 256
#: concurrent requests a read's lookup keeps in flight per key (hivemind's default for a
#: whole ``get_many`` is 4): a poll of 8 shards with 4 in all took ~25 rounds of requests,
#: 4 s on a loaded machine, and adverts that had 4 s to live when a holder answered were
#: dropped as expired when the lookup finished (``benchmarks/discovery.py`` at 80 peers)
READ_WORKERS_PER_KEY = 4
#: the most concurrent requests of one read
MAX_READ_WORKERS = 32
#: a record is stored again this many times in the life (``ttl``) of each copy, so that
#: copies outlive stores slowed down several times over (``peer.adverts.RefreshPace``)
STORES_PER_TTL = 3
#: how long each copy of a peer's advert lives unless configured (``PeerConfig.advert_ttl``)
ADVERT_TTL_S = 6.0


def refresh_period(ttl: float) -> float:
    """Seconds between the starts of two stores of a record whose copies live ``ttl``."""
    return ttl / STORES_PER_TTL


class Publisher:
    """Stores this process's signed records; says in one line per key and period when
    the DHT refused one (a node holding another value there: an older node's record
    that shadows the key, until it expires)."""

    def __init__(self, dht: Any, identity: Identity, run_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self.dht, self.identity, self.run_id = dht, identity, run_id
        self._refusals = Tally(LOG_PERIOD_S, clock)

    async def publish(self, name: str, header: dict[str, Any], expires: float) -> bool:
        """Sign ``header`` and store it under ``<run>:<name>``, subkey this identity's key
        (``record_subkey``), until ``expires`` (DHT time); whether the DHT took it."""
        record = sign_record(self.identity, header)
        key, subkey = dht_key(self.run_id, name), record_subkey(name, self.identity.public_hex, header.get("peer_id"))
        store = self.dht.store(key, record, expires, subkey=subkey, return_future=True)
        stored = bool(await asyncio.wait_for(store, DHT_TIMEOUT_S))
        if not stored and self._refusals.note(key) is not None:
            logger.warning(
                "the DHT refused this process's record under the key %s: a node holds another value there "
                "(a stale record of an older node?) and peers may not find this one until it expires",
                key,
            )
        return stored


async def read_records(
    dht: Any, run_id: str, name: str, wanted: Collection[str] | None = None, limit: int = MAX_RECORDS
) -> dict[str, Any]:
    """The raw values stored under ``<run>:<name>``, by subkey, unchecked ({} when the
    key holds nothing or no dictionary): only the subkeys in ``wanted`` (None: any),
    at most ``limit`` of them."""
    return await read_many(dht, run_id, [name], wanted, limit)


async def read_many(
    dht: Any, run_id: str, names: Collection[str], wanted: Collection[str] | None = None, limit: int = MAX_RECORDS
) -> dict[str, Any]:
    """``read_records`` of several of the run's keys (a sharded key's shards) in one
    lookup of them all (hivemind's ``get_many``): their raw values by subkey, a subkey
    found under two keys (a peer that moved to its new shard) taken where it expires
    last; at most ``limit`` records in all."""
    keep = frozenset(wanted) if wanted is not None else None
    ask = keep if keep is not None and len(keep) <= MAX_WANTED else None
    keys = [dht_key(run_id, name) for name in names]
    read = functools.partial(_read, keys, ask, limit)
    found = await asyncio.wait_for(dht.run_coroutine(read, return_future=True), DHT_TIMEOUT_S)
    return found if keep is None or ask is not None else {k: v for k, v in found.items() if k in keep}


async def _read(keys: list[str], wanted: frozenset[str] | None, limit: int, _dht: Any, node: Any) -> dict[str, Any]:
    """``read_many``'s part in the DHT's process (``node``: its ``DHTNode``)."""
    return await read_node(node, keys, wanted, limit)


async def read_node(
    node: Any, keys: list[str], wanted: frozenset[str] | None = None, limit: int = MAX_RECORDS
) -> dict[str, Any]:
    """``read_many`` on a ``DHTNode`` of this process (``keys``: whole DHT keys), the
    keys' lookups side by side (``read_workers``). A key that a lookup found empty is
    asked once more: under load a lookup now and then finds nothing where every holder
    has the value (seen in ``benchmarks/discovery.py``)."""
    found = dict(await _latest(node, keys)) if keys else {}
    empty = [key for key in keys if found.get(key) is None]
    if empty:
        found.update(await _latest(node, empty))
    out: dict[str, Any] = {}
    expiry: dict[str, float] = {}
    for key in keys:
        entry = found.get(key)
        if entry is None or not isinstance(entry.value, dict):
            continue
        for subkey, item in entry.value.items():
            if wanted is not None and subkey not in wanted:
                continue
            if subkey not in out and len(out) >= limit:
                return out
            if item.expiration_time > expiry.get(subkey, -math.inf):
                out[subkey], expiry[subkey] = item.value, item.expiration_time
    return out


def read_workers(keys: int) -> int:
    """Concurrent requests for a read of ``keys`` keys: ``READ_WORKERS_PER_KEY`` each, at
    most ``MAX_READ_WORKERS``, so that a poll of several shards takes about as long as
    the lookup of one."""
    return max(1, min(MAX_READ_WORKERS, READ_WORKERS_PER_KEY * keys))


async def _latest(node: Any, keys: list[str]) -> Any:
    """The latest value of each of ``keys`` (every holder a lookup meets merged)."""
    return await node.get_many(keys, sufficient_expiration_time=math.inf, num_workers=read_workers(len(keys)))
