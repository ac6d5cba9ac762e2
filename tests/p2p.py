"""Two transports on loopback, each admitted by the other's gate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import hivemind

from protocol.envelope import Gate
from protocol.identity import Identity
from protocol.transport import Transport


@asynccontextmanager
async def transport_pair(run_id: str = "r", max_payload: int = 4 << 30) -> AsyncIterator[tuple[Transport, Transport]]:
    d1 = hivemind.DHT(start=True)
    d2 = hivemind.DHT(initial_peers=[str(m) for m in d1.get_visible_maddrs()], start=True)
    ka, kb = Identity.generate(), Identity.generate()
    a = Transport(await d1.replicate_p2p(), ka, Gate(run_id, max_payload))
    b = Transport(await d2.replicate_p2p(), kb, Gate(run_id, max_payload))
    a.gate.admit(b.peer_id, kb.public_key)
    b.gate.admit(a.peer_id, ka.public_key)
    try:
        await a.start()
        await b.start()
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()
        d1.shutdown()
        d2.shutdown()
