"""The data path's one pass over a payload: hashed while it arrives, and a payload
whose bytes changed still refused before anything uses it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from blake3 import blake3

from protocol.trust.identity import Identity
from protocol.wire.encoding import encode_values, read_growing
from protocol.wire.envelope import Sealer
from protocol.wire.gate import Gate
from protocol.wire.messages import Activations
from protocol.wire.reject import Reject, Rejected


def test_a_payload_hashed_as_it_arrives_has_the_whole_payload_s_digest() -> None:
    data = bytes(range(256)) * 5000

    async def main() -> tuple[bytes, str]:
        reader = asyncio.StreamReader()
        for i in range(0, len(data), 7000):  # chunks as a stream hands them over
            reader.feed_data(data[i : i + 7000])
        reader.feed_eof()
        digest = blake3()
        payload = await read_growing(reader, len(data), digest=digest)
        assert payload is not None
        return bytes(payload), digest.hexdigest()

    payload, digest = asyncio.run(main())
    assert payload == data and digest == blake3(data).hexdigest()


def _sealed() -> tuple[Gate, bytes, bytearray]:
    key = Identity.generate()
    gate = Gate("r")
    gate.admit("p", key.public_key)
    descs, chunks = encode_values([torch.arange(1000, dtype=torch.float32)])
    head, _ = Sealer(key, "p").seal(Activations("r", 0, 0, 1), descs, chunks)
    return gate, head, bytearray(b"".join(bytes(c) for c in chunks))


def test_a_tampered_payload_is_refused_with_its_streamed_digest() -> None:
    gate, head, payload = _sealed()
    env, _ = gate.check_head(head, "p")
    payload[17] ^= 1
    with pytest.raises(Rejected) as exc:  # the digest of what arrived, not of what was signed
        gate.check_payload(env, memoryview(payload), "p", blake3(payload).hexdigest())
    assert exc.value.code is Reject.BAD_DIGEST


def test_the_streamed_digest_of_the_signed_bytes_passes() -> None:
    gate, head, payload = _sealed()
    env, _ = gate.check_head(head, "p")
    gate.check_payload(env, memoryview(payload), "p", blake3(payload).hexdigest())
