"""The planner's model of ``auto``'s ladder (coordinator/codec_price.py): the codec
a link gets, its bytes each way, and its steps factor, against hand-computed cases,
the live choice (``codec_choice.auto_codec``) and ``Codec.wire_bytes``; the shipped data
file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from coordinator import codec_price
from coordinator.codec_choice import MIN_RANK, auto_codec
from coordinator.codec_price import (
    PRICED,
    CodecPriceError,
    edge_price,
    floor_price,
    load_factors,
    plan_steps_factor,
    shipped_factors,
    steps_factor,
)
from protocol.wire.codecs import Codec

ROOT = Path(__file__).resolve().parent.parent

#: an edge of GPT-2 small's width: 8 x 1024 tokens of 768 fp32 values, 64 KiB of token ids beside them
ROWS, COLS = 8192, 768
NUMEL = ROWS * COLS
FLOAT_BYTES = NUMEL * 4  # 25,165,824
OTHER = 65536
MBPS = 100.0
SECONDS = FLOAT_BYTES * 8 / (MBPS * 1e6)  # 2.013 s to move the floating values


def _price(too_slow: float, rank: int | None = None, mode: str = "auto-lowrank") -> codec_price.EdgePrice:
    """The edge on a link ``too_slow`` times slower than its bound (under ``mode``)."""
    return edge_price(FLOAT_BYTES, OTHER, COLS, MBPS, SECONDS / too_slow, rank, mode=mode)


def test_fast_link_gets_no_codec_and_costs_no_steps() -> None:
    p = _price(0.5)
    assert p.codec == Codec()
    assert p.forward_bytes == FLOAT_BYTES + OTHER and p.backward_bytes == FLOAT_BYTES
    assert p.steps_factor == 1.0


def test_link_1_5x_too_slow_gets_fp16() -> None:
    p = _price(1.5)
    assert p.codec == Codec("fp16")
    assert p.forward_bytes == NUMEL * 2 + OTHER and p.backward_bytes == NUMEL * 2
    assert p.steps_factor == shipped_factors()["fp16"]


def test_link_3x_too_slow_gets_int8() -> None:
    p = _price(3.0)
    assert p.codec == Codec("int8")
    blocks = NUMEL // 256  # an fp32 scale per block of 256, one byte per value
    assert p.forward_bytes == NUMEL + 4 * blocks + OTHER and p.backward_bytes == NUMEL + 4 * blocks
    assert p.steps_factor == shipped_factors()["int8"]


def test_link_50x_too_slow_gets_the_rank_that_fits() -> None:
    p = _price(50.0)
    # budget 25,165,824 / 50 = 503,316 bytes; a rank costs 2 x (8192 + 768) + 4 = 17,924: rank 28
    assert p.codec == Codec("lowrank", rank=28, grad=Codec("int4", stochastic=True))
    assert p.forward_bytes == 8192 * 28 * 2 + 28 * 4 + 28 * 768 * 2 + OTHER  # U fp16, S fp32, V^T fp16
    assert p.forward_bytes - OTHER <= FLOAT_BYTES / 50
    # the gradients come back as unbiased 4-bit codes: a bf16 step per block of 128, two codes a byte
    assert p.backward_bytes == NUMEL // 128 * 2 + NUMEL // 2
    assert p.steps_factor == shipped_factors()["lowrank/int4sr"]


def test_lowrank_never_below_min_rank() -> None:
    p = _price(1000.0)  # the budget fits rank 1
    assert p.codec.name == "lowrank" and p.codec.rank == MIN_RANK
    assert p.forward_bytes == floor_price(FLOAT_BYTES, OTHER, COLS, mode="auto-lowrank").forward_bytes
    assert _price(50.0, rank=10).codec.rank == 10  # --rank pins it


@pytest.mark.parametrize("too_slow", [50.0, 1000.0])
def test_auto_stops_at_int8_however_slow_the_link(too_slow: float) -> None:
    """``auto`` keeps the loss within 1%: past int8 it takes nothing stronger (the
    edge's floor is int8's bytes), where ``auto-lowrank`` goes on to low rank."""
    p = _price(too_slow, mode="auto")
    assert p.codec == Codec("int8") and p.steps_factor == shipped_factors()["int8"]
    assert p.forward_bytes == floor_price(FLOAT_BYTES, OTHER, COLS).forward_bytes
    assert _price(too_slow, rank=10, mode="auto").codec == Codec("int8"), "--rank applies to low rank only"


@pytest.mark.parametrize("too_slow", [0.9, 1.0, 1.2, 2.0, 2.5, 3.9, 4.0, 7.0, 50.0, 400.0, 1e5])
def test_same_choice_as_the_live_swarm(too_slow: float) -> None:
    """The live choice reads the value specs; a [8, 1024, 768] tensor is the same matrix."""
    spec = [{"t": "tensor", "dtype": "float32", "shape": [8, 1024, COLS]}, {"t": "tensor", "dtype": "int64"}]
    for mode in ("auto", "auto-lowrank"):
        live = auto_codec(FLOAT_BYTES, MBPS, SECONDS / too_slow, spec, mode=mode)
        assert _price(too_slow, mode=mode).codec == live


@pytest.mark.parametrize("text", ["none", "fp16", "int8", "lowrank:28/int4sr", "lowrank:8/int4sr"])
def test_wire_bytes_match_the_codec(text: str) -> None:
    codec = Codec.parse(text)
    p = codec_price.price(codec, FLOAT_BYTES, OTHER, COLS)
    shape = [8, 1024, COLS]
    assert p.forward_bytes == OTHER + codec.forward.wire_bytes(NUMEL, torch.float32, shape)
    assert p.backward_bytes == codec.backward.wire_bytes(NUMEL, torch.float32, shape)


def test_a_half_precision_edge_counts_elements_of_two_bytes() -> None:
    p = codec_price.price(Codec("int8"), NUMEL * 2, 0, COLS, itemsize=2)
    assert p.forward_bytes == Codec("int8").wire_bytes(NUMEL, torch.float16)


def test_plan_factor_is_the_product_of_its_edges() -> None:
    f = shipped_factors()
    lowrank = Codec.parse("lowrank:12/int4sr")
    assert plan_steps_factor([]) == 1.0
    assert plan_steps_factor([Codec(), Codec("fp16"), lowrank]) == pytest.approx(f["fp16"] * f["lowrank/int4sr"])
    assert steps_factor(Codec("adatopk", 0.3)) == f["adatopk"]


def test_unpriced_codec_is_an_error() -> None:
    with pytest.raises(CodecPriceError, match="bf16"):
        steps_factor(Codec("bf16"))


def test_shipped_file_parses_with_every_factor_finite_and_at_least_one() -> None:
    factors = shipped_factors()
    assert set(factors) == set(PRICED)
    assert all(math.isfinite(v) and v >= 1 for v in factors.values()), factors
    data = json.loads((ROOT / "coordinator" / "codec_steps.json").read_text())
    assert {"command", "date", "steps", "seeds"} <= set(data["source"]), data["source"]
    assert set(data["measured"]["steps_factor"]) == set(PRICED)


def test_shipped_file_is_package_data() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    data = re.search(r"^\[tool\.setuptools\.package-data\]\ncoordinator = \[(.*)\]$", pyproject, re.M)
    assert data and '"codec_steps.json"' in data.group(1), "pyproject.toml does not ship coordinator/codec_steps.json"


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"factors": 3}',
        '{"factors": {"fp16": 1.0, "int8": 1.0, "adatopk": 1.5}}',
        '{"factors": {"fp16": 1.0, "int8": 1.0, "lowrank/int4sr": NaN, "adatopk": 1.5}}',
        '{"factors": {"fp16": 0.9, "int8": 1.0, "lowrank/int4sr": 1.1, "adatopk": 1.5}}',
        '{"factors": {"fp16": "1", "int8": 1.0, "lowrank/int4sr": 1.1, "adatopk": 1.5}}',
    ],
)
def test_damaged_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "codec_steps.json"
    path.write_text(text)
    with pytest.raises(CodecPriceError, match="damaged"):
        load_factors(path)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CodecPriceError, match="convergence.py"):
        load_factors(tmp_path / "nothing.json")
