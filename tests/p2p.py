"""Transports on loopback, each admitted by the others' gates."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import hivemind
import torch

from protocol.net.dhtstart import start_dht
from protocol.net.transport import Transport
from protocol.trust.identity import Identity
from protocol.wire.encoding import encode_values
from protocol.wire.envelope import HEAD, MAGIC, Sealer
from protocol.wire.gate import Gate
from protocol.wire.messages import Activations


@asynccontextmanager
async def transport_pair(
    run_id: str = "r", max_payload: int = 4 << 30, direct: bool = True
) -> AsyncIterator[tuple[Transport, Transport]]:
    async with transports(2, run_id, max_payload, direct) as (a, b):
        yield a, b


@asynccontextmanager
async def transports(
    n: int, run_id: str = "r", max_payload: int = 4 << 30, direct: bool = True
) -> AsyncIterator[list[Transport]]:
    """``n`` transports on loopback, each admitted by every other's gate (``direct``:
    with the direct data path, else libp2p only)."""
    dhts: list[hivemind.DHT] = []
    out: list[Transport] = []
    try:
        dhts.append(start_dht())
        boot = [str(m) for m in dhts[0].get_visible_maddrs()]
        dhts += [start_dht(initial_peers=boot) for _ in range(n - 1)]
        keys = [Identity.generate() for _ in range(n)]
        for d, k in zip(dhts, keys, strict=True):
            out.append(Transport(await d.replicate_p2p(), k, Gate(run_id, max_payload), direct))
        for t in out:
            for other, key in zip(out, keys, strict=True):
                if other is not t:
                    t.gate.admit(other.peer_id, key.public_key)
        for t in out:
            await t.start()
        yield out
    finally:
        for t in out:
            await t.aclose()
        for d in dhts:
            d.shutdown()


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
