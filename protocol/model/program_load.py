"""Rebuilding a stage from its program: each operator resolved by name in the allowed
namespaces only (refused before anything runs otherwise), the graph's arguments
decoded from a small vocabulary, the state allocated under the model's names."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from protocol.model.program import DEFAULT_NAMESPACES, Program, ProgramError, restore_sizes
from protocol.wire.encoding import DTYPES

#: ATen operators no program may call: they read files or print on the volunteer's machine, change
#: process-wide state, pin or record memory, assert on a device, or make or read sparse tensors (whose
#: indices the kernels trust: a forged one writes out of bounds)
DENIED_OPS = frozenset(
    {
        "from_file",
        "_print",
        "save",
        "warn",
        "wait",
        "set_",
        "set_data",
        "_pin_memory",
        "pin_memory",
        "record_stream",
        "_assert_async",
        "_functional_assert_async",
        "_indices",
        "_values",
        "indices",
        "values",
        "_to_dense",
        "to_dense",
        "_coalesce",
        "coalesce",
        "crow_indices",
        "col_indices",
        "ccol_indices",
        "row_indices",
        "_reshape_alias",  # applies the sizes and strides it is given, unchecked: a view anywhere in the heap
    }
)
#: parts of ATen operator names no program may call (sparse and quantized layouts, the FFT plan cache)
DENIED_PARTS = ("sparse", "_cufft", "quantize", "mkldnn", "_nested")
#: how deep a program's JSON and its arguments may nest
MAX_DEPTH = 32
MAX_PROGRAM_NODES = 500_000
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


def resolve_op(name: str, namespaces: Sequence[str] = DEFAULT_NAMESPACES) -> Any:
    """The operator ``ns.op.overload`` names, looked up in the dispatcher's table only
    if ``ns`` is allowed (``ProgramError`` naming it otherwise)."""
    if name == "getitem":
        return operator.getitem
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(_NAME.match(p) and not p.startswith("__") for p in parts):
        raise ProgramError(f"the stage program names an operator {str(name)[:80]!r}, which is not ns.op.overload")
    ns, op, overload = parts
    if ns not in namespaces:
        allowed = ", ".join(namespaces)
        raise ProgramError(f"the stage program calls {name}, outside the allowed operator namespaces ({allowed})")
    if op in DENIED_OPS or any(part in op for part in DENIED_PARTS):
        raise ProgramError(f"the stage program calls {name}, which no program may call")
    target = getattr(getattr(getattr(torch.ops, ns), op, None), overload, None)
    if not isinstance(target, torch._ops.OpOverload):
        raise ProgramError(f"the stage program calls {name}, which this torch does not have")
    schema = target._schema
    if not any(_is_tensor(a.type) for a in [*schema.arguments, *schema.returns]):
        raise ProgramError(f"the stage program calls {name}, which takes and returns no tensor")
    return target


def _is_tensor(t: Any) -> bool:
    return "Tensor" in str(t)


def check_operators(program: Program, namespaces: Sequence[str] = DEFAULT_NAMESPACES) -> dict[str, Any]:
    """Every operator the program calls, resolved; refuses it before anything runs."""
    nodes = program.graph.get("nodes")
    if not isinstance(nodes, list) or len(nodes) > MAX_PROGRAM_NODES:
        raise ProgramError(f"the stage program must list at most {MAX_PROGRAM_NODES} nodes")
    if not all(isinstance(n, dict) and isinstance(n.get("op"), str) and isinstance(n.get("name"), str) for n in nodes):
        raise ProgramError("a node of the stage program is malformed")
    return {op: resolve_op(op, namespaces) for op in program.operators()}


def load_stage(
    program: Program, device: torch.device | str = "cpu", namespaces: Sequence[str] = DEFAULT_NAMESPACES
) -> fx.GraphModule:
    """The stage module a program describes, on ``device``: its parameters and buffers
    are allocated (uninitialised, the stage's state is loaded next) under the
    model's names; its ``forward`` takes the stage's inputs as the model's stage did."""
    device = torch.device(device)
    targets = check_operators(program, namespaces)
    graph = program.graph
    try:
        g, env = _inputs(graph["inputs"])
        tensors = _state(graph["state"], device)
        for name, t in program.constants.items():
            _check_name(name)
            tensors[f"_constants.{name}"] = (t.to(device), False)
            env[f"c:{name}"] = g.get_attr(f"_constants.{name}")
        for entry in graph["state"]:
            env[f"s:{entry['names'][0]}"] = g.get_attr(entry["names"][0])
        for node in graph["nodes"]:
            args = _dec(node["args"], env, device)
            kwargs = _dec(node["kwargs"], env, device)
            if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not isinstance(node["name"], str):
                raise ProgramError("a node of the stage program is malformed")
            target = targets[node["op"]]
            _check_kwargs(node["op"], target, kwargs)
            _check_dense(node["op"], target, args, kwargs)
            kwargs = _on_device(target, args, kwargs, device)
            env[node["name"]] = g.call_function(_callable(node["op"], target, args, kwargs), args, kwargs)
        g.output(_dec(graph["output"], env, device))
        root = nn.Module()
        for name, (t, persistent) in tensors.items():
            _install(root, name, t, persistent)
        gm = fx.GraphModule(root, g, class_name="StageProgram")
        for name, (t, persistent) in tensors.items():  # aliases and persistence, as the model had them
            _install(gm, name, t, persistent)
        shape = graph["output"]
        gm.register_forward_hook(lambda module, args, out: restore_sizes(out, shape))
    except ProgramError:
        raise
    except Exception as exc:  # anything a malformed graph makes fx or torch raise (SyntaxError, RecursionError, ...)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ProgramError(f"the stage program is malformed: {type(exc).__name__}: {first}") from None
    return gm


def _check_kwargs(op: str, target: Any, kwargs: dict[str, Any]) -> None:
    """Keyword arguments must be the operator's own (fx writes their names into code)."""
    if target is operator.getitem:
        known: set[str] = set()
    else:
        known = {a.name for a in target._schema.arguments}
    if not set(kwargs) <= known:
        raise ProgramError(f"the stage program passes {op} keyword arguments it does not take")


def _check_dense(op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """No operator may be asked for a sparse result (``embedding``'s ``sparse``: a sparse
    gradient, which the dry run, forward only, never sees, and no part of a stage takes)."""
    if target is operator.getitem:
        return
    names = [a.name for a in target._schema.arguments]
    if "sparse" not in names:
        return
    at = names.index("sparse")
    asked = kwargs.get("sparse", args[at] if len(args) > at else False)
    if asked is not False and asked is not None:
        raise ProgramError(f"the stage program asks {op[:80]} for a sparse result, which no program may")


def _on_device(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A factory operator that names no device allocates on ``device`` (the meta
    device for a dry run), never on the process's default one."""
    if target is operator.getitem:
        return kwargs
    names = [a.name for a in target._schema.arguments]
    if "device" in names and "device" not in kwargs and len(args) <= names.index("device"):
        return {**kwargs, "device": device}
    return kwargs


def _zero_after(op: Any) -> Any:
    """``op``, with its (uninitialised) result filled with zeros: no earlier contents of
    the volunteer's memory can flow into a program's values."""

    def zeroed(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return op(*args, **kwargs).zero_()

    zeroed.__name__ = f"zeroed_{op.__name__.replace('.', '_')}"
    return zeroed


#: operators that return uninitialised memory, replaced by ones that zero it
_ZEROED = {
    f"aten.{name}": _zero_after(getattr(getattr(torch.ops.aten, name.split(".")[0]), name.split(".")[1]))
    for name in (
        "empty.memory_format",
        "empty_like.default",
        "new_empty.default",
        "empty_strided.default",
        "new_empty_strided.default",
    )
}


def _inputs(paths: Any) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """Placeholders for the stage's inputs, and an item-taking node per nested leaf."""
    if not isinstance(paths, list) or not all(isinstance(p, list) and p for p in paths):
        raise ProgramError("the stage program's inputs are malformed")
    g = fx.Graph()
    top = 1 + max((p[0] for p in paths), default=-1)
    if not all(all(isinstance(i, int) and 0 <= i < 1 << 16 for i in p) for p in paths) or top > 1 << 16:
        raise ProgramError("the stage program's inputs are malformed")
    holders = [g.placeholder(f"input_{i}") for i in range(top)]
    env: dict[str, fx.Node] = {}
    for j, path in enumerate(paths):
        node = holders[path[0]]
        for i in path[1:]:
            node = g.call_function(operator.getitem, (node, i))
        env[f"i:{j}"] = node
    return g, env


def _state(entries: Any, device: torch.device) -> dict[str, tuple[torch.Tensor, bool]]:
    """Name -> (tensor, persistent) for every name of every parameter and buffer."""
    if not isinstance(entries, list):
        raise ProgramError("the stage program's state is malformed")
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    for e in entries:
        names, shape = e["names"], e["shape"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ProgramError("the stage program's state names are malformed")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProgramError(f"the stage program gives '{names[0]}' a malformed shape")
        if e["dtype"] not in DTYPES:
            raise ProgramError(f"the stage program gives '{names[0]}' an unknown dtype")
        t = torch.zeros(shape, dtype=DTYPES[e["dtype"]], device=device)
        if e["param"]:
            t = nn.Parameter(t, requires_grad=bool(e["grad"]))
        for name in names:
            _check_name(name)
            out[name] = (t, bool(e["persistent"]))
    return out


def _check_name(name: str) -> None:
    parts = name.split(".")
    if not all(re.match(r"^[A-Za-z0-9_]+$", p) and not hasattr(fx.GraphModule, p) for p in parts):
        raise ProgramError(f"the stage program names a tensor {name[:80]!r}, which cannot be an attribute")


def _install(root: nn.Module, name: str, t: torch.Tensor, persistent: bool) -> None:
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]  # type: ignore[assignment]
    if isinstance(t, nn.Parameter):
        mod.register_parameter(leaf, t)
    else:
        mod.register_buffer(leaf, t, persistent=persistent)


def _dec(x: Any, env: dict[str, fx.Node], device: torch.device, depth: int = 0) -> Any:
    """A node argument from its JSON (``_enc``'s inverse); devices become ``device``."""
    if depth > MAX_DEPTH:
        raise ProgramError(f"a node argument of the stage program nests deeper than {MAX_DEPTH}")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list) or not isinstance(x, dict) or len(x) != 1:
        raise ProgramError("a node argument of the stage program is malformed")
    ((kind, v),) = x.items()
    if kind == "ref":
        if v not in env:
            raise ProgramError(f"the stage program refers to {str(v)[:80]!r} before it is computed")
        return env[v]
    if kind in ("list", "tuple") and isinstance(v, list):
        items = [_dec(i, env, device, depth + 1) for i in v]
        return items if kind == "list" else tuple(items)
    if kind == "kwargs" and isinstance(v, dict) and all(isinstance(k, str) and _NAME.match(k) for k in v):
        return {k: _dec(i, env, device, depth + 1) for k, i in v.items()}
    if kind == "size" and isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return torch.Size(v)
    if kind == "float" and v in ("inf", "-inf", "nan"):
        return float(v)
    if kind == "dtype" and v in DTYPES:
        return DTYPES[v]
    if kind == "device" and v in ("cpu", "cuda", "mps", "meta"):
        return device
    if kind == "layout" and v in _LAYOUTS:
        return _LAYOUTS[v]
    if kind == "memory_format" and v in _FORMATS:
        return _FORMATS[v]
    raise ProgramError(f"a node argument of the stage program is malformed ({str(kind)[:40]})")


def _callable(op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a program's node of operator ``op`` (resolved to ``target``) calls with ``args``
    and ``kwargs``: torch's binding (``_BOUND``) only where it must pick ``target``."""
    bound = _BOUND.get(op)
    if bound is not None and _binds_as_recorded(target, args, kwargs):
        return bound
    return _ZEROED.get(op, target)


def _binds_as_recorded(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Python binding given ``args`` and ``kwargs`` picks ``target``'s overload:
    each argument of the schema's positional ones given by position (no more, none
    required left out) and of the kind its type names, the keywords only ones with a
    default after those and no tensor among them. Otherwise (a hostile program's ``pow`` with a tensor
    exponent, ``view`` with a dtype, a string dimension) the binding could run another."""
    schema = target._schema.arguments
    params = [a for a in schema if not a.kwarg_only]
    required = sum(not a.has_default_value() for a in params)
    if not required <= len(args) <= len(params):
        return False
    optional = {a.name for a in schema[len(args) :] if a.has_default_value()}
    if not set(kwargs) <= optional or any(map(_is_node, kwargs.values())):
        return False
    if str(params[0].type) == "Tensor" and not (args and _is_node(args[0])):
        return False  # the tensor an operator works on: a number there is another signature
    return all(_fits(str(p.type), v) for p, v in zip(params, args, strict=False))


def _is_node(v: Any) -> bool:
    return isinstance(v, fx.Node)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS = {
    "Tensor": lambda v: _is_node(v) or _is_number(v),
    "Optional[Tensor]": lambda v: v is None or _is_node(v),
    "List[Tensor]": lambda v: isinstance(v, (list, tuple)) and all(map(_is_node, v)),
    "List[int]": lambda v: isinstance(v, (list, tuple)) and all(map(_is_int, v)),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "float": _is_number,
    "number": _is_number,
}
_KINDS["Optional[List[int]]"] = _KINDS["List[int]"]  # a given list only: None may pick another overload


def _fits(type_name: str, value: Any) -> bool:
    """Whether ``value`` is of the kind the schema's ``type_name`` says (unknown: no)."""
    kind = _KINDS.get(type_name)
    return kind is not None and bool(kind(value))


_VF = torch._C._VariableFunctions
#: operators called through torch's own Python binding of the same ATen overload rather
#: than through the ``OpOverload``, which boxes every argument and result: the same
#: kernel, autograd node and bits, and the demo's four stages ran 2.1-3.2% faster forward
#: and backward (200 alternated runs each). A node calls one only where its arguments
#: make the binding pick the same overload (``_binds_as_recorded``); each is checked
#: against its ``OpOverload`` (the operators dispatched, results and gradients) in
#: tests/test_program.py.
_BOUND: dict[str, Any] = {
    "aten.view.default": torch.Tensor.view,
    "aten.expand.default": torch.Tensor.expand,
    "aten.t.default": _VF.t,
    "aten.transpose.int": _VF.transpose,
    "aten.permute.default": _VF.permute,
    "aten.unsqueeze.default": _VF.unsqueeze,
    "aten.clone.default": _VF.clone,
    "aten.detach.default": _VF.detach,
    "aten.cat.default": _VF.cat,
    "aten.add.Tensor": _VF.add,
    "aten.sub.Tensor": _VF.sub,
    "aten.mul.Tensor": _VF.mul,
    "aten.div.Tensor": _VF.div,
    "aten.neg.default": _VF.neg,
    "aten.rsqrt.default": _VF.rsqrt,
    "aten.pow.Tensor_Scalar": _VF.pow,
    "aten.mean.dim": _VF.mean,
    "aten.sum.dim_IntList": _VF.sum,
    "aten.mm.default": _VF.mm,
    "aten.bmm.default": _VF.bmm,
    "aten.addmm.default": _VF.addmm,
    "aten.embedding.default": _VF.embedding,
    "aten.native_layer_norm.default": _VF.native_layer_norm,
    "aten._softmax.default": _VF._softmax,
    "aten._log_softmax.default": _VF._log_softmax,
    "aten.gelu.default": torch._C._nn.gelu,
    "aten.silu.default": torch._C._nn.silu,
    "aten.scaled_dot_product_attention.default": torch._C._nn.scaled_dot_product_attention,
}
