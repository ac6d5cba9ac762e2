"""What compressing a cut edge costs the plan, the way the live swarm compresses.

The live swarm's ``auto`` mode (``coordinator/codec_choice.py``) gives a slow edge the
mildest codec that makes it fast enough: fp16, then int8 (``auto-lowrank`` goes on to
activations at low rank with their gradients as unbiased 4-bit codes,
``lowrank:R/int4sr``). The
planner needs three things of that choice, per edge: the codec, the bytes it puts
on the wire each way (forward activations and backward gradients differ under
``lowrank/int4sr``), and its statistical price, the factor by which it stretches
the steps to a given loss. The factors are data, measured by
``benchmarks/convergence.py`` and shipped as ``coordinator/codec_steps.json``, so
the planner can minimise time to a loss rather than time per step.

Pure functions; the choice itself is ``codec_choice.choose_codecs``'s (one copy of
the ladder and of ``MIN_RANK``), applied to an edge modelled as one floating matrix
(``matrix_spec``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from coordinator.codec_choice import STRONGEST, choose_codecs
from protocol.wire.codecs import Codec

#: the data file's name, in this package
STEPS_FILE = "codec_steps.json"
#: the codecs the data file must price: auto's ladder and AdaTopK (``none`` costs nothing)
PRICED = ("fp16", "int8", "lowrank/int4sr", "adatopk")
_DTYPES = {8: ("float64", torch.float64), 4: ("float32", torch.float32), 2: ("float16", torch.float16)}
_MEASURE = "python benchmarks/convergence.py --store coordinator/codec_steps.json"


class CodecPriceError(RuntimeError):
    """The steps-factor data is missing or damaged, or a codec has no measured price."""


@dataclass(frozen=True)
class EdgePrice:
    """One cut edge under ``auto``: its codec, bytes on the wire per micro-batch each
    way, and the factor by which it stretches the steps to a given loss."""

    codec: Codec
    forward_bytes: float  # activations (and any raw values) sent forward
    backward_bytes: float  # their gradients sent back
    steps_factor: float


def edge_price(
    float_bytes: float,
    other_bytes: float,
    cols: int,
    mbps: float,
    bound_s: float,
    rank: int | None = None,
    itemsize: int = 4,
    mode: str = "auto",
) -> EdgePrice:
    """The codec ``auto`` gives an edge carrying ``float_bytes`` of floating tensors
    (elements of ``itemsize`` bytes) and ``other_bytes`` of raw ones per micro-batch,
    over ``mbps`` Mbit/s, when a transfer must take at most ``bound_s`` seconds.
    The floating values count as one matrix of ``cols`` columns (the edge's widest),
    which sets the low-rank size: rank R costs R x (2 x (rows + cols) + 4) bytes.
    As in the live swarm, only the floating bytes decide the codec; the raw ones
    ride along uncompressed, forward only (integers have no gradients).
    ``rank`` pins the low rank, as ``--rank`` does; ``mode``: ``auto`` or ``auto-lowrank``."""
    spec = matrix_spec(float_bytes, cols, itemsize)
    codec = choose_codecs([float_bytes], [mbps], [bound_s], mode, edge_specs=[spec], rank=rank)[0]
    return price(codec, float_bytes, other_bytes, cols, itemsize)


def floor_price(float_bytes: float, other_bytes: float, cols: int, itemsize: int = 4, mode: str = "auto") -> EdgePrice:
    """The edge at ``mode``'s strongest compression (``auto``: int8; ``auto-lowrank``: low
    rank ``MIN_RANK``): the fewest bytes it can ever send, however slow the link."""
    return price(STRONGEST[mode], float_bytes, other_bytes, cols, itemsize)


def price(codec: Codec, float_bytes: float, other_bytes: float, cols: int, itemsize: int = 4) -> EdgePrice:
    """An edge's bytes each way and steps factor under a given ``codec`` (as
    :func:`edge_price` models the edge)."""
    _, numel, shape = _one_matrix(float_bytes, cols, itemsize)
    dtype = _DTYPES[itemsize][1]
    forward = other_bytes + _wire(codec.forward, float_bytes, numel, dtype, shape)
    backward = _wire(codec.backward, float_bytes, numel, dtype, shape)
    return EdgePrice(codec, float(forward), float(backward), steps_factor(codec))


def _wire(codec: Codec, float_bytes: float, numel: int, dtype: torch.dtype, shape: list[int]) -> float:
    """Wire bytes of the floating values under one direction's codec."""
    if codec.name == "none" or numel == 0:
        return float(float_bytes)
    return float(codec.wire_bytes(numel, dtype, shape))


def matrix_spec(float_bytes: float, cols: int, itemsize: int = 4) -> list[dict[str, Any]]:
    """An edge's floating values as one matrix of ``cols`` columns, as a value spec
    (what the codec choice reads of an edge the planner models)."""
    return _one_matrix(float_bytes, cols, itemsize)[0]


def _one_matrix(float_bytes: float, cols: int, itemsize: int) -> tuple[list[dict[str, Any]], int, list[int]]:
    """The edge's floating values as one matrix of ``cols`` columns (one row if
    fewer elements): its value spec (as ``codec_choice`` reads one), element count and
    shape (rows rounded down, as ``protocol.wire.codecs.matrix_shape`` does)."""
    if itemsize not in _DTYPES:
        raise ValueError(f"itemsize {itemsize} is not one of {sorted(_DTYPES)}")
    if cols < 1:
        raise ValueError(f"cols {cols} is not a positive column count")
    numel = int(float_bytes // itemsize)
    width = min(cols, numel)
    shape = [numel // width, width] if numel else [0, cols]
    spec = [{"t": "tensor", "dtype": _DTYPES[itemsize][0], "shape": shape}] if numel else []
    return spec, numel, shape


def steps_factor(codec: Codec) -> float:
    """How many times the steps to a given loss one edge under ``codec`` takes, as
    measured (1.0 uncompressed). Every low rank gets the factor measured at the
    pinned rank (see the data file's ``pinned``), every AdaTopK fraction the one
    measured at its pinned fraction."""
    if codec.name == "none":
        return 1.0
    key = _key(codec)
    if key is None:
        raise CodecPriceError(f"no measured steps factor for codec {codec} (priced: {', '.join(PRICED)})")
    return shipped_factors()[key]


def _key(codec: Codec) -> str | None:
    back = codec.backward
    if codec.grad is None and codec.name in ("fp16", "int8", "adatopk"):
        return codec.name
    if codec.name == "lowrank" and back.name == "int4" and back.stochastic:
        return "lowrank/int4sr"
    return None


def plan_steps_factor(codecs: Iterable[Codec]) -> float:
    """The steps factor of a plan whose cut edges use ``codecs``: the product of the
    edges' factors. Each compressed edge perturbs a different part of the forward
    and backward pass, so their costs compound (to first order the product adds
    the edges' extra steps); the max would make compressing a second edge free,
    and a planner minimising time to a loss would then compress every edge once
    it compresses one."""
    return math.prod(steps_factor(c) for c in codecs)


@functools.cache
def shipped_factors() -> dict[str, float]:
    """The factors of the data file shipped in this package (read once)."""
    path = resources.files("coordinator").joinpath(STEPS_FILE)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CodecPriceError(f"cannot read coordinator/{STEPS_FILE} ({exc}); measure it with: {_MEASURE}") from None
    return parse_factors(text, f"coordinator/{STEPS_FILE}")


def load_factors(path: str | Path) -> dict[str, float]:
    """The factors of a steps-factor data file at ``path``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CodecPriceError(f"cannot read {path} ({exc}); measure it with: {_MEASURE}") from None
    return parse_factors(text, str(path))


def parse_factors(text: str, where: str) -> dict[str, float]:
    """The ``factors`` of a data file's text: every codec of ``PRICED``, each a
    finite number of at least 1 (a codec does not make training faster)."""
    try:
        factors = json.loads(text)["factors"]
    except (ValueError, TypeError, KeyError) as exc:
        raise CodecPriceError(f"{where} is damaged: no 'factors' object ({exc!r}); re-measure: {_MEASURE}") from None
    if not isinstance(factors, dict):
        raise CodecPriceError(f"{where} is damaged: 'factors' is not an object")
    out = {}
    for key in PRICED:
        value = factors.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
            raise CodecPriceError(f"{where} is damaged: factor of {key!r} is {value!r}, not a finite number >= 1")
        out[key] = float(value)
    return out
