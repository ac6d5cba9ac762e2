"""Codecs: round trips within their stated bounds, AdaTopK's exact block top-k,
error feedback, and the link codec choice."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.codec_choice import MIN_FRACTION, MIN_RANK, choose_codecs
from protocol.wire.codecs import Codec, CodecError, ErrorFeedback, decode, encode, encode_parts, topk_select
from protocol.wire.encoding import Frame, Link, WireError, encode_values


def _roundtrip(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    parts, approx = encode(x, codec)
    out = decode([memoryview(bytes(p)) for p in parts], codec, x.dtype, list(x.shape))
    same = torch.allclose(out, approx, rtol=0, atol=0, equal_nan=True)
    assert same, "the sender's view of the decoded tensor must be what the receiver decodes"
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


@pytest.mark.parametrize("numel", [1, 255, 256, 1001, 4099])
def test_int4_error_is_at_most_half_a_step(numel: int) -> None:
    """16 levels over [-max, max] per block of 128: a step of 2 max / 15 (rounded up
    to bf16 by less than 1/64), so nearest rounding errs by at most max / 15."""
    codec = Codec("int4")
    assert codec.block == 128
    x = torch.randn(numel) * torch.linspace(0.01, 100, numel)
    out = _roundtrip(x, codec)
    assert codec.wire_bytes(numel, torch.float32) == math.ceil(numel / 128) * 2 + (numel + 1) // 2
    pad = -numel % 128
    blocks_max = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, 128).amax(dim=1)
    step = (blocks_max * 2 / 15).repeat_interleave(128)[:numel]
    assert torch.all((out - x).abs() <= step / 2 * (1 + 1 / 64))
    assert torch.all(out.abs() <= blocks_max.repeat_interleave(128)[:numel] * (1 + 1 / 64)), "within [-max, max]"


def test_int4_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    """Each value rounds to one of its two neighbouring codes, with the probabilities
    that make the mean of many encodings the value itself."""
    codec = Codec("int4", stochastic=True)
    x = torch.randn(512)
    gen = torch.Generator().manual_seed(0)
    outs = torch.stack([decode(encode_parts(x, codec, gen), codec, torch.float32, [512]) for _ in range(2000)])
    step = (x.view(4, 128).abs().amax(dim=1) * 2 / 15 * (1 + 1 / 64)).repeat_interleave(128)
    assert torch.all((outs - x).abs() < step * (1 + 1e-5))
    assert torch.all((outs.mean(dim=0) - x).abs() < step * 0.05), "the mean of 2000 encodings approaches x"
    assert not torch.equal(outs[0], outs[1]), "rounding is random"
    again = torch.Generator().manual_seed(0)
    assert torch.equal(decode(encode_parts(x, codec, again), codec, torch.float32, [512]), outs[0]), "and seeded"


@pytest.mark.parametrize("shape", [(4, 64, 128), (300, 20), (2, 3), (37,), (1, 1)])
def test_lowrank_is_exact_up_to_the_rank_and_optimal_beyond(shape: tuple[int, ...]) -> None:
    """A matrix of rank <= R comes back within fp16's precision; a fuller one loses
    exactly its singular values beyond R (Eckart-Young), within fp16 rounding."""
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (1, shape[0])
    r = min(3, rows, cols)
    low = (torch.randn(rows, r) @ torch.randn(r, cols)).view(shape)
    codec = Codec("lowrank", rank=3)
    assert (_roundtrip(low, codec) - low).norm() <= 2e-3 * low.norm()
    full = torch.randn(shape)
    s = torch.linalg.svdvals(full.reshape(rows, cols))
    lost = float(s[r:].square().sum().sqrt())
    err = float((_roundtrip(full, codec) - full).norm())
    assert err == pytest.approx(lost, rel=1e-2, abs=2e-3 * float(full.norm()))
    parts = encode_parts(full, codec)
    assert [len(p) for p in parts] == [rows * r * 2, r * 4, r * cols * 2]


def test_lowrank_falls_back_to_a_randomized_svd(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exact SVD that does not converge is no error: a randomized one takes over."""

    exact = torch.linalg.svd

    def fail_on_the_whole(m: torch.Tensor, **kwargs: object) -> object:
        if m.shape == (64, 40):
            raise torch.linalg.LinAlgError("did not converge")
        return exact(m, **kwargs)  # the randomized SVD's own small one

    monkeypatch.setattr(torch.linalg, "svd", fail_on_the_whole)
    low = torch.randn(64, 3) @ torch.randn(3, 40)
    assert (_roundtrip(low, Codec("lowrank", rank=3)) - low).norm() <= 2e-3 * low.norm()


def test_lowrank_of_a_non_finite_tensor_decodes_to_nan() -> None:
    """Like raw bytes would, a NaN or inf activation arrives as NaN (the loss shows it)."""
    x = torch.randn(8, 16)
    x[3, 4] = math.inf
    out = _roundtrip(x, Codec("lowrank", rank=2))
    assert torch.isnan(out).all()


def test_codec_pairs_parse_print_and_split_by_direction() -> None:
    pair = Codec.parse("lowrank:8/int4sr")
    assert str(pair) == "lowrank:8/int4sr"
    assert pair.forward == Codec("lowrank", rank=8)
    assert pair.backward == Codec("int4", stochastic=True)
    assert Codec.from_json(pair.to_json()) == pair
    assert Codec("int8").backward == Codec("int8") == Codec("int8").forward
    assert Codec.from_json(Codec("int8", rank=3).to_json()) == Codec("int8", rank=3), "rank only matters to lowrank"
    for bad in ("int4/int8/fp16", "lowrank:x", "int8:3", "lowrank:0"):
        with pytest.raises(CodecError):
            Codec.parse(bad)


def test_stochastic_gradients_skip_error_feedback() -> None:
    """Unbiased codes need no residual; a biased codec keeps one."""
    fb = ErrorFeedback()
    fb.encode("a", torch.randn(300), Codec("int4", stochastic=True))
    fb.encode("b", torch.randn(300), Codec("int4"))
    assert list(fb.residuals) == ["b"]


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
    ("values", "narrow"),
    [
        (torch.arange(256).view(4, 64), "uint8"),  # token ids of a byte-level model
        (torch.tensor([-128, 0, 127]), "int8"),
        (torch.tensor([-1, 30000]), "int16"),
        (torch.tensor([0, 50256]), "int32"),  # GPT-2's vocabulary (no uint16 here)
        (torch.tensor([0, 1 << 20], dtype=torch.int32), None),
        (torch.tensor([-(1 << 40), 3]), None),
        (torch.tensor([70000, 3]), "int32"),
    ],
)
def test_integer_tensors_travel_narrowed_on_compressing_links(values: torch.Tensor, narrow: str | None) -> None:
    descs, chunks = encode_values([values], Link(Codec("int4")))
    assert descs[0].get("narrow") == narrow
    out = Frame({"values": descs}, memoryview(bytearray(b"".join(bytes(c) for c in chunks)))).values()[0]
    assert out.dtype == values.dtype and torch.equal(out, values)
    stored = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, None: values.element_size()}[narrow]
    assert sum(len(c) for c in chunks) == values.numel() * stored
    plain, _ = encode_values([values], Link(Codec()))
    assert "narrow" not in plain[0], "uncompressed links carry the tensor as it is"


@pytest.mark.parametrize("narrow", ["float16", "int64", "int32", "bool", 3])
def test_a_forged_narrowing_is_refused(narrow: object) -> None:
    """Only a narrower integer type may carry an integer tensor (here int32)."""
    values = torch.arange(6, dtype=torch.int32)
    descs, chunks = encode_values([values])
    descs[0]["narrow"] = narrow
    with pytest.raises(WireError):
        Frame({"values": descs}, memoryview(bytearray(b"".join(bytes(c) for c in chunks)))).values()


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "zip"},
        {"name": "adatopk", "fraction": 0.0},
        {"name": "int8", "block": 1},
        "adatopk",
        {"name": "lowrank", "rank": 0},
        {"name": "lowrank", "rank": True},
        {"name": "int4", "stochastic": "yes"},
        {"name": "lowrank", "stochastic": True},
        {"name": "lowrank", "grad": {"name": "int4", "grad": {"name": "int8"}}},
        {"name": "lowrank", "grad": "int4"},
    ],
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


def test_auto_codec_takes_the_mildest_codec_that_suffices() -> None:
    """1 MB of fp32 activations (2048 x 128) per micro-batch, stages take 10 ms:
    1000 Mbit/s needs nothing, 500 fp16, 250 int8; under ``auto`` slower links keep
    int8 (nothing stronger keeps the loss within 1%), under ``auto-lowrank`` they get
    low-rank activations (rank from the bandwidth, never below MIN_RANK) with unbiased
    4-bit gradients."""
    spec = [{"t": "tensor", "dtype": "float32", "shape": [16, 128, 128]}, {"t": "py", "v": None}]
    nbytes = 16 * 128 * 128 * 4
    rates = [2000, 600, 300, 100, 1]
    accurate = choose_codecs([nbytes] * len(rates), rates, [0.01], "auto", edge_specs=[spec] * len(rates))
    assert [c.name for c in accurate] == ["none", "fp16", "int8", "int8", "int8"]
    codecs = choose_codecs([nbytes] * len(rates), rates, [0.01], "auto-lowrank", edge_specs=[spec] * len(rates))
    assert [c.name for c in codecs] == ["none", "fp16", "int8", "lowrank", "lowrank"]
    fast, slowest = codecs[3], codecs[4]
    assert fast.grad == Codec("int4", stochastic=True)
    budget = 0.01 * 100e6 / 8
    per_rank = 2 * (2048 + 128) + 4
    assert fast.rank == int(budget // per_rank), "the largest rank the link moves in time"
    assert fast.forward.wire_bytes(2048 * 128, torch.float32, [2048, 128]) <= budget
    assert slowest.rank == MIN_RANK
    pinned = choose_codecs([nbytes] * 2, [2000, 100], [0.01], "auto-lowrank", edge_specs=[spec] * 2, rank=3)
    assert pinned[0] == Codec() and pinned[1].rank == 3, "a pinned rank applies where low-rank is chosen"
    with pytest.raises(ValueError):
        choose_codecs([nbytes], [1], [0.01], "auto")


def test_finite_agrees_with_an_elementwise_check_on_every_dtype_and_layout() -> None:
    """``finite`` reads a tensor's sum, then where that is not finite its least and
    greatest values: it must see a NaN or an infinity anywhere, in every floating
    dtype, in a view that is not contiguous, and next to the largest finite numbers
    (which are finite, though their sum is not)."""
    from protocol.wire.codecs import finite

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        base = torch.randn(37, 41, generator=gen).to(dtype)
        assert finite(base) and finite(base.t()) and finite(torch.empty(0, dtype=dtype))
        big = torch.finfo(dtype).max
        assert finite(torch.full((5,), big, dtype=dtype)), "a sum that overflows is not poison"
        assert finite(torch.tensor([big, big, -big, -big] * 9, dtype=dtype)), "nor one that overflows both ways"
        for bad in (math.nan, math.inf, -math.inf):
            for where in [(0, 0), (36, 40), (int(torch.randint(37, (1,), generator=gen)), 17)]:
                t = base.clone()
                t[where] = bad
                assert not finite(t) and not finite(t.t()), (dtype, bad, where)
                assert finite(t) == bool(torch.isfinite(t).all())


def test_finite_falls_back_where_a_dtype_has_no_aminmax() -> None:
    from protocol.wire.codecs import finite

    values = torch.tensor([1.0, -2.0, 3.0])
    assert finite(values.to(torch.float8_e5m2))
    assert not finite(torch.tensor([1.0, math.nan]).to(torch.float8_e5m2))
    assert not finite(torch.tensor([1.0, math.inf]).to(torch.float8_e5m2))
