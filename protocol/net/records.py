"""Signed records in the run's DHT: the one publisher and the one reader that the
coordinator (its record, under its own key) and every peer (its advert) use.

A record is stored as one subkey of a dictionary key ``<run>:<name>``; a reader
gets the subkeys' raw values and checks each itself (``check_record``, then the
message's own decode), for what a stranger stored there is not to be trusted."""

from __future__ import annotations

import asyncio
from typing import Any

from protocol.trust.identity import Identity, sign_record
from protocol.wire.messages import dht_key

#: the longest a DHT store or get may take. DHT calls are awaited as futures, never run on
#: executor threads: a thread blocked on a DHT that shut down kept the event loop from closing
DHT_TIMEOUT_S = 30.0


async def publish_record(
    dht: Any, identity: Identity, run_id: str, name: str, subkey: str, header: dict[str, Any], expires: float
) -> bool:
    """Sign ``header`` and store it under ``<run>:<name>`` / ``subkey`` until ``expires``
    (DHT time); whether the DHT took it."""
    record = sign_record(identity, header)
    store = dht.store(dht_key(run_id, name), record, expires, subkey=subkey, return_future=True)
    return bool(await asyncio.wait_for(store, DHT_TIMEOUT_S))


async def read_records(dht: Any, run_id: str, name: str) -> dict[str, Any]:
    """The raw values stored under ``<run>:<name>``, by subkey, unchecked ({} when the
    key holds nothing or no dictionary)."""
    found = await asyncio.wait_for(dht.get(dht_key(run_id, name), latest=True, return_future=True), DHT_TIMEOUT_S)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: item.value for subkey, item in found.value.items()}
