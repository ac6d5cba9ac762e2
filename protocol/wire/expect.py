"""A plan's spec of the values a stage takes (their structure, dtypes and shapes),
and the check of received value descriptions against it."""

from __future__ import annotations

import math
from typing import Any

from protocol.wire.reject import Reject, Rejected


def match_values(descs: list[Any], expected: list[Any], codec: dict[str, Any] | None, gradients: bool = False) -> None:
    """Check received value descriptions against the plan's: the same structure,
    dtypes and shapes (dim 0 may be smaller: micro-batches of an uneven split), and
    floating tensors in the link's codec. In ``gradients`` a tensor may be absent
    (None) and only floating tensors are expected."""
    if len(descs) != len(expected):
        raise Rejected(Reject.BAD_TENSORS, f"{len(descs)} values, the plan expects {len(expected)}")
    for i, (got, want) in enumerate(zip(descs, expected, strict=True)):
        _match(got, want, codec, gradients, f"value {i}")


def _match(got: Any, want: Any, codec: dict[str, Any] | None, gradients: bool, where: str) -> None:
    if not isinstance(got, dict) or not isinstance(want, dict):
        raise Rejected(Reject.BAD_TENSORS, f"{where}: not a value description")
    kind = want.get("t")
    if gradients and got == {"t": "py", "v": None}:  # no gradient for this value
        return
    if gradients and kind != "tensor" and kind not in ("tuple", "list"):
        if got != {"t": "py", "v": None}:
            raise Rejected(Reject.BAD_TENSORS, f"{where}: a gradient for a non-tensor value")
        return
    if got.get("t") != kind:
        raise Rejected(Reject.BAD_TENSORS, f"{where}: a {str(got.get('t'))[:16]}, the plan expects a {kind}")
    if kind == "tensor":
        shape, plan_shape = got.get("shape"), want.get("shape")
        if got.get("dtype") != want.get("dtype") or not isinstance(shape, list) or len(shape) != len(plan_shape):
            raise Rejected(
                Reject.BAD_TENSORS,
                f"{where}: {str(got.get('dtype'))[:16]} {str(shape)[:64]}, the plan expects "
                f"{want.get('dtype')} {plan_shape}",
            )
        if shape[1:] != plan_shape[1:] or (shape and not 0 < shape[0] <= plan_shape[0]):
            raise Rejected(Reject.BAD_TENSORS, f"{where}: shape {str(shape)[:64]}, the plan expects {plan_shape}")
        floating = want.get("dtype") in ("float32", "float64", "float16", "bfloat16")
        wanted_codec = codec if floating and codec is not None and codec.get("name") != "none" else None
        if got.get("codec") != wanted_codec and math.prod(shape) > 0:
            raise Rejected(Reject.BAD_TENSORS, f"{where}: codec {got.get('codec')}, the plan says {wanted_codec}")
        return
    if kind in ("tuple", "list"):
        items, plan_items = got.get("items"), want.get("items")
        if not isinstance(items, list) or len(items) != len(plan_items):
            raise Rejected(Reject.BAD_TENSORS, f"{where}: a {kind} of another length than the plan's")
        for j, (g, w) in enumerate(zip(items, plan_items, strict=True)):
            _match(g, w, codec, gradients, f"{where}.{j}")
        return
    if got != want and kind != "size":
        raise Rejected(Reject.BAD_TENSORS, f"{where}: {str(got)[:64]}, the plan expects {str(want)[:64]}")


def describe(descs: list[Any]) -> list[Any]:
    """A plan's spec of values from their descriptions: sizes and codecs left out."""
    return [_strip(d) for d in descs]


def _strip(d: Any) -> Any:
    if isinstance(d, dict):
        if d.get("t") == "tensor":
            return {"t": "tensor", "dtype": d["dtype"], "shape": d["shape"]}
        if d.get("t") in ("tuple", "list"):
            return {"t": d["t"], "items": [_strip(x) for x in d["items"]]}
    return d
