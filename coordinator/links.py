"""The plan's cut edges: what crosses each (value specs), and which codec each
link gets. ``choose_codecs`` is a pure function of the estimates."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from protocol.codecs import Codec
from protocol.envelope import describe
from protocol.graph import Cut, build_stage, partition, trace
from protocol.wire import encode_values

#: AdaTopK never keeps less than this fraction, however slow the link (accuracy first;
#: --topk-fraction overrides it)
MIN_FRACTION = 0.1  # lower fractions made the demo GPT diverge (3% kept: val loss 6.0 after 300 steps)


def boundary_specs(model: nn.Module, cut: Cut, example: tuple[torch.Tensor, ...]) -> list[list[Any]]:
    """Per stage, the descriptions (dtype, shape) of its input values for the example
    micro-batch: stage 0 gets the batch, stage s the values crossing boundary s - 1."""
    part = partition(trace(model), cut)
    values: Any = list(example)
    specs = [describe(encode_values(values)[0])]
    with torch.no_grad():
        for s in range(cut.num_stages - 1):
            values = list(build_stage(part, s)(*values))
            specs.append(describe(encode_values(values)[0]))
    return specs


def float_bytes(spec: list[Any]) -> int:
    """Bytes of the floating tensors in a stage's input spec (what a codec can shrink)."""
    total = 0
    for d in spec:
        if d.get("t") == "tensor" and d["dtype"] in ("float32", "float64", "float16", "bfloat16"):
            numel = 1
            for n in d["shape"]:
                numel *= n
            total += numel * {"float64": 8, "float32": 4}.get(d["dtype"], 2)
        elif d.get("t") in ("tuple", "list"):
            total += float_bytes(d["items"])
    return total


def choose_codecs(
    edge_bytes: list[int],
    edge_mbps: list[float],
    stage_seconds: list[float],
    mode: str = "adatopk",
    fraction: float | None = None,
) -> list[Codec]:
    """The codec of each cut edge.

    ``edge_bytes``: floating bytes crossing each edge per micro-batch (each way);
    ``edge_mbps``: the edge's measured bandwidth; ``stage_seconds``: each stage's
    forward + backward time per micro-batch. With ``mode="adatopk"`` an edge whose
    transfer takes longer than the slowest stage's compute keeps just the fraction
    of values that makes it as fast (AdaTopK sends 3 bytes per kept fp32 value);
    faster edges stay uncompressed. ``fraction`` pins the kept fraction on the
    edges that need compression. Other modes put that codec on every edge.
    """
    if mode in ("none", "fp16", "bf16", "int8"):
        return [Codec(mode) for _ in edge_bytes]
    if mode != "adatopk":
        raise ValueError(f"unknown compression mode {mode!r}")
    bottleneck = max(stage_seconds, default=0.0)
    out = []
    for nbytes, mbps in zip(edge_bytes, edge_mbps, strict=True):
        keep = fraction if fraction is not None else keep_fraction(nbytes, 0, mbps, bottleneck, MIN_FRACTION)
        needed = nbytes > 0 and nbytes * 8 / max(mbps * 1e6, 1e-3) > bottleneck
        out.append(Codec("adatopk", float(keep)) if needed and keep < 1.0 else Codec())
    return out


#: bytes AdaTopK sends per kept value: an fp16 value and a uint8 index (blocks of 256)
KEPT_BYTES = 3


def keep_fraction(float_bytes: float, other_bytes: float, mbps: float, bound_s: float, floor: float) -> float:
    """AdaTopK's kept fraction for a link carrying ``float_bytes`` of floating tensors
    (plus ``other_bytes`` that travel raw) per micro-batch: just enough that it moves
    them within ``bound_s``, never below ``floor``; 1.0 when no compression is needed."""
    if float_bytes <= 0 or (float_bytes + other_bytes) * 8 / max(mbps * 1e6, 1e-3) <= bound_s:
        return 1.0
    budget = bound_s * mbps * 1e6 / 8 - other_bytes  # bytes the link carries in time
    return min(1.0, max(floor, budget / (float_bytes * KEPT_BYTES / 4)))
