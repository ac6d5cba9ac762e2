"""A stage as a program of ATen operators: what a peer runs instead of the model's
Python.

The coordinator traces each stage below autograd (``make_fx``) into a graph whose
every call is a ``torch.ops.<namespace>.<op>.<overload>`` (or taking an item of a
multi-output op's result), under the recipe's autocast, so the casts are in the
graph. The graph travels as JSON of a fixed, small vocabulary (node references,
numbers, strings, lists, dtypes, devices), with the stage's constant tensors. A
peer resolves each operator by name in the allowed namespaces only, refuses the
program before anything runs if one is outside them, and then checks the program
on the meta device against the shapes the plan says it takes. Nothing named by the
coordinator is imported: ``torch.ops.aten`` is the dispatcher's table of
operators already loaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from protocol.model.graph import Cut, stage_modules
from protocol.model.recipe import Recipe, autocast
from protocol.wire.encoding import DTYPE_NAMES, DTYPES

PROGRAM_FORMAT = 1
#: how a coordinator sends stages: as programs (this module), or as the job's model code to rebuild
STAGE_FORMS = ("program", "code")
#: operator namespaces a peer runs unless told otherwise (``fusionllm join --allow-ops``)
DEFAULT_NAMESPACES = ("aten",)
#: ATen operators no program may call: they read files or print on the volunteer's machine, change
#: process-wide state, pin or record memory, assert on a device, or make or read sparse tensors (whose
#: indices the kernels trust: a forged one writes out of bounds)
DENIED_OPS = frozenset({
    "from_file", "_print", "save", "warn", "wait", "set_", "set_data", "_pin_memory", "pin_memory",
    "record_stream", "_assert_async", "_functional_assert_async", "_indices", "_values", "indices", "values",
    "_to_dense", "to_dense", "_coalesce", "coalesce", "crow_indices", "col_indices", "ccol_indices", "row_indices",
    "_reshape_alias",  # applies the sizes and strides it is given, unchecked: a view anywhere in the heap
})  # fmt: skip
#: parts of ATen operator names no program may call (sparse and quantized layouts, the FFT plan cache)
DENIED_PARTS = ("sparse", "_cufft", "quantize", "mkldnn", "_nested")
#: how deep a program's JSON and its arguments may nest
MAX_DEPTH = 32
MAX_PROGRAM_BYTES = 64 << 20
MAX_PROGRAM_NODES = 500_000
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


class ProgramError(ValueError):
    """A stage that cannot be sent or run as a program; ``str()`` is one line."""


@dataclass
class Program:
    """One stage's program: ``graph`` (JSON-able) and its constant tensors by name."""

    graph: dict[str, Any]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    def operators(self) -> list[str]:
        """The operators it calls, each once, in first-use order."""
        seen: dict[str, None] = {}
        for node in self.graph.get("nodes", []):
            seen.setdefault(str(node.get("op")), None)
        return list(seen)

    def to_payload(self) -> list[torch.Tensor]:
        """The tensors a message carries: the graph as UTF-8 JSON bytes, then the constants."""
        body = json.dumps({**self.graph, "constants": list(self.constants)}, allow_nan=False).encode()
        return [torch.frombuffer(bytearray(body), dtype=torch.uint8), *self.constants.values()]

    @classmethod
    def from_payload(cls, values: Sequence[Any]) -> Program:
        """The program a message carried (``ProgramError`` when it is not one)."""
        if not values or not isinstance(values[0], torch.Tensor) or values[0].dtype != torch.uint8:
            raise ProgramError("the stage program is missing its graph")
        if values[0].numel() > MAX_PROGRAM_BYTES:
            raise ProgramError(f"the stage program's graph is over {MAX_PROGRAM_BYTES >> 20} MiB")
        try:
            graph = json.loads(bytes(values[0].cpu().numpy().tobytes()).decode())
        except RecursionError:
            raise ProgramError("the stage program's graph nests too deep") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProgramError(f"the stage program's graph is not JSON: {str(exc)[:200]}") from None
        if not isinstance(graph, dict) or graph.get("format") != PROGRAM_FORMAT:
            raise ProgramError(f"the stage program is not of format {PROGRAM_FORMAT}")
        names = graph.pop("constants", None)
        tensors = list(values[1:])
        if not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names):
            raise ProgramError("the stage program's constants do not match its tensors")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ProgramError("the stage program's constants are not all tensors")
        return cls(graph, dict(zip(names, tensors, strict=True)))


# ---------------------------------------------------------------------- export
def _leaves(value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    """(path, leaf) of a value that may nest tuples and lists (a ``torch.Size`` is a leaf)."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _with_leaves(value: Any, leaves: Iterator[Any]) -> Any:
    """``value``'s structure with its leaves taken in order from ``leaves``."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return type(value)(_with_leaves(v, leaves) for v in value)
    return next(leaves)


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
    paths = [p for p, _ in _leaves(list(inputs))]
    flat = [v for _, v in _leaves(list(inputs))]
    tensors = [j for j, v in enumerate(flat) if isinstance(v, torch.Tensor)]  # traced; other leaves are constants

    returned: list[Any] = []

    def run(*args: Any) -> Any:
        values = dict(zip(names, args[: len(names)], strict=True))
        leaves = list(flat)
        for j, value in zip(tensors, args[len(names) :], strict=True):
            leaves[j] = value
        rebuilt = _with_leaves(list(inputs), iter(leaves))
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
    program = _serialize(gm, stage, names, paths, tensors)
    program.graph["output"] = _sizes_as_returned(program.graph["output"], returned[0])
    _verify(stage, program, inputs, recipe or Recipe())
    return program


def _verify(stage: nn.Module, program: Program, inputs: Sequence[Any], recipe: Recipe) -> None:
    """Refuse a program that does not compute what the stage computes, forward and
    backward, on the example (tracing runs below autograd: a custom autograd
    function's own backward, for one, would be lost)."""
    own = tuple({op.split(".")[0] for op in program.operators() if op != "getitem"})  # the model's own code runs here
    module = load_stage(program, namespaces=own)
    module.load_state_dict(stage.state_dict())
    runs = []
    for m, casts in ((stage, True), (module, False)):
        leaves = [_as_input(v) for _, v in _leaves(list(inputs))]
        values = _with_leaves(list(inputs), iter(leaves))
        with torch.enable_grad(), autocast(recipe) if casts else contextlib.nullcontext():
            out = m(*values)
        roots = [t for _, t in _leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(t.shape, generator=gen).to(t.dtype) if t.numel() != 1 else None for t in roots]
        if roots:
            torch.autograd.backward(roots, [g if g is not None else torch.ones_like(t) for g, t in zip(grads, roots)])
        own = [p.grad for _, p in sorted(m.named_parameters())]
        runs.append([*[t for _, t in _leaves(out)], *[x.grad for x in leaves if isinstance(x, torch.Tensor)], *own])
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


# ---------------------------------------------------------------------- load
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
            kwargs = _on_device(target, args, kwargs, device)
            env[node["name"]] = g.call_function(_ZEROED.get(node["op"], target), args, kwargs)
        g.output(_dec(graph["output"], env, device))
        root = nn.Module()
        for name, (t, persistent) in tensors.items():
            _install(root, name, t, persistent)
        gm = fx.GraphModule(root, g, class_name="StageProgram")
        for name, (t, persistent) in tensors.items():  # aliases and persistence, as the model had them
            _install(gm, name, t, persistent)
        shape = graph["output"]
        gm.register_forward_hook(lambda module, args, out: _with_sizes(out, shape))
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
    for name in ("empty.memory_format", "empty_like.default", "new_empty.default", "empty_strided.default",
                 "new_empty_strided.default")
}  # fmt: skip


def _with_sizes(value: Any, enc: Any) -> Any:
    """``value`` (a graph's output) with the ``torch.Size`` values its encoding names
    (an fx graph cannot return one: it turns them into tuples)."""
    if isinstance(enc, dict) and len(enc) == 1:
        ((kind, items),) = enc.items()
        if kind == "size" and isinstance(value, tuple):
            return torch.Size(value)
        if kind in ("tuple", "list") and isinstance(value, (tuple, list)) and len(items) == len(value):
            return type(value)(_with_sizes(v, e) for v, e in zip(value, items, strict=True))
    return value


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


# ---------------------------------------------------------------------- check
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
            for _, t in _leaves(out):
                if isinstance(t, torch.Tensor):
                    _check_value(t, memory)
                    total += t.numel() * t.element_size()
            return out

    try:
        gm = load_stage(program, "meta", namespaces)
        values = [_meta_value(d) for d in inputs]
        with torch.no_grad():
            out = _with_sizes(Counting(gm).run(*values), program.graph["output"])
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
