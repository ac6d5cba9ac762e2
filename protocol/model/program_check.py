"""Checking a stage's program before it touches the volunteer's device: its
operators, the memory its state and values take, and a dry run on the meta device
against the shapes the plan says it takes and returns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from protocol.model.program import DEFAULT_NAMESPACES, Program, ProgramError, flat_leaves, restore_sizes
from protocol.model.program_load import check_operators, load_stage
from protocol.wire.encoding import DTYPE_NAMES, DTYPES


def build_checked(
    program: Program,
    inputs: list[Any],
    outputs: list[Any] | None,
    device: torch.device | str,
    namespaces: Sequence[str] = DEFAULT_NAMESPACES,
    memory: int | None = None,
) -> tuple[fx.GraphModule, int]:
    """The stage module of a program that passes every check, in order, before it
    touches ``device``: its operators, the memory its state takes (four times: weights,
    gradients and AdamW's two moments) and its largest value against ``memory``
    bytes, and a dry run against the plan's shapes. Returns the module and the bytes
    the dry run computed (``dry_run``)."""
    check_operators(program, namespaces)
    need = 4 * state_bytes(program)
    if memory is not None and need > memory:
        raise ProgramError(
            f"the stage's state needs {need / 2**20:.0f} MiB, more than the {memory / 2**20:.0f} MiB lent"
        )
    activations = dry_run(program, inputs, outputs, namespaces, memory)
    if memory is not None and need + activations > memory:
        total = (need + activations) / 2**20
        raise ProgramError(
            f"the stage needs {total:.0f} MiB for one micro-batch, more than the {memory / 2**20:.0f} MiB lent"
        )
    return load_stage(program, device, namespaces), activations


def state_bytes(program: Program) -> int:
    """What the program's parameters and buffers take (from their declared shapes)."""
    try:
        return sum(math.prod(e["shape"]) * DTYPES[e["dtype"]].itemsize for e in program.graph["state"])
    except (KeyError, TypeError) as exc:
        raise ProgramError(f"the stage program's state is malformed: {type(exc).__name__}") from None


def dry_run(
    program: Program,
    inputs: list[Any],
    outputs: list[Any] | None,
    namespaces: Sequence[str] = DEFAULT_NAMESPACES,
    memory: int | None = None,
) -> int:
    """Run the program on the meta device (no memory, no arithmetic) on values shaped
    as the plan's spec ``inputs`` says, and check it returns what the next stage
    expects (``outputs``; None: the last stage, a scalar loss). Returns the bytes of
    the values it computes for one micro-batch: what the stage holds for backward, at
    most."""
    total = 0

    class Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            nonlocal total
            out = super().run_node(n)
            for _, t in flat_leaves(out):
                if isinstance(t, torch.Tensor):
                    _check_value(t, memory)
                    total += t.numel() * t.element_size()
            return out

    try:
        gm = load_stage(program, "meta", namespaces)
        values = [_meta_value(d) for d in inputs]
        with torch.no_grad():
            out = restore_sizes(Counting(gm).run(*values), program.graph["output"])
    except ProgramError as exc:  # fx adds lines about the node it was running
        raise ProgramError(str(exc).splitlines()[0]) from None
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ProgramError(f"the stage program does not run on its inputs: {type(exc).__name__}: {first}") from None
    if outputs is None:
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ProgramError("the last stage's program does not return a scalar loss")
    elif not isinstance(out, (tuple, list)) or [_spec(v) for v in out] != [_loose(d) for d in outputs]:
        raise ProgramError("the stage program does not return the values the next stage takes")
    return total


def _check_value(t: torch.Tensor, memory: int | None) -> None:
    """A value a program computes must be a plain (strided) tensor of a wire dtype, no
    larger than the memory lent."""
    if t.layout != torch.strided or t.dtype not in DTYPE_NAMES:
        raise ProgramError(f"the stage program computes a {t.layout} {t.dtype} tensor, which programs may not")
    if t.numel() and (t.storage_offset() < 0 or min(t.stride(), default=0) < 0 or _reach(t) > _storage_bytes(t)):
        raise ProgramError("the stage program makes a view that reaches outside its storage")
    size = t.numel() * t.element_size()
    if memory is not None and size > memory:
        raise ProgramError(f"the stage program computes a value of {size / 2**20:.0f} MiB, more than the memory lent")


def _reach(t: torch.Tensor) -> int:
    """The bytes of its storage a view's last element ends at."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _meta_value(d: Any) -> Any:
    """A value shaped as a plan's spec entry says, with tensors on the meta device."""
    kind = d.get("t") if isinstance(d, dict) else None
    if kind == "tensor" and d["dtype"] in DTYPES:
        return torch.empty(d["shape"], dtype=DTYPES[d["dtype"]], device="meta")
    if kind in ("tuple", "list"):
        items = [_meta_value(x) for x in d["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "size":
        return torch.Size(d["v"])
    if kind == "py":
        return d["v"]
    if kind == "device":  # a cut may pass a tensor's device on (``idx.device``): the dry run's is meta
        return torch.device("meta")
    raise ProgramError(f"the plan describes an input the program cannot take: {str(d)[:80]}")


def _loose(d: Any) -> Any:
    """A spec entry as a dry run can match it: a device is a device, whichever it names
    (the dry run's are meta; the peer's own is what it will run on)."""
    if isinstance(d, dict) and d.get("t") == "device":
        return {"t": "device"}
    if isinstance(d, dict) and d.get("t") in ("tuple", "list"):
        return {**d, "items": [_loose(x) for x in d["items"]]}
    return d


def _spec(v: Any) -> Any:
    """A value's spec entry, as ``protocol.wire.expect.describe`` gives it."""
    if isinstance(v, torch.Tensor):
        return {"t": "tensor", "dtype": DTYPE_NAMES.get(v.dtype, str(v.dtype)), "shape": list(v.shape)}
    if isinstance(v, torch.Size):
        return {"t": "size", "v": list(v)}
    if isinstance(v, torch.device):
        return {"t": "device"}
    if isinstance(v, (tuple, list)):
        return {"t": type(v).__name__, "items": [_spec(x) for x in v]}
    return {"t": "py", "v": v}
