"""Two transports on loopback, each admitted by the other's gate."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import hivemind
import torch

from protocol.envelope import HEAD, MAGIC, Gate, Sealer
from protocol.identity import Identity
from protocol.messages import Activations
from protocol.transport import Transport
from protocol.wire import encode_values


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


def claiming(sealer: Sealer, nbytes: int) -> bytes:
    """A validly signed head whose header claims an ``nbytes`` payload (a float32
    tensor of that size) that never follows."""
    small, _ = sealer.seal(Activations("r", 0, 0, 1), *encode_values([torch.zeros(4)]))
    header = json.loads(small[HEAD.size : HEAD.size + HEAD.unpack_from(small)[1]])
    header["payload_bytes"] = nbytes
    header["values"][0]["shape"] = [nbytes // 4]
    header["values"][0]["nbytes"] = nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    head = HEAD.pack(MAGIC, len(data)) + data
    return head + sealer.identity.sign(head)
