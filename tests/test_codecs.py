"""Codecs: round trips within their stated bounds, AdaTopK's exact block top-k,
error feedback, and the link codec choice."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.links import MIN_FRACTION, choose_codecs
from protocol.codecs import Codec, CodecError, ErrorFeedback, decode, encode, topk_select
from protocol.wire import Frame, Link, WireError, encode_values


def _roundtrip(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    parts, approx = encode(x, codec)
    out = decode([memoryview(bytes(p)) for p in parts], codec, x.dtype, list(x.shape))
    assert torch.equal(out, approx), "the sender's view of the decoded tensor must be what the receiver decodes"
    return out


@pytest.mark.parametrize("shape", [(7,), (3, 5, 11), (1000,), (0,), (256,), (257,)])
def test_none_roundtrips_exactly(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    assert torch.equal(_roundtrip(x, Codec("none")), x)


@pytest.mark.parametrize(("name", "rel"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_casts_roundtrip_within_their_precision(name: str, rel: float) -> None:
    x = torch.randn(4096) * 10
    out = _roundtrip(x, Codec(name))
    assert out.dtype == x.dtype
    assert torch.all((out - x).abs() <= rel * x.abs() + 1e-30)


@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4099])
def test_int8_error_is_at_most_a_block_max_over_254(numel: int) -> None:
    codec = Codec("int8", block=256)
    x = torch.randn(numel) * torch.linspace(0.01, 100, numel)
    out = _roundtrip(x, codec)
    pad = -numel % 256
    blocks_max = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, 256).amax(dim=1)
    bound = (blocks_max / 254).repeat_interleave(256)[:numel] * (1 + 1e-5)
    assert torch.all((out - x).abs() <= bound)


@pytest.mark.parametrize(("numel", "fraction", "block"), [(10_000, 0.01, 256), (4096, 0.1, 256), (5000, 0.03, 1024)])
def test_adatopk_keeps_exactly_each_blocks_top_k(numel: int, fraction: float, block: int) -> None:
    codec = Codec("adatopk", fraction, block)
    x = torch.randn(numel)
    out = _roundtrip(x, codec)
    k_total = codec.kept(numel)
    assert int((out != 0).sum()) == k_total
    blocks = math.ceil(numel / block)
    base, extra = divmod(k_total, blocks)
    padded = torch.cat([x, x.new_zeros(blocks * block - numel)]).view(blocks, block)
    got = torch.cat([out, out.new_zeros(blocks * block - numel)]).view(blocks, block)
    for b in range(blocks):
        k = base + (1 if b < extra else 0)
        kept = set(torch.nonzero(got[b]).flatten().tolist())
        top = set(padded[b].abs().topk(k).indices.tolist())
        assert kept == top, f"block {b}"
        # kept values are the inputs rounded to fp16
        idx = torch.tensor(sorted(kept), dtype=torch.long)
        assert torch.equal(got[b][idx], padded[b][idx].half().float())


def test_adatopk_wire_size_is_k_times_value_and_index_bytes() -> None:
    for block, index_bytes in ((256, 1), (4096, 2)):
        codec = Codec("adatopk", 0.01, block)
        k = codec.kept(1 << 20)
        assert k == round(0.01 * (1 << 20))
        assert codec.wire_bytes(1 << 20, torch.float32) == k * (2 + index_bytes)


def test_uint16_indices_above_32767_survive() -> None:
    codec = Codec("adatopk", 2 / 65536, 65536)
    x = torch.rand(65536) * 0.1
    x[40000] = 5.0
    x[65535] = -3.0
    out = _roundtrip(x, codec)
    assert torch.nonzero(out).flatten().tolist() == [40000, 65535]
    assert out[40000] == 5.0 and out[65535] == -3.0


def test_error_feedback_sum_of_sent_approaches_sum_of_inputs() -> None:
    torch.manual_seed(0)
    codec = Codec("adatopk", 0.05)
    ef = ErrorFeedback()
    total_in = torch.zeros(2048)
    sent_ef = torch.zeros(2048)
    sent_plain = torch.zeros(2048)
    for _ in range(200):
        g = torch.randn(2048) + 0.3
        total_in += g
        sent_ef += decode(ef.encode("edge", g, codec), codec, torch.float32, [2048])
        sent_plain += encode(g, codec)[1]
    err_ef = (sent_ef - total_in).norm() / total_in.norm()
    err_plain = (sent_plain - total_in).norm() / total_in.norm()
    # what was held back is exactly the residual still to be sent
    assert torch.allclose(sent_ef + ef.residuals[("edge")], total_in, atol=1e-3)
    assert err_ef < 0.1 and err_ef < err_plain / 5


def test_topk_select_matches_definition_on_ties_free_input() -> None:
    x = torch.randperm(512).float() - 256
    vals, idx = topk_select(x, Codec("adatopk", 4 / 256))
    assert sorted(vals.abs().tolist()) == sorted(x.view(2, 256).abs().topk(4, dim=1).values.flatten().tolist())
    assert idx.max() < 256


def test_codecs_inside_frames_and_links() -> None:
    x = torch.randn(4, 300)
    tokens = torch.arange(12).view(3, 4)
    descs, chunks = encode_values([x, (tokens, x), None], Link(Codec("adatopk", 0.1)))
    payload = memoryview(bytearray(b"".join(bytes(c) for c in chunks)))
    out = Frame({"values": descs}, payload).values()
    assert torch.equal(out[1][0], tokens), "integer tensors travel raw"
    assert int((out[0] != 0).sum()) == Codec("adatopk", 0.1).kept(1200)
    descs[0]["parts"][0] += 2
    with pytest.raises(WireError):
        Frame({"values": descs}, payload).values()


@pytest.mark.parametrize(
    "spec", [{"name": "zip"}, {"name": "adatopk", "fraction": 0.0}, {"name": "int8", "block": 1}, "adatopk"]
)
def test_bad_codec_specs_are_refused(spec: object) -> None:
    with pytest.raises(CodecError):
        Codec.from_json(spec)


def test_codec_choice_compresses_only_links_slower_than_compute() -> None:
    # 1 MB per micro-batch; stages take 10 ms; 10 Gbit/s carries 1 MB in 0.8 ms, 80 Mbit/s needs 100 ms
    codecs = choose_codecs([1_000_000, 1_000_000], [10_000, 80], [0.01, 0.01], "adatopk")
    assert codecs[0] == Codec()
    assert codecs[1].name == "adatopk"
    wire_s = codecs[1].wire_bytes(250_000, torch.float32) * 8 / 80e6
    assert wire_s <= 0.01 * 1.01, "just fast enough"
    assert codecs[1].fraction == pytest.approx(0.1 * 4 / 3, rel=0.01), "and no more compressed than that"
    slowest = choose_codecs([1_000_000], [0.001], [0.01], "adatopk")[0]
    assert slowest.fraction == MIN_FRACTION
    assert choose_codecs([1_000_000], [8], [0.01], "adatopk", fraction=0.2)[0].fraction == 0.2
    assert choose_codecs([1, 1], [1, 1], [1, 1], "fp16") == [Codec("fp16"), Codec("fp16")]
