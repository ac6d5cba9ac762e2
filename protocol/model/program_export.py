"""Making a stage's program: trace it below autograd into ATen operators, write the
graph as JSON with its constants, and refuse it unless it computes what the stage
computes, forward and backward."""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from protocol.model.graph import Cut, stage_modules
from protocol.model.program import PROGRAM_FORMAT, Program, ProgramError, flat_leaves, rebuild_values
from protocol.model.program_load import load_stage
from protocol.model.recipe import Recipe, autocast
from protocol.wire.encoding import DTYPE_NAMES


def export_stages(model: nn.Module, cut: Cut, example: Sequence[Any], recipe: Recipe | None = None) -> list[Program]:
    """Every stage of ``cut`` as a program, each traced on the values the stages
    before it compute from the ``example`` micro-batch."""
    _, stages = stage_modules(model, cut)
    values, out = list(example), []
    for s, stage in enumerate(stages):
        out.append(export_stage(stage, values, recipe))
        if s < len(stages) - 1:
            with torch.no_grad(), autocast(recipe or Recipe()):
                values = list(stage(*values))
    return out


def export_stage(stage: nn.Module, inputs: Sequence[Any], recipe: Recipe | None = None) -> Program:
    """Trace ``stage`` on ``inputs`` (its real input values) into a program."""
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
    names = list(state)
    paths = [p for p, _ in flat_leaves(list(inputs))]
    flat = [v for _, v in flat_leaves(list(inputs))]
    tensors = [j for j, v in enumerate(flat) if isinstance(v, torch.Tensor)]  # traced; other leaves are constants

    returned: list[Any] = []

    def run(*args: Any) -> Any:
        values = dict(zip(names, args[: len(names)], strict=True))
        leaves = list(flat)
        for j, value in zip(tensors, args[len(names) :], strict=True):
            leaves[j] = value
        rebuilt = rebuild_values(list(inputs), iter(leaves))
        with autocast(recipe or Recipe()):
            out = torch.func.functional_call(stage, values, tuple(rebuilt))
        returned.append(out)
        return out

    args = [t.detach().requires_grad_(t.requires_grad) for t in state.values()]
    args += [_as_input(flat[j]) for j in tensors]
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = make_fx(run)(*args)
    except Exception as exc:
        first = (str(exc).strip().split(" - ")[0].splitlines() or [""])[0][:200]
        raise ProgramError(f"the stage cannot be traced to ATen operators: {type(exc).__name__}: {first}") from None
    device_neutral(gm)
    program = _serialize(gm, stage, names, paths, tensors)
    program.graph["output"] = _sizes_as_returned(program.graph["output"], returned[0])
    _verify(stage, program, inputs, recipe or Recipe())
    return program


#: the kernel ``scaled_dot_product_attention`` picks on a CPU, which tracing records in its
#: place: a peer on a GPU has no such kernel
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def device_neutral(gm: fx.GraphModule) -> None:
    """Put ``scaled_dot_product_attention`` back where tracing on a CPU recorded its CPU
    kernel and used only its output (its log-sum-exp unread): on a CPU it picks that same
    kernel (the program stays bitwise the stage), on a GPU one of its own."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _CPU_ATTENTION:
            continue
        users, traced = list(node.users), node.meta.get("val")
        if not isinstance(traced, tuple) or not isinstance(traced[0], torch.Tensor):
            continue  # the layout the rest was traced on is unknown: the CPU kernel stays
        if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in users):
            continue
        q, k, v, *rest = node.args
        kwargs = {
            "attn_mask": node.kwargs.get("attn_mask"),
            "dropout_p": rest[0] if rest else 0.0,
            "is_causal": rest[1] if len(rest) > 1 else False,
            "scale": node.kwargs.get("scale"),
        }
        with gm.graph.inserting_before(node):
            neutral = gm.graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
        out = _laid_out_as(gm.graph, neutral, traced[0])
        for u in users:
            u.replace_all_uses_with(out)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
    gm.recompile()


def _laid_out_as(graph: fx.Graph, node: fx.Node, like: torch.Tensor) -> fx.Node:
    """``node``'s value laid out in memory as ``like`` (what the traced kernel returned):
    the views after it were traced on that layout, and the kernel another device (or the
    meta device) picks may lay its output out otherwise."""
    if like.is_contiguous():
        return node
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))  # outermost first
    with graph.inserting_after(node):
        first = graph.call_function(torch.ops.aten.permute.default, (node, order))
    with graph.inserting_after(first):
        dense = graph.call_function(torch.ops.aten.clone.default, (first,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(dense):
        return graph.call_function(torch.ops.aten.permute.default, (dense, [order.index(d) for d in range(like.dim())]))


def _verify(stage: nn.Module, program: Program, inputs: Sequence[Any], recipe: Recipe) -> None:
    """Refuse a program that does not compute what the stage computes, forward and
    backward, on the example (tracing runs below autograd: a custom autograd
    function's own backward, for one, would be lost)."""
    own = tuple({op.split(".")[0] for op in program.operators() if op != "getitem"})  # the model's own code runs here
    module = load_stage(program, namespaces=own)
    module.load_state_dict(stage.state_dict())
    runs = []
    for m, casts in ((stage, True), (module, False)):
        leaves = [_as_input(v) for _, v in flat_leaves(list(inputs))]
        values = rebuild_values(list(inputs), iter(leaves))
        with torch.enable_grad(), autocast(recipe) if casts else contextlib.nullcontext():
            out = m(*values)
        roots = [t for _, t in flat_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(t.shape, generator=gen).to(t.dtype) if t.numel() != 1 else None for t in roots]
        if roots:
            torch.autograd.backward(roots, [g if g is not None else torch.ones_like(t) for g, t in zip(grads, roots)])
        own = [p.grad for _, p in sorted(m.named_parameters())]
        runs.append([*[t for _, t in flat_leaves(out)], *[x.grad for x in leaves if isinstance(x, torch.Tensor)], *own])
        m.zero_grad(set_to_none=True)
    for a, b in zip(*runs, strict=True):
        if not _same_value(a, b):
            raise ProgramError(
                "its ATen program does not compute what the stage computes (a custom autograd function, "
                "randomness or data-dependent Python in the model?)"
            )


def _same_value(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm()) <= 1e-3 * float(a.norm()) + 1e-6


def _sizes_as_returned(enc: Any, value: Any) -> Any:
    """The traced output's encoding with the ``torch.Size`` values the stage returned
    (tracing turns them into tuples; the next stage and the wire tell them apart)."""
    if isinstance(value, torch.Size) and isinstance(enc, dict) and "tuple" in enc:
        return {"size": enc["tuple"]}
    if isinstance(value, (tuple, list)) and isinstance(enc, dict) and len(enc) == 1:
        ((kind, items),) = enc.items()
        if kind in ("tuple", "list") and len(items) == len(value):
            return {kind: [_sizes_as_returned(e, v) for e, v in zip(items, value, strict=True)]}
    return enc


def _as_input(v: Any) -> Any:
    """A stage input as a peer gets it: decoded from the wire, so contiguous (a view
    traced with other strides could be recorded as an ``aten.view`` they do not allow)."""
    if isinstance(v, torch.Tensor):
        return v.detach().contiguous().requires_grad_(v.is_floating_point())
    return v


def _serialize(
    gm: fx.GraphModule, stage: nn.Module, names: list[str], paths: list[tuple[int, ...]], tensors: list[int]
) -> Program:
    refs: dict[fx.Node, str] = {}
    nodes: list[dict[str, Any]] = []
    constants: dict[str, torch.Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        refs[n] = f"s:{names[i]}" if i < len(names) else f"i:{tensors[i - len(names)]}"
    output: Any = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            constants[n.name] = getattr(gm, str(n.target)).detach().clone()
            refs[n] = f"c:{n.name}"
        elif n.op == "call_function":
            nodes.append({"name": n.name, "op": _op_name(n.target), "args": _enc(n.args), "kwargs": _enc(n.kwargs)})
            refs[n] = n.name
        elif n.op == "output":
            output = _enc(n.args[0])
        elif n.op != "placeholder":
            raise ProgramError(f"the stage's graph has a {n.op} node")
    graph = {
        "format": PROGRAM_FORMAT,
        "inputs": [list(p) for p in paths],
        "state": _state_entries(stage, names),
        "nodes": [_resolve_refs(x, refs) for x in nodes],
        "output": _resolve_refs(output, refs),
    }
    return Program(graph, constants)


def _state_entries(stage: nn.Module, names: list[str]) -> list[dict[str, Any]]:
    """Each parameter and buffer: its names (tied ones share an entry), shape, dtype,
    kind, and whether a state dict holds it."""
    persistent = set(stage.state_dict(keep_vars=True))
    aliases: dict[int, list[str]] = {}
    for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(t), []).append(name)
    entries = []
    for name in names:
        t = stage.get_parameter(name) if _is_param(stage, name) else stage.get_buffer(name)
        entries.append(
            {
                "names": aliases[id(t)],
                "shape": list(t.shape),
                "dtype": _dtype_name(t.dtype),
                "param": isinstance(t, nn.Parameter),
                "grad": bool(t.requires_grad),
                "persistent": name in persistent,
            }
        )
    return entries


def _is_param(stage: nn.Module, name: str) -> bool:
    return name in dict(stage.named_parameters())


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        ns, op = target.name().split("::", 1)
        opname, _, overload = op.partition(".")
        return f"{ns}.{opname}.{overload or 'default'}"
    raise ProgramError(f"the stage calls {getattr(target, '__name__', target)!r}, which is not an ATen operator")


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ProgramError(f"the stage uses {dtype}, which programs do not carry")
    return DTYPE_NAMES[dtype]


def _enc(x: Any) -> Any:
    """A node argument as JSON; node references are resolved later (``_resolve_refs``)."""
    if isinstance(x, fx.Node):
        return {"node": x}
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, torch.dtype):
        return {"dtype": _dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, torch.Size):
        return {"size": list(x)}
    if isinstance(x, (list, tuple)):
        return {"list" if isinstance(x, list) else "tuple": [_enc(v) for v in x]}
    if isinstance(x, dict):
        return {"kwargs": {str(k): _enc(v) for k, v in x.items()}}
    raise ProgramError(f"the stage's graph has an argument of type {type(x).__name__}, which programs do not carry")


def _resolve_refs(x: Any, refs: dict[fx.Node, str]) -> Any:
    if isinstance(x, dict):
        if "node" in x and isinstance(x["node"], fx.Node):
            return {"ref": refs[x["node"]]}
        return {k: _resolve_refs(v, refs) for k, v in x.items()}
    if isinstance(x, list):
        return [_resolve_refs(v, refs) for v in x]
    return x
