"""The one codec choice: which codec each cut edge gets, from the floating bytes
that cross it per micro-batch, its bandwidth, the slowest stage's time per
micro-batch, and the values that cross it (their dtypes and shapes).

The planner calls it (``coordinator.plan_eval.plan_codecs``, on the estimator's
stage times and links, then prices what it chose: ``coordinator.codec_price``) and
so does the live coordinator (``coordinator.links.live_codecs``: under ``auto``
the planner's codecs run, picked again only where a measured link is far from the
planner's, ``planned_or_repicked``). Pure functions; bytes to seconds is ``coordinator.netmodel``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from coordinator.netmodel import link_bytes, transfer_s
from protocol.wire.codecs import Codec, matrix_shape

#: AdaTopK never keeps less than this fraction, however slow the link (accuracy first;
#: --topk-fraction overrides it)
MIN_FRACTION = 0.1  # lower fractions made the demo GPT diverge (3% kept: val loss 6.0 after 300 steps)
#: ``auto-lowrank`` never sends activations at a lower rank than this
MIN_RANK = 8  # rank 8 of 128 kept the demo GPT within 1% of its uncompressed loss (4 seeds, in one process)
#: the compression modes that pick a codec per slow edge from a ladder: ``auto`` takes fp16
#: and int8 (steps factors 1.10 and 1.09, ``coordinator/codec_steps.json``; int8's loss 0.03%
#: over uncompressed after 20 steps on the testbed's far-lab); ``auto-lowrank`` goes on to
#: low-rank activations with 4-bit gradients, faster on the slowest links but at a steps
#: factor of 1.25 and 1.38% over on far-lab (the demo GPT's 300-step runs are too chaotic to
#: rank them by loss: fp16 alone moved one seed's by 7%)
AUTO_MODES = ("auto", "auto-lowrank")
#: the fewest bytes each auto mode's edge ever sends, however slow its link
STRONGEST = {
    "auto": Codec("int8"),
    "auto-lowrank": Codec("lowrank", rank=MIN_RANK, grad=Codec("int4", stochastic=True)),
}
#: ``auto``'s steps, mildest first: (how many times fewer bytes it sends at least, codec)
_AUTO_STEPS = ((2.0, "fp16"), (3.9, "int8"))
#: modes that put one codec on every edge
FIXED_MODES = ("none", "fp16", "bf16", "int8", "int4")
#: bytes AdaTopK sends per kept value: an fp16 value and a uint8 index (blocks of 256)
KEPT_BYTES = 3
_FLOAT_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def choose_codecs(
    edge_bytes: list[int] | list[float],
    edge_mbps: list[float],
    stage_seconds: list[float],
    mode: str = "adatopk",
    fraction: float | None = None,
    edge_specs: list[list[Any]] | None = None,
    rank: int | None = None,
) -> list[Codec]:
    """The codec of each cut edge.

    ``edge_bytes``: floating bytes crossing each edge per micro-batch (each way);
    ``edge_mbps``: the edge's bandwidth; ``stage_seconds``: each stage's forward +
    backward time per micro-batch. With ``mode="adatopk"`` an edge whose transfer
    takes longer than the slowest stage's compute keeps just the fraction of values
    that makes it as fast (AdaTopK sends 3 bytes per kept fp32 value); faster edges
    stay uncompressed. ``fraction`` pins the kept fraction on the edges that need
    compression.

    ``mode="auto"`` (it needs ``edge_specs``, the values crossing each edge) takes
    the mildest codec that makes a slow edge fast enough, fp16, then int8; int8
    where none does. ``mode="auto-lowrank"`` goes on from int8 to activations at the
    rank the bandwidth allows (never below ``MIN_RANK``) with their gradients as
    unbiased 4-bit codes (``lowrank:R/int4sr``); ``rank`` pins R. Other modes put
    that codec on every edge.
    """
    if mode in FIXED_MODES:
        return [Codec(mode) for _ in edge_bytes]
    bottleneck = max(stage_seconds, default=0.0)
    if mode in AUTO_MODES:
        if edge_specs is None or len(edge_specs) != len(edge_bytes):
            raise ValueError("auto compression needs the values crossing every edge")
        edges = zip(edge_bytes, edge_mbps, edge_specs, strict=True)
        return [auto_codec(n, mbps, bottleneck, spec, rank, mode) for n, mbps, spec in edges]
    if mode != "adatopk":
        raise ValueError(f"unknown compression mode {mode!r}")
    out = []
    for nbytes, mbps in zip(edge_bytes, edge_mbps, strict=True):
        keep = fraction if fraction is not None else keep_fraction(nbytes, 0, mbps, bottleneck, MIN_FRACTION)
        needed = nbytes > 0 and transfer_s(nbytes, mbps) > bottleneck
        out.append(Codec("adatopk", float(keep)) if needed and keep < 1.0 else Codec())
    return out


#: a measured link within this share of the bandwidth the planner assumed keeps the
#: codec the planner priced for it; further off, ``auto`` picks again on the measured one
REPICK_SHARE = 0.25


def planned_or_repicked(
    planned: list[Codec],
    planned_mbps: list[float],
    measured_mbps: list[float],
    edge_bytes: list[float],
    stage_seconds: list[float],
    edge_specs: list[list[Any]],
    rank: int | None = None,
    mode: str = "auto",
) -> tuple[list[Codec], list[bool]]:
    """``auto`` (or ``auto-lowrank``: ``mode``) on the live swarm: each boundary runs the codec the planner priced for
    it (``planned``, chosen for ``planned_mbps``) unless the link its peers measured
    differs from that by more than ``REPICK_SHARE``; then the same choice
    (``auto_codec``) picks again for the measured bandwidth against the plan's slowest
    stage. Returns the codecs and, per boundary, whether it was picked again."""
    bottleneck = max(stage_seconds, default=0.0)
    codecs, again = [], []
    for codec, want, got, n, spec in zip(planned, planned_mbps, measured_mbps, edge_bytes, edge_specs, strict=True):
        off = abs(got - want) > REPICK_SHARE * want
        codecs.append(auto_codec(n, got, bottleneck, spec, rank, mode) if off else codec)
        again.append(off)
    return codecs, again


def keep_fraction(float_bytes: float, other_bytes: float, mbps: float, bound_s: float, floor: float) -> float:
    """AdaTopK's kept fraction for a link carrying ``float_bytes`` of floating tensors
    (plus ``other_bytes`` that travel raw) per micro-batch: just enough that it moves
    them within ``bound_s``, never below ``floor``; 1.0 when no compression is needed."""
    if float_bytes <= 0 or transfer_s(float_bytes + other_bytes, mbps) <= bound_s:
        return 1.0
    budget = link_bytes(bound_s, mbps) - other_bytes  # bytes the link carries in time
    return min(1.0, max(floor, budget / (float_bytes * KEPT_BYTES / 4)))


def auto_codec(
    nbytes: float, mbps: float, bound_s: float, spec: list[Any], rank: int | None = None, mode: str = "auto"
) -> Codec:
    """``auto``'s (``mode``: or ``auto-lowrank``'s) codec for one edge carrying ``nbytes``
    floating bytes per micro-batch each way (values described by ``spec``) that must
    move within ``bound_s``; ``rank`` pins the rank where it takes low-rank activations."""
    seconds = transfer_s(nbytes, mbps)
    if nbytes <= 0 or seconds <= bound_s:
        return Codec()
    need = seconds / max(bound_s, 1e-9)
    narrow = _itemsize(spec) / 4  # the steps shrink fp32 by their factor; half-precision values by less
    for factor, name in _AUTO_STEPS:
        if 1 < factor * narrow and need <= factor * narrow:  # fp16 does nothing to bf16 values: skip it
            return Codec(name)
    if mode == "auto":
        return STRONGEST[mode]
    budget = link_bytes(bound_s, mbps)  # bytes the edge moves in time, each way
    r = rank if rank is not None else lowrank_rank(spec, budget)
    return Codec("lowrank", rank=r, grad=Codec("int4", stochastic=True))


def lowrank_rank(spec: list[Any], budget: float) -> int:
    """The largest rank (at least ``MIN_RANK``) at which the floating tensors of
    ``spec`` fit in ``budget`` bytes: each costs rank x (2 x (rows + columns) + 4)."""
    matrices = (matrix_shape(numel, shape) for _, shape, numel in _float_tensors(spec))
    per_rank = sum(2 * (rows + cols) + 4 for rows, cols in matrices)
    if per_rank == 0:
        return MIN_RANK
    return max(MIN_RANK, int(budget // per_rank))


def float_bytes(spec: list[Any]) -> int:
    """Bytes of the floating tensors in a stage's input spec (what a codec can shrink)."""
    return sum(numel * _FLOAT_SIZES[dtype] for dtype, _, numel in _float_tensors(spec))


def _float_tensors(spec: list[Any]) -> Iterator[tuple[str, list[int], int]]:
    """(dtype, shape, element count) of every floating tensor in a value spec."""
    for d in spec:
        if d.get("t") == "tensor" and d["dtype"] in _FLOAT_SIZES:
            yield d["dtype"], d["shape"], math.prod(d["shape"])
        elif d.get("t") in ("tuple", "list"):
            yield from _float_tensors(d["items"])


def _itemsize(spec: list[Any]) -> int:
    """Bytes per element of most of a spec's floating values (4 when it has none)."""
    by_size: dict[int, int] = {}
    for dtype, _, numel in _float_tensors(spec):
        size = _FLOAT_SIZES[dtype]
        by_size[size] = by_size.get(size, 0) + numel * size
    return max(by_size, key=lambda k: by_size[k], default=4)
