"""The direct data path (``protocol.net.direct``): frames between admitted peers go
over plain TCP once a ticket got over libp2p is proven, arrive intact and checked
as on libp2p, and anything else (a stranger, a wrong answer, a ticket used twice,
an unreachable port, ``--data-path libp2p``) stays on libp2p or is cut off. Large
payloads go first on them, hashed on their way (``protocol.net.payload_first``)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
import torch
import uvloop
from blake3 import blake3
from p2p import transport_pair

from protocol.net import upgrade
from protocol.net.direct import (
    ANSWER,
    CHALLENGE_BYTES,
    MAC_BYTES,
    MAGIC,
    OFFER,
    REFUSED_RETRY_MAX_S,
    REFUSED_RETRY_S,
    RETRY_S,
    Direct,
    answer_mac,
    mac,
)
from protocol.net.direct_io import DirectReader, connect, serve
from protocol.net.payload_first import PAYLOAD_FIRST_MIN, pieces
from protocol.net.streams import PAYLOAD_FIRST, PAYLOAD_SIZE
from protocol.net.transport import LANE_THRESHOLD, MSG_PROTOCOL, Transport
from protocol.wire.encoding import HASH_STEP, HASH_TAIL, READ_CHUNK, encode_values, next_stop, read_growing
from protocol.wire.envelope import HEAD, Sealer, payload_digest
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
            writer.write(ANSWER.pack(MAGIC, ticket, 0, answer_mac(secret, challenge, ticket, 0)))
            assert await _closed(reader), "a spent ticket opens nothing"
            # a fresh ticket, answered right: the receiver proves it too
            _, _, ticket, secret = OFFER.unpack(await a._ask_ticket(b.peer_id))
            reader, writer, challenge = await _dial_raw(port)
            answer = answer_mac(secret, challenge, ticket, 0)
            writer.write(ANSWER.pack(MAGIC, ticket, 0, answer))
            assert await reader.readexactly(MAC_BYTES) == mac(secret, challenge, answer)
            writer.write(b"not a frame head")  # the stream is the gate's now: a malformed frame is refused
            await _until(lambda: b.gate.counts[Reject.MALFORMED] == 1)
            # plain TCP: bytes no signature proves are no one's fault, but that peer goes back to libp2p
            assert a.peer_id not in b.gate._abuse
            assert OFFER.unpack(await a._ask_ticket(b.peer_id))[0] == 0
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


def test_only_the_last_hash_tail_is_hashed_after_a_payload_lands() -> None:
    """Each side hashes a payload-first payload a step at a time while the rest is on
    the wire; the last step is ``HASH_TAIL`` bytes, whatever the step, so that is all
    that is hashed between the last byte and the head (sealed or checked)."""
    step, size = HASH_STEP, 4 * HASH_STEP + 1000
    stops, done = [], 0
    while done < size:
        done = next_stop(done, size, step)
        stops.append(done)
    assert stops == [step, 2 * step, 3 * step, 4 * step + 1000 - HASH_TAIL, size]
    assert next_stop(0, 100, 4) == 100, "a payload under HASH_TAIL is one step"
    sent = pieces([memoryview(bytearray(size))], step)
    assert [len(p) for p in sent] == [b - a for a, b in zip([0, *stops], stops)]

    async def go() -> list[int]:
        reader = DirectReader()

        async def filled() -> list[int]:
            return [n async for n in reader.fill(memoryview(bytearray(size)), step)]

        task = asyncio.ensure_future(filled())
        for piece in sent:  # the receiver yields where the sender's pieces end
            await asyncio.sleep(0)
            reader.feed_data(bytes(piece))
        return await task

    assert asyncio.run(go()) == stops


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_direct_stream_receives_straight_into_the_buffer_being_filled(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While ``fill`` fills a buffer, the event loop receives into it (no bytes object,
    no second copy). uvloop took a protocol that subclassed ``asyncio.Protocol`` for a
    plain one and handed every byte to ``data_received``: a 64 MiB frame was copied twice."""
    fed: list[int] = []
    feed = DirectReader.feed_data
    monkeypatch.setattr(DirectReader, "feed_data", lambda self, data: (fed.append(len(data)), feed(self, data))[1])
    size = 8 << 20
    data = bytes(range(256)) * (size // 256)

    async def go() -> bytes:
        accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await accepted.put(reader)

        server = await serve("127.0.0.1", 0, connected)
        _, writer = await connect("127.0.0.1", server.sockets[0].getsockname()[1])
        reader = await accepted.get()
        assert isinstance(reader, DirectReader)
        buf = bytearray(size)
        filling = asyncio.ensure_future(_drain(reader.fill(memoryview(buf), 1 << 20)))
        await asyncio.sleep(0)
        writer.write(data)
        await writer.drain()
        await filling
        writer.close()
        server.close()
        return bytes(buf)

    assert (uvloop.run(go()) if loop == "uvloop" else asyncio.run(go())) == data
    assert sum(fed) < size // 8, f"{sum(fed)} of {size} bytes went through feed_data"


async def _drain(items: AsyncIterator[int]) -> None:
    async for _ in items:
        pass


@pytest.mark.parametrize("early", [0, 5, 12])
def test_fill_takes_buffered_bytes_then_the_rest_as_it_arrives(early: int) -> None:
    async def go() -> None:
        reader = DirectReader()
        reader.feed_data(bytes(range(early)))
        buf = bytearray(10)

        async def filled() -> list[int]:
            return [n async for n in reader.fill(memoryview(buf), 4)]

        task = asyncio.ensure_future(filled())
        await asyncio.sleep(0)
        reader.feed_data(bytes(range(early, 14)))
        assert (await task)[-1] == 10
        assert bytes(buf) == bytes(range(10))
        assert await reader.readexactly(4) == bytes(range(10, 14)), "what was past the buffer stays readable"
        reader.feed_data(b"ab")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await filled()

    asyncio.run(go())


def test_a_payload_hashed_while_it_lands_has_its_digest_however_it_arrives() -> None:
    """Each part is hashed on another thread while later bytes land: every byte is hashed
    once, in order, also where the last ones land while an earlier part is hashed (the
    last part was once left unhashed so)."""

    async def go() -> None:
        rng = random.Random(7)
        for _ in range(8):
            data = rng.randbytes(rng.randint(1, 4 * READ_CHUNK))  # hashed where it is, and on a thread
            reader = DirectReader()
            early = rng.randint(0, min(len(data), READ_CHUNK))
            reader.feed_data(data[:early])

            async def feed(reader: DirectReader = reader, data: bytes = data, start: int = early) -> None:
                while start < len(data):
                    n = rng.randint(1, 1 << 18)
                    reader.feed_data(data[start : start + n])
                    start += n
                    if rng.random() < 0.3:
                        await asyncio.sleep(0)

            feeding = asyncio.ensure_future(feed())
            digest = blake3()
            got = await read_growing(reader, len(data), None, digest)
            await feeding
            assert got is not None and bytes(got) == data
            assert digest.hexdigest() == blake3(data).hexdigest()

    asyncio.run(go())


def _payload_first(sealer: Sealer, payload: bytes, digest_of: bytes | None = None) -> bytes:
    """A payload-first frame of a float32 tensor's bytes, its head signed over
    ``digest_of``'s digest (default: the payload's own)."""
    descs, chunks = encode_values([torch.frombuffer(bytearray(payload), dtype=torch.float32)])
    digest = payload_digest([memoryview(digest_of if digest_of is not None else payload)])
    head, _ = sealer.seal(Activations("r", 0, 0, 1), descs, chunks, digest=digest)
    return HEAD.pack(PAYLOAD_FIRST, 0) + PAYLOAD_SIZE.pack(len(payload)) + payload + head


def test_payload_first_frames_are_checked_like_any_other_and_only_taken_on_direct_streams() -> None:
    async def go() -> None:
        async with transport_pair("r", max_payload=PAYLOAD_FIRST_MIN * 2) as (a, b):
            big = torch.randn(PAYLOAD_FIRST_MIN // 4 + 1)
            out = a.prepare(b.peer_id, Activations("r", 0, 0, 1), [big])
            assert out.seal is None, "no direct stream yet: sealed head first"
            assert torch.equal(await _roundtrip(a, b, torch.ones(2)), torch.ones(2))
            out = a.prepare(b.peer_id, Activations("r", 1, 0, 1), [big])
            assert out.seal is not None and out.head == b"", "direct: hashed and sealed on its way"
            await a.transmit(out)
            assert torch.equal((await asyncio.wait_for(b.inbox.get(), 30)).values()[0], big)
            # on the same direct stream, a payload altered after signing: on plain TCP anyone on the
            # path could have altered it, so it is counted against no one, and the sender goes back to libp2p
            payload = bytes(4096)
            heard: list[tuple[str, str, str]] = []
            b.gate.listeners.append(lambda *event: heard.append(event))
            await a._write(b.peer_id, b.peer_id, MSG_PROTOCOL, [_payload_first(a.sealer, payload, bytes(4095) + b"x")])
            await _until(lambda: b.gate.counts[Reject.BAD_DIGEST] == 1)
            assert a.peer_id not in b.gate._abuse
            # the status page counts it as any other refusal (a banned member's frames on its direct
            # stream were missing from it), saying it is not held against the sender
            assert [(who, code) for who, code, _ in heard] == [(a.peer_id, "bad_digest")]
            assert heard[0][2].endswith("(on a direct stream: not held against it)")
            a.forget(b.peer_id)
            assert torch.equal(await _roundtrip(a, b, torch.ones(3), 2), torch.ones(3)), "over libp2p now"
            assert b.peer_id not in a.direct_to
        async with transport_pair("r", max_payload=PAYLOAD_FIRST_MIN * 2) as (a, b):
            await _roundtrip(a, b, torch.ones(1))
            too_big = HEAD.pack(PAYLOAD_FIRST, 0) + PAYLOAD_SIZE.pack(1 << 40)
            await a._write(b.peer_id, b.peer_id, MSG_PROTOCOL, [too_big])
            await _until(lambda: b.gate.counts[Reject.OVERSIZED] == 1)
        async with transport_pair("r", direct=False) as (a, b):
            await a._write(b.peer_id, b.peer_id, MSG_PROTOCOL, [_payload_first(a.sealer, bytes(4096))])
            await _until(lambda: b.gate.counts[Reject.MALFORMED] == 1)  # libp2p streams take heads first only

    asyncio.run(go())


def test_an_address_that_says_nothing_does_not_hold_up_the_one_that_answers() -> None:
    """Every address is dialled at once: one that accepts and then stays silent (or a
    firewall dropping the dial) costs nothing where another answers."""

    async def go() -> None:
        async with transport_pair("r") as (a, b):

            async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await asyncio.sleep(60)

            decoy = await asyncio.start_server(silent, "127.0.0.2", b.direct.port)
            try:
                start = asyncio.get_running_loop().time()
                addrs = ["/ip4/127.0.0.2/tcp/1", "/ip4/127.0.0.1/tcp/1"]
                streams = await a.direct.open(b.peer_id, MSG_PROTOCOL, addrs, a._ask_ticket)
                assert streams is not None and asyncio.get_running_loop().time() - start < 3
                streams[1].close()
            finally:
                decoy.close()

    asyncio.run(go())


def test_a_read_cancelled_midway_takes_no_more_bytes_into_its_buffer() -> None:
    """A payload's read cut short (its time ran out) stops filling its buffer at once:
    the stream's next bytes are the stream's, not written into an abandoned buffer."""

    async def go() -> None:
        reader = DirectReader()
        reader.feed_data(bytes(2 * READ_CHUNK))  # two parts at once: the second is yielded while the first is hashed
        task = asyncio.ensure_future(read_growing(reader, 3 * READ_CHUNK, None, blake3()))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reader.feed_data(b"abc")
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"abc"

    asyncio.run(go())


def test_an_address_that_resets_mid_handshake_means_libp2p_not_a_traceback() -> None:
    """uvloop raises RuntimeError writing to a connection the other end reset: an address
    that sends a challenge and resets gives no stream (libp2p), never an exception."""
    import socket
    import struct as st
    import threading

    import uvloop

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(bytes(CHALLENGE_BYTES))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, st.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_each, daemon=True).start()

    async def ask(peer: str) -> bytes:
        return OFFER.pack(1, port, bytes(16), bytes(32))

    async def go() -> None:
        for _ in range(20):
            direct = Direct([MSG_PROTOCOL], lambda peer: True)
            assert await direct.open("p", MSG_PROTOCOL, ["/ip4/127.0.0.1/tcp/1"], ask) is None
            assert not direct.worth_trying("p", MSG_PROTOCOL)

    try:
        uvloop.run(go())
    finally:
        listener.close()


def test_a_stream_opened_over_libp2p_moves_direct_and_its_frames_stay_in_order() -> None:
    """The receiver refused the first ticket (it was not ready): the message stream opened
    over libp2p. Once a ticket may be asked for again, a later write moves the stream onto
    the direct path on the side; frames sent back to back across the move all arrive, in
    the order sent (the receiver reads the libp2p stream's last frames first)."""

    async def go() -> None:
        async with transport_pair("r") as (a, b):
            b.direct.allowed = False
            x = torch.randn(1 << 18)  # 1 MiB: several are on their way through the daemons at the move
            assert torch.equal(await _roundtrip(a, b, x), x)
            large = torch.randn((LANE_THRESHOLD + (1 << 20)) // 4)
            assert torch.equal(await _roundtrip(a, b, large), large)
            assert not a.direct_to, "refused: over libp2p"
            assert any("/lane" in key for key in a._streams), "the large frame went on lanes"
            b.direct.allowed = True
            a.direct.clock = lambda: time.monotonic() + REFUSED_RETRY_S  # the refusal's wait is over
            read = b._frame

            async def slowly_over_libp2p(reader, sender, via=None, direct=False):  # type: ignore[no-untyped-def]
                if not direct:  # frames queue up on the libp2p stream, as behind a slow link
                    await asyncio.sleep(0.01)
                return await read(reader, sender, via, direct)

            b._frame = slowly_over_libp2p  # type: ignore[method-assign]
            moved_at = None
            for step in range(1, 61):
                await a.send(b.peer_id, Activations("r", step, 0, 1), [x * step])
                moved_at = moved_at or (step if a.direct_to else None)
            got = [await asyncio.wait_for(b.inbox.get(), 30) for _ in range(60)]
            assert [g.message.step for g in got] == list(range(1, 61))
            assert all(torch.equal(g.values()[0], x * g.message.step) for g in got)
            assert a.direct_to == {b.peer_id}, "the stream moved onto the direct path"
            assert not any("/lane" in key for key in a._streams), "its lanes were closed"
            assert moved_at is not None and 1 < moved_at < 60, f"moved between frames ({moved_at})"
            assert await _roundtrip(a, b, x, 61) is not None

    asyncio.run(go())


def test_a_senders_next_stream_is_read_once_its_last_one_ended_or_went_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender's new message stream is read after its previous one ends; while the old
    one still delivers (a slow link's tail) it is waited for past ``FENCE_S``; one that
    went quiet (half-open on a dead path) is given up on after ``FENCE_S``."""
    monkeypatch.setattr(upgrade, "FENCE_S", 0.3)
    heard = {"p": 0.0}
    order = upgrade.InOrder(lambda sender: heard.get(sender, 0.0))
    seen: list[str] = []

    async def reader(name: str, sender: str, hold: asyncio.Event | None) -> None:
        async with order.turn(sender):
            seen.append(f"{name} starts")
            if hold is not None:
                await hold.wait()
            seen.append(f"{name} ends")

    async def delivering(until: float) -> None:  # the old stream's bytes keep arriving
        while time.monotonic() < until:
            heard["p"] = time.monotonic()
            await asyncio.sleep(0.05)

    async def go() -> None:
        first_done = asyncio.Event()
        first = asyncio.create_task(reader("old", "p", first_done))
        await asyncio.sleep(0)
        second = asyncio.create_task(reader("new", "p", None))
        other = asyncio.create_task(reader("other", "q", None))  # another sender does not wait
        await asyncio.sleep(0.05)
        assert seen == ["old starts", "other starts", "other ends"]
        first_done.set()
        await asyncio.gather(first, second, other)
        assert seen[-3:] == ["old ends", "new starts", "new ends"]
        seen.clear()
        slow_done = asyncio.Event()
        slow = asyncio.create_task(reader("slow", "p", slow_done))
        await asyncio.sleep(0)
        feed = asyncio.create_task(delivering(time.monotonic() + 0.9))
        asyncio.get_running_loop().call_later(1.0, slow_done.set)
        await reader("after slow", "p", None)
        assert seen == ["slow starts", "slow ends", "after slow starts", "after slow ends"], "waited past FENCE_S"
        await asyncio.gather(slow, feed)
        seen.clear()
        stuck = asyncio.create_task(reader("stuck", "p", asyncio.Event()))  # never ends by itself, sends nothing
        await asyncio.sleep(0)
        start = time.monotonic()
        await reader("after stuck", "p", None)
        assert 0.25 <= time.monotonic() - start < 1.5, "gave up after FENCE_S of quiet"
        assert seen == ["stuck starts", "after stuck starts", "after stuck ends"]
        stuck.cancel()

    asyncio.run(go())


def test_a_refused_ticket_is_asked_for_again_soon_then_less_often_and_a_failed_dial_waits_long() -> None:
    now = [100.0]
    d = Direct([MSG_PROTOCOL], lambda peer: True, clock=lambda: now[0])
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there: a granted ticket's dial fails at once
    answers = {"refuse": OFFER.pack(0, 0, bytes(16), bytes(32)), "grant": OFFER.pack(1, port, bytes(16), bytes(32))}

    async def waits(answer: str, times: int) -> list[float]:
        out = []
        for _ in range(times):
            assert (
                await d.open("p", MSG_PROTOCOL, ["/ip4/127.0.0.1/tcp/1"], lambda peer: _bytes(answers[answer])) is None
            )
            out.append(d._retry["p"] - now[0])
            now[0] = d._retry["p"]  # the wait is over: asked again
        return out

    async def go() -> None:
        assert await waits("refuse", 4) == [REFUSED_RETRY_S * f for f in (1, 2, 4, 8)]
        assert (await waits("refuse", 10))[-1] == REFUSED_RETRY_MAX_S
        assert await waits("grant", 1) == [RETRY_S], "granted, but its port did not answer"
        assert await waits("refuse", 1) == [REFUSED_RETRY_S], "a grant ends the refusals in a row"

    asyncio.run(go())


async def _bytes(raw: bytes) -> bytes:
    return raw


def test_a_move_with_nothing_to_dial_waits_and_a_refused_one_waits_as_the_direct_path_says() -> None:
    now = [100.0]
    d = Direct([MSG_PROTOCOL], lambda peer: True, clock=lambda: now[0])
    moved: list[str] = []

    def upgrades(addrs: list[str], answer: bytes) -> upgrade.Upgrades:
        async def where(peer: str) -> list[str]:
            return addrs

        streams = {p: (None, None) for p in ("p", "q")}
        return upgrade.Upgrades(
            d,
            MSG_PROTOCOL,
            streams,
            defaultdict(asyncio.Lock),
            lambda peer: False,
            where,
            lambda peer: _bytes(answer),
            moved.append,  # type: ignore[arg-type]
        )

    async def moved_once(up: upgrade.Upgrades, peer: str) -> None:
        up.maybe(peer)
        await up._tasks[peer]  # the move, to its end

    async def go() -> None:
        nowhere = upgrades([], b"")  # no IP address: the direct path sets no wait
        await moved_once(nowhere, "p")
        assert nowhere._next["p"] == now[0] + upgrade.NOTHING_TO_DIAL_S
        nowhere.maybe("p")
        assert "p" not in nowhere._tasks, "waits"
        now[0] += upgrade.NOTHING_TO_DIAL_S
        await moved_once(nowhere, "p")  # tried again once the wait is over
        refused = upgrades(["/ip4/127.0.0.1/tcp/1"], OFFER.pack(0, 0, bytes(16), bytes(32)))
        await moved_once(refused, "q")
        assert "q" not in refused._next, "no wait of its own on top of the refusal's"
        assert d._retry["q"] == now[0] + REFUSED_RETRY_S
        assert moved == []

    asyncio.run(go())
