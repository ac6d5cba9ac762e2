"""Over real libp2p streams: bad frames are dropped with their code and counted,
and the same sender's valid traffic on the same stream goes on."""

from __future__ import annotations

import asyncio

import pytest
import torch
from p2p import claiming, transport_pair, transports

from protocol.net.transport import MSG_PROTOCOL, Transport
from protocol.trust.identity import Identity
from protocol.wire.envelope import HEAD
from protocol.wire.messages import Activations
from protocol.wire.reject import Reject


def _sealed(t: Transport, msg: Activations, x: torch.Tensor, key: Identity | None = None) -> bytes:
    from protocol.wire.encoding import encode_values
    from protocol.wire.envelope import Sealer

    sealer = t.sealer if key is None else Sealer(key, t.peer_id)
    descs, chunks = encode_values([x])
    head, _ = sealer.seal(msg, descs, chunks)
    return head + b"".join(bytes(c) for c in chunks)


async def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_bad_frames_are_dropped_and_valid_traffic_goes_on() -> None:
    """On a libp2p stream (authenticated, encrypted: what arrives is the sender's); a
    direct stream's bytes that no signature proves are no one's (tests/test_direct.py)."""

    async def go() -> None:
        async with transport_pair("r", max_payload=1 << 20, direct=False) as (a, b):
            x = torch.randn(64)
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [x])
            good = _sealed(a, Activations("r", 0, 1, 1), x)
            forged = _sealed(a, Activations("r", 0, 2, 1), x, key=Identity.generate())
            tampered = bytearray(_sealed(a, Activations("r", 0, 3, 1), x))
            tampered[-1] ^= 0xFF
            other_run = _sealed(a, Activations("elsewhere", 0, 4, 1), x)
            raw = [good, good, forged, bytes(tampered), other_run]  # the second `good` is a replay
            await a._write(b.peer_id, b.peer_id, MSG_PROTOCOL, raw)
            await a.send(b.peer_id, Activations("r", 0, 5, 1), [x])
            got = [await asyncio.wait_for(b.inbox.get(), 20) for _ in range(3)]
            assert [g.message.mb for g in got] == [0, 1, 5]
            assert torch.equal(got[2].values()[0], x)
            await _until(lambda: sum(b.gate.counts.values()) == 4)
            assert b.gate.counts == {
                Reject.REPLAY: 1,
                Reject.BAD_SIGNATURE: 1,
                Reject.BAD_DIGEST: 1,
                Reject.WRONG_RUN: 1,
            }
            assert b.inbox.empty()
            assert {r[2] for r in b.gate.recent} == {"replay", "bad_signature", "bad_digest", "wrong_run"}

    asyncio.run(go())


def test_oversized_frame_is_rejected_before_its_payload_arrives() -> None:
    async def go() -> None:
        async with transport_pair("r", max_payload=1 << 20) as (a, b):
            frame = _sealed(a, Activations("r", 0, 0, 1), torch.zeros(1 << 19))  # 2 MiB payload
            end = HEAD.size + HEAD.unpack_from(frame)[1] + 64
            # only the head is sent: the receiver must not wait for 2 MiB that never come
            await a._write("probe", b.peer_id, MSG_PROTOCOL, [frame[:end]])
            await _until(lambda: b.gate.counts[Reject.OVERSIZED] == 1, timeout=10)
            x = torch.ones(3)
            await a.send(b.peer_id, Activations("r", 0, 1, 1), [x])  # its other stream still works
            got = await asyncio.wait_for(b.inbox.get(), 20)
            assert got.message.mb == 1

    asyncio.run(go())


def test_unadmitted_sender_is_refused() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            b.gate.keys.clear()
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [torch.ones(2)])
            await _until(lambda: b.gate.counts[Reject.NOT_ADMITTED] == 1)
            assert b.inbox.empty()

    asyncio.run(go())


def test_paced_link_takes_as_long_as_its_rate_says() -> None:
    async def go() -> None:
        async with transport_pair("r") as (a, b):
            x = torch.zeros(250_000)  # 1 MB
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [x])  # opens the stream
            await b.inbox.get()
            a.set_rate(b.peer_id, 40.0)  # 40 Mbit/s: 1 MB takes 0.2 s
            loop = asyncio.get_running_loop()
            start = loop.time()
            for mb in range(1, 4):
                await a.send(b.peer_id, Activations("r", 0, mb, 1), [x])
            for _ in range(3):
                await asyncio.wait_for(b.inbox.get(), 20)
            took = loop.time() - start
            assert 0.6 <= took < 2.0, took
            up, _ = await a.measure_bandwidth(b.peer_id, 1 << 20, down=False)
            assert 25 < up <= 41, up

    asyncio.run(go())


def test_rejected_laned_frame_leaves_no_parts_behind() -> None:
    async def go() -> None:
        from protocol.net.transport import LANE_THRESHOLD

        async with transport_pair("r") as (a, b):
            big = torch.randn(LANE_THRESHOLD // 4 + 1000)  # over the threshold: travels on lanes
            await a.send(b.peer_id, Activations("elsewhere", 0, 0, 1), [big])
            await _until(lambda: b.gate.counts[Reject.WRONG_RUN] == 1)
            await a.send(b.peer_id, Activations("r", 0, 1, 1), [big])
            got = await asyncio.wait_for(b.inbox.get(), 30)
            assert got.message.mb == 1 and torch.equal(got.values()[0], big)
            # each lane stream is in order: the good frame's parts came after the rejected one's
            assert not b._lane_parts, "the rejected frame's lane parts are dropped, not kept"

    asyncio.run(go())


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "libp2p"])
def test_broken_bandwidth_probe_is_peer_unreachable(direct: bool) -> None:
    """A probe whose other end hangs up is a PeerUnreachable (one line to the user),
    not a stray IncompleteReadError, on either data path."""

    async def go() -> None:
        from protocol.net.probe import BW_PROTOCOL
        from protocol.net.transport import PeerUnreachable

        async with transport_pair("r", direct=direct) as (a, b):

            async def hang_up(info, reader, writer) -> None:  # type: ignore[no-untyped-def]
                await reader.read(10)
                writer.close()

            await b.p2p.remove_binary_stream_handler(BW_PROTOCOL)
            await b.p2p.add_binary_stream_handler(BW_PROTOCOL, hang_up)
            b.direct._handlers[BW_PROTOCOL] = hang_up
            with pytest.raises(PeerUnreachable, match="bandwidth probe with peer"):
                await asyncio.wait_for(a.measure_bandwidth(b.peer_id, 1 << 20), 30)

    asyncio.run(go())


def _described(x: torch.Tensor) -> tuple[list, list]:
    from protocol.wire.encoding import encode_values

    return encode_values([x])


def test_a_claimed_4gib_payload_allocates_nothing_until_bytes_arrive() -> None:
    """An admitted sender's head claims 4 GiB and sends 1 MiB: the receiver holds what
    arrived, not what was claimed (RSS grows by well under 64 MiB)."""
    import psutil

    async def go() -> None:
        async with transport_pair("r") as (a, b):
            head = claiming(a.sealer, 4 << 30)
            rss = psutil.Process().memory_info().rss
            await a._write("claim", b.peer_id, MSG_PROTOCOL, [head, bytes(1 << 20)])
            await asyncio.sleep(1.0)
            grown = psutil.Process().memory_info().rss - rss
            assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB on a 4 GiB claim"

    asyncio.run(go())


def test_bandwidth_probes_answer_only_admitted_peers_and_never_amplify(monkeypatch: pytest.MonkeyPatch) -> None:
    import protocol.net.probe as probe

    monkeypatch.setattr(probe, "ADMISSION_WAIT_S", 0.5)

    async def go() -> None:
        from protocol.net.probe import BW_PROTOCOL, PROBE_BUDGET_BYTES
        from protocol.net.transport import PeerUnreachable
        from protocol.wire.encoding import write_frame

        async with transport_pair("r") as (a, b):
            up, down = await a.measure_bandwidth(b.peer_id, 1 << 20)  # admitted: measured both ways
            assert up > 0 and down > 0
            # asking back more than was sent: refused, nothing comes back
            reader, writer = await a._open(b.peer_id, BW_PROTOCOL)
            await write_frame(writer, {"down_bytes": 10 << 20}, [torch.zeros(16, dtype=torch.uint8)])
            assert await reader.read(1) == b""
            writer.close()
            await _until(lambda: b.gate.counts[Reject.PROBE_LIMIT] == 1)
            # over the budget per minute: refused
            with pytest.raises(PeerUnreachable) as refused:
                for _ in range(PROBE_BUDGET_BYTES // (32 << 20) + 1):
                    await a.measure_bandwidth(b.peer_id, 16 << 20)
            assert b.gate.counts[Reject.PROBE_LIMIT] == 2, f"the prober saw {refused.value}, not the budget's refusal"
            # not admitted: refused
            b.gate.keys.clear()
            with pytest.raises(PeerUnreachable):
                await a.measure_bandwidth(b.peer_id, 1 << 10)
            await _until(lambda: b.gate.counts[Reject.NOT_ADMITTED] == 1, timeout=10)

    asyncio.run(go())


def test_lane_parts_no_head_claims_are_bounded_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    import protocol.net.transport as transport

    monkeypatch.setattr(transport, "LANE_PART_TTL_S", 0.5)

    async def go() -> None:
        from protocol.net.transport import _LANE_HEAD, LANE_PROTOCOL, MAX_WAITING_PARTS

        async with transport_pair("r") as (a, b):
            parts = [_LANE_HEAD.pack(1000 + i, 0, 1024) + bytes(1024) for i in range(MAX_WAITING_PARTS + 4)]
            await a._write("orphans", b.peer_id, LANE_PROTOCOL, parts)
            await _until(lambda: b.gate.counts[Reject.UNEXPECTED] == 1)
            assert len(b._lane_parts) == MAX_WAITING_PARTS, "the rest were refused"
            await asyncio.sleep(0.6)
            await a._write("late", b.peer_id, LANE_PROTOCOL, [_LANE_HEAD.pack(5000, 0, 8) + bytes(8)])
            await _until(lambda: len(b._lane_parts) == 1)  # the expired ones are gone, the new one waits

    asyncio.run(go())


def test_open_streams_per_sender_are_bounded() -> None:
    """A sender opening streams and never closing them holds at most
    MAX_STREAMS_PER_PEER of them: the rest are closed unread and counted as
    ``streams`` rejections; once its streams close it may open new ones."""
    from protocol.net.transport import MAX_STREAMS_PER_PEER

    async def go() -> None:
        async with transport_pair("r") as (a, b):
            held = [await a._open_p2p(b.peer_id, MSG_PROTOCOL) for _ in range(MAX_STREAMS_PER_PEER + 4)]
            await _until(lambda: b.gate.counts[Reject.STREAMS] == 4)
            assert b.open_streams == {a.peer_id: MAX_STREAMS_PER_PEER}
            reads = [asyncio.ensure_future(r.read(1)) for r, _ in held]  # the handlers may run in any order
            await _until(lambda: sum(t.done() for t in reads) >= 4, timeout=10)
            await asyncio.sleep(0.5)
            assert [t.result() for t in reads if t.done()] == [b""] * 4, "the streams over the limit were closed"
            for t in reads:
                t.cancel()
            for _, w in held:
                w.close()
            await _until(lambda: not b.open_streams)
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [torch.ones(2)])
            assert (await asyncio.wait_for(b.inbox.get(), 20)).message.mb == 0

    asyncio.run(go())


def test_payload_bytes_in_flight_wait_for_room_and_all_arrive() -> None:
    """With a per-sender budget smaller than one lane part, a laned frame's four parts
    are read one at a time (each waits for room; none is refused) and the frame
    arrives whole; then nothing is held."""
    from protocol.net.budget import ByteBudget
    from protocol.net.transport import LANE_THRESHOLD

    async def go() -> None:
        # libp2p only: lanes are libp2p's; a direct stream, once up, carries the frame whole
        async with transport_pair("r", direct=False) as (a, b):
            b.budget = ByteBudget(per_sender=1 << 20)
            big = torch.randn(LANE_THRESHOLD // 4 + 1000)
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [big])
            got = await asyncio.wait_for(b.inbox.get(), 30)
            assert torch.equal(got.values()[0], big)
            assert b.budget.waits >= 1 and not b.budget.held and not any(b.gate.counts.values())

    asyncio.run(go())


def test_a_byte_budget_admits_what_fits_and_one_payload_alone() -> None:
    """Per sender: a claim over the limit is read alone and the sender's next waits;
    another sender is not held up by it (a never-paid claim must not stop everyone)."""
    from protocol.net.budget import ByteBudget

    async def go() -> None:
        budget, order = ByteBudget(per_sender=100), []

        async def read(sender: str, n: int, tag: str, hold_s: float) -> None:
            async with budget.hold(sender, n):
                order.append(f"+{tag}")
                await asyncio.sleep(hold_s)
            order.append(f"-{tag}")

        await asyncio.gather(
            read("p", 500, "big", 0.05),  # over the limit: admitted alone
            read("p", 60, "p1", 0.0),  # waits for the big one
            read("q", 60, "q1", 0.0),  # another sender: not held up
        )
        assert order.index("+q1") < order.index("-big") < order.index("+p1"), order
        assert budget.waits == 1 and not budget.held
        cancelled = asyncio.ensure_future(read("p", 90, "gone", 10.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert not budget.held, "a cancelled reader releases its bytes"

    asyncio.run(go())


def test_frames_forwarded_between_two_peers_arrive_as_their_senders_and_unforged() -> None:
    """A sends to D through F (both behind NATs, say): D receives A's frame as A's, the
    bytes F passed on are counted; F cannot alter a frame (D refuses it and blames F)
    nor pass on what A did not sign; a peer that does not forward refuses to."""
    from protocol.net.forward import FWD_PROTOCOL, route_head

    async def go() -> None:
        async with transports(3) as (a, f, d):
            f.forwarder.relay_ok = lambda origin, dest, nbytes: True
            a.forward_via[d.peer_id] = f.peer_id
            # a peer D does not take forwarded frames from cannot pass it even A's real frames
            await a._write("u", d.peer_id, FWD_PROTOCOL, [route_head(d.peer_id, f.peer_id), b"x" * 64])
            await _until(lambda: d.gate.counts[Reject.UNEXPECTED] == 1)
            d.forwarder.forwarders = {f.peer_id}
            x = torch.randn(1000)
            await a.send(d.peer_id, Activations("r", 0, 0, 1), [x])
            got = await asyncio.wait_for(d.inbox.get(), 20)
            assert got.sender == a.peer_id and torch.equal(got.values()[0], x)
            assert f.forwarder.forwarded[(a.peer_id, d.peer_id)] > 4000
            # F alters a frame of A's on its way: D's gate refuses it, blaming F
            tampered = bytearray(_sealed(a, Activations("r", 0, 1, 1), x))
            tampered[-1] ^= 0xFF
            await f._write("t", d.peer_id, FWD_PROTOCOL, [route_head(d.peer_id, a.peer_id), bytes(tampered)])
            await _until(lambda: d.gate.counts[Reject.BAD_DIGEST] == 1)
            assert [r[1] for r in d.gate.recent if r[2] == "bad_digest"] == [f.peer_id]
            # a frame A did not sign is not passed on (F refuses it from the stream's peer)
            forged = _sealed(a, Activations("r", 0, 2, 1), x, key=Identity.generate())
            await a._write("t", f.peer_id, FWD_PROTOCOL, [route_head(d.peer_id, a.peer_id), forged])
            await _until(lambda: f.gate.counts[Reject.BAD_SIGNATURE] == 1)
            # nor a payload that is not what A signed: refused at F (A's doing), D never sees it
            bad = bytearray(_sealed(a, Activations("r", 0, 4, 1), x))
            bad[-1] ^= 0xFF
            await a._write("t2", f.peer_id, FWD_PROTOCOL, [route_head(d.peer_id, a.peer_id), bytes(bad)])
            await _until(lambda: f.gate.counts[Reject.BAD_DIGEST] == 1)
            assert [r[1] for r in f.gate.recent if r[2] == "bad_digest"] == [a.peer_id]
            f.forwarder.relay_ok = None
            await a.send(d.peer_id, Activations("r", 0, 3, 1), [x])
            await _until(lambda: f.gate.counts[Reject.UNEXPECTED] == 1)
            assert d.inbox.empty()
            assert [r[1] for r in d.gate.recent if r[2] == "unexpected"] == [a.peer_id], "the forwarder was blamed"

    asyncio.run(go())


def test_a_sender_not_admitted_holds_two_streams_and_only_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh identities cost nothing: one not admitted may hold MAX_STREAMS_OUTSIDER
    streams, each closed if no frame head (its hello) comes within FIRST_HEAD_S."""
    import protocol.net.transport as transport

    monkeypatch.setattr(transport, "FIRST_HEAD_S", 0.5)

    async def go() -> None:
        async with transport_pair("r") as (a, b):
            b.gate.keys.pop(a.peer_id)
            held = [await a._open_p2p(b.peer_id, MSG_PROTOCOL) for _ in range(transport.MAX_STREAMS_OUTSIDER + 2)]
            await _until(lambda: b.gate.counts[Reject.STREAMS] == 2)
            await _until(lambda: b.gate.counts[Reject.TRUNCATED] == transport.MAX_STREAMS_OUTSIDER)
            assert not b.open_streams, "the idle streams were closed"
            for _, w in held:
                w.close()

    asyncio.run(go())


def test_a_cancel_that_comes_as_a_stream_open_fails_is_honoured() -> None:
    """When a stream open fails at the moment its task is cancelled, asyncio's
    ``wait_for`` raises the failure, not the cancel; ``_open`` must still stop, not
    retry and later fail a task nobody awaits (a CI run showed that traceback)."""
    from types import SimpleNamespace

    calls = 0

    async def run() -> None:
        me = asyncio.current_task()

        async def failing_open(pid: object, protocol: str) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                me.cancel()  # the cancel arrives while this call fails
            raise FileNotFoundError(2, "No such file or directory")

        fake = SimpleNamespace(_known={}, dials_in=set(), p2p=SimpleNamespace(call_binary_stream_handler=failing_open))
        await Transport._open_p2p(fake, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", MSG_PROTOCOL)  # type: ignore[arg-type]

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    assert calls == 1
