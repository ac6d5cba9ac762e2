"""The direct data path (``protocol.net.direct``): frames between admitted peers go
over plain TCP once a ticket got over libp2p is proven, arrive intact and checked
as on libp2p, and anything else (a stranger, a wrong answer, a ticket used twice,
an unreachable port, ``--data-path libp2p``) stays on libp2p or is cut off."""

from __future__ import annotations

import asyncio

import pytest
import torch
from p2p import transport_pair

from protocol.net.direct import ANSWER, CHALLENGE_BYTES, MAC_BYTES, MAGIC, OFFER, mac
from protocol.net.direct_io import DirectReader
from protocol.net.transport import LANE_THRESHOLD, MSG_PROTOCOL, Transport
from protocol.wire.messages import Activations
from protocol.wire.reject import Reject


async def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _roundtrip(a: Transport, b: Transport, x: torch.Tensor, step: int = 0) -> torch.Tensor:
    await a.send(b.peer_id, Activations("r", step, 0, 1), [x])
    got = await asyncio.wait_for(b.inbox.get(), 30)
    assert got.sender == a.peer_id
    return got.values()[0]


def test_frames_between_admitted_peers_go_direct_and_arrive_exactly() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            small, large = torch.randn(64), torch.randn((LANE_THRESHOLD + (1 << 20)) // 4)
            assert torch.equal(await _roundtrip(a, b, small), small)
            assert a.direct_to == {b.peer_id}, "the message stream went direct"
            assert torch.equal(await _roundtrip(a, b, large, 1), large), "a large frame, in one piece, no lanes"
            assert not any("/lane" in key for key in a._streams)
            assert torch.equal(await _roundtrip(b, a, small, 2), small)
            assert b.direct_to == {a.peer_id}

    asyncio.run(go())


def test_libp2p_only_when_asked_or_when_the_receiver_has_not_admitted_the_sender() -> None:
    async def go() -> None:
        async with transport_pair("r", direct=False) as (a, b):
            x = torch.randn(64)
            assert torch.equal(await _roundtrip(a, b, x), x)
            assert not a.direct_to, "--data-path libp2p: no direct stream"
        async with transport_pair("r") as (a, b):
            b.direct.allowed = False  # the receiver refuses: the sender stays on libp2p
            assert torch.equal(await _roundtrip(a, b, torch.ones(3)), torch.ones(3))
            assert not a.direct_to
        async with transport_pair("r") as (a, b):
            del b.gate.keys[a.peer_id]  # not admitted: no ticket
            assert OFFER.unpack(await a._ask_ticket(b.peer_id))[0] == 0, "refused"

    asyncio.run(go())


async def _dial_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return reader, writer, await reader.readexactly(CHALLENGE_BYTES)


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 10) == b""


def test_a_ticket_is_proven_once_by_its_holder_and_never_sent() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            granted, port, ticket, secret = OFFER.unpack(await a._ask_ticket(b.peer_id))
            assert granted and port == b.direct.port
            # a wrong answer: closed, and the ticket is spent
            reader, writer, challenge = await _dial_raw(port)
            writer.write(ANSWER.pack(MAGIC, ticket, 0, bytes(MAC_BYTES)))
            assert await _closed(reader)
            reader, writer, challenge = await _dial_raw(port)
            writer.write(ANSWER.pack(MAGIC, ticket, 0, mac(secret, challenge)))
            assert await _closed(reader), "a spent ticket opens nothing"
            # a fresh ticket, answered right: the receiver proves it too
            _, _, ticket, secret = OFFER.unpack(await a._ask_ticket(b.peer_id))
            reader, writer, challenge = await _dial_raw(port)
            answer = mac(secret, challenge)
            writer.write(ANSWER.pack(MAGIC, ticket, 0, answer))
            assert await reader.readexactly(MAC_BYTES) == mac(secret, challenge, answer)
            writer.write(b"not a frame head")  # the stream is the gate's now: a malformed frame is refused
            await _until(lambda: b.gate.counts[Reject.MALFORMED] == 1)
            # silence after connecting holds no slot for long
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(reader.read(CHALLENGE_BYTES + 1), 15) != b""
            assert await _closed(reader)

    asyncio.run(go())


def test_an_unreachable_direct_port_falls_back_to_libp2p() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            for server in b.direct._servers:  # the port answers no more; tickets are still granted
                server.close()
                await server.wait_closed()
            x = torch.randn(16)
            assert torch.equal(await _roundtrip(a, b, x), x)
            assert not a.direct_to and not a.direct.worth_trying(b.peer_id, MSG_PROTOCOL)

    asyncio.run(go())


def test_a_muted_senders_direct_streams_are_cut() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            await _roundtrip(a, b, torch.ones(4))
            assert b.direct._incoming.get(a.peer_id)
            b.gate.on_mute[-1](a.peer_id)
            assert not b.direct._incoming.get(a.peer_id)

    asyncio.run(go())


@pytest.mark.parametrize("early", [0, 5, 12])
def test_read_into_takes_buffered_bytes_then_the_rest_as_it_arrives(early: int) -> None:
    async def go() -> None:
        reader = DirectReader()
        reader.feed_data(bytes(range(early)))
        buf = bytearray(10)
        task = asyncio.ensure_future(reader.read_into(memoryview(buf)))
        await asyncio.sleep(0)
        reader.feed_data(bytes(range(early, 14)))
        await task
        assert bytes(buf) == bytes(range(10))
        assert await reader.readexactly(4) == bytes(range(10, 14)), "what was past the buffer stays readable"
        reader.feed_data(b"ab")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await reader.read_into(memoryview(bytearray(4)))

    asyncio.run(go())
