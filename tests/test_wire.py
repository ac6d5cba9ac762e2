"""The wire: values round-trip without pickle, bad frames are rejected with a reason,
and large payloads split over parallel lanes arrive whole."""

from __future__ import annotations

import asyncio

import pytest
import torch
from p2p import transport_pair

from protocol.net.transport import LANE_THRESHOLD
from protocol.wire.encoding import MAGIC, WireError, pack_bytes, read_frame, split_buffers
from protocol.wire.messages import PROTOCOL_VERSION, Activations, Message, StepDone
from protocol.wire.schema import MessageError


def _read(data: bytes, max_payload: int = 1 << 30):
    async def go():
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        return await read_frame(r, max_payload)

    return asyncio.run(go())


def test_values_round_trip() -> None:
    vals = [
        torch.randn(3, 4),
        (torch.arange(5), torch.Size([2, 3])),
        7,
        2.5,
        None,
        torch.tensor(1.5),
        torch.empty(0, 3),
        torch.randn(2, 2).bfloat16(),
        torch.ones(3, dtype=torch.bool),
    ]
    frame = _read(pack_bytes({"kind": "x"}, vals))
    out = frame.values()
    assert frame.header["kind"] == "x"
    for a, b in zip(vals, out, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, tuple):
            assert torch.equal(a[0], b[0]) and a[1] == b[1]
        else:
            assert a == b


def test_bad_frames_are_rejected() -> None:
    good = pack_bytes({"kind": "x"}, [torch.randn(100)])
    with pytest.raises(WireError, match="bad magic"):
        _read(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="over the limit"):
        _read(good, max_payload=100)  # refused from the header, before the payload is read
    with pytest.raises(WireError, match="ended inside a payload"):
        _read(good[:-10])
    assert _read(b"") is None
    forged = good.replace(b'"nbytes":400', b'"nbytes":404')
    with pytest.raises(WireError, match="cannot be 404 bytes"):
        _read(forged).values()
    with pytest.raises(WireError, match="header is not a JSON object"):
        _read(MAGIC + (2).to_bytes(4, "big") + b"[]")


def test_messages_decode_tolerantly_and_validate_strictly() -> None:
    msg = StepDone("run", 3, 1, 0, {"0": 1.5})
    header = {**msg.header(), "future_field": 1}
    assert Message.from_header(header) == msg
    with pytest.raises(MessageError, match="must be int"):
        Message.from_header({**msg.header(), "step": "3"})
    with pytest.raises(MessageError, match="unknown message kind"):
        Message.from_header({"kind": "nope", "v": PROTOCOL_VERSION})
    with pytest.raises(MessageError, match="lacks field 'run_id'"):
        Message.from_header({"kind": "done", "v": PROTOCOL_VERSION, "step": 1, "stage": 0, "replica": 0})


def test_an_optional_field_takes_its_type_or_null_and_nothing_else() -> None:
    """``float | None`` took any JSON value that was not a float (its ``None`` option
    let everything through): a string where a loss is due reached the spot check's
    arithmetic. Each field's check is also built once per type, not per frame."""
    from protocol.wire.messages import Recheck
    from protocol.wire.schema import checker

    msg = Recheck("run", 3, 1, "peer", ["in"], ["key"], loss=1.5)
    for loss in (None, 2.5, 7):
        assert Message.from_header({**msg.header(), "loss": loss}).loss == loss
    assert type(Message.from_header({**msg.header(), "loss": 7}).loss) is float
    for bad in ("1.5", [1.5], {"x": 1.5}, True):
        with pytest.raises(MessageError, match="field 'loss' has the wrong type"):
            Message.from_header({**msg.header(), "loss": bad})
    assert checker(list[float])("x", [1, 2]) == [1.0, 2.0]
    with pytest.raises(MessageError, match="must be an object"):
        checker(dict[str, int])("x", {1: 2})
    assert checker(dict[str, float]) is checker(dict[str, float])


def test_split_buffers_keeps_bytes_in_order() -> None:
    chunks = [memoryview(bytes(range(i, i + 10))) for i in range(0, 50, 10)]
    parts = split_buffers(chunks, 4)
    assert len(parts) == 4
    joined = b"".join(bytes(c) for part in parts for c in part)
    assert joined == bytes(range(50))


def test_transport_sends_small_and_laned_frames() -> None:
    async def go() -> None:
        async with transport_pair() as (a, b):
            big = torch.randn(LANE_THRESHOLD // 4 + 12345)
            small = torch.arange(10)
            await a.send(b.peer_id, Activations("r", 0, 0, 1), [small])
            await a.send(b.peer_id, Activations("r", 0, 1, 1), [big, small])
            await a.send(b.peer_id, Activations("r", 0, 2, 1), [small])
            got = [await asyncio.wait_for(b.inbox.get(), 30) for _ in range(3)]
            # a laned frame is joined on the side: the small frame after it need not wait
            assert sorted(g.message.mb for g in got) == [0, 1, 2] and got[0].message.mb == 0
            assert got[0].sender == a.peer_id
            vals = next(g for g in got if g.message.mb == 1).values()
            assert torch.equal(vals[0], big) and torch.equal(vals[1], small)
            assert a.bytes_sent[b.peer_id] > big.nbytes

    asyncio.run(go())


def test_a_payload_trickled_slower_than_the_minimum_rate_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that claims a payload and then sends a few bytes and stops (or
    trickles them) holds its stream only until the payload's deadline: grace plus its
    size at ``MIN_PAYLOAD_RATE``; an honest payload arrives whole."""
    from protocol.net import streams
    from protocol.wire.reject import Reject, Rejected

    monkeypatch.setattr(streams, "PAYLOAD_GRACE_S", 0.2)
    monkeypatch.setattr(streams, "MIN_PAYLOAD_RATE", 1000)
    assert streams.payload_deadline(1000) == pytest.approx(1.2)

    async def run() -> None:
        honest = asyncio.StreamReader()
        honest.feed_data(b"x" * 100)
        assert bytes(await streams.read_payload(honest, 100)) == b"x" * 100
        slow = asyncio.StreamReader()
        slow.feed_data(b"x" * 10)  # then nothing: the payload's 0.3 s pass
        start = asyncio.get_running_loop().time()
        with pytest.raises(Rejected) as err:
            await streams.read_payload(slow, 100)
        assert err.value.code is Reject.TRUNCATED and "did not arrive within" in str(err.value)
        assert asyncio.get_running_loop().time() - start < 2.0

    asyncio.run(run())


def test_allowed_kinds_come_from_the_message_classes() -> None:
    """Who sends which kind is declared on each message class; receivers' lists are derived."""
    from protocol.wire.messages import kinds_from

    peer = {"hello", "ready", "done", "state", "failure", "beat", "evaldone", "evidence", "verdict", "proberesult"}
    assert kinds_from("peer") == peer | {"resend"}
    coordinator = {"assign", "links", "finish", "release", "abort", "commit", "stagestate", "program", "evict"}
    others = {"standby", "audit", "recheck", "cert", "reach", "probelink", "reassign"}
    assert kinds_from("coordinator") == coordinator | others
    early = {"assign", "stagestate", "program", "abort", "evict", "standby", "finish", "release", "cert", "reach"}
    assert kinds_from("coordinator", early=True) == early | {"probelink", "reassign"}
    assert kinds_from("stage") == {"act", "grad", "rgrad", "evalact"}
    with pytest.raises(ValueError, match="no sender"):
        kinds_from("outsider")
