"""The stage contract: how a traced model is cut into stages.

Coordinator and peers both derive a stage from (model definition, cut, stage
index) with the functions here, so they agree on exactly which operators, which
incoming values and which outgoing values a stage has, without shipping code.
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass

import torch
from torch import fx, nn

#: fx node kinds that are operators of the OP-DAG (placeholders, attribute reads
#: and the output node are not: attribute reads live in the stage that uses them).
OP_KINDS = ("call_module", "call_function", "call_method")


class TraceFailure(Exception):
    """torch.fx could not trace a model; ``str()`` is one line for the user."""


class CutError(ValueError):
    """A cut that cannot be executed; ``str()`` says why in one line."""


@dataclass(frozen=True)
class Cut:
    """Stage boundaries over the topological order of the OP-DAG's operators.

    ``boundaries[i]`` is the index of the first operator of stage ``i + 1``.
    """

    boundaries: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1

    def stage_of_op(self, op_index: int) -> int:
        stage = 0
        for b in self.boundaries:
            if op_index >= b:
                stage += 1
        return stage

    def ranges(self, num_ops: int) -> list[tuple[int, int]]:
        """Half-open operator ranges ``[start, end)`` per stage."""
        edges = [0, *self.boundaries, num_ops]
        return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]

    def to_list(self) -> list[int]:
        return list(self.boundaries)


def _user_frame(tb: traceback.StackSummary) -> traceback.FrameSummary | None:
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(tb):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
            return frame
    return None


def trace(model: nn.Module) -> fx.GraphModule:
    """Trace ``model`` with torch.fx, or raise :class:`TraceFailure` with one line."""
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types; all mean "not traceable"
        frame = _user_frame(traceback.extract_tb(exc.__traceback__))
        where = ""
        if frame is not None:
            code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name} (`{code}`)"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceFailure(
            f"torch.fx cannot trace the model{where}: {reason}. Remove data-dependent Python "
            "control flow from forward(), or move that code into a function marked with "
            "torch.fx.wrap or a leaf module."
        ) from None


def operators(gm: fx.GraphModule) -> list[fx.Node]:
    """The OP-DAG's operators in topological (graph) order."""
    return [n for n in gm.graph.nodes if n.op in OP_KINDS]


def _params_of(gm: fx.GraphModule, node: fx.Node) -> dict[int, str]:
    """Parameters an operator or attribute read touches: id -> qualified name."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return {id(p): f"{node.target}.{name}" for name, p in mod.named_parameters()}
    if node.op == "get_attr":
        obj = _fetch_attr(gm, str(node.target))
        if isinstance(obj, nn.Parameter):
            return {id(obj): str(node.target)}
    return {}


def _fetch_attr(gm: nn.Module, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def forbidden_boundaries(gm: fx.GraphModule) -> dict[int, str]:
    """Boundary positions that would split a parameter between stages, with the reason.

    A parameter read by operators at indices ``a < b`` forbids every boundary in
    ``(a, b]``: tied weights stay in one stage.
    """
    ops = operators(gm)
    index = {n: i for i, n in enumerate(ops)}
    uses: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for n in gm.graph.nodes:
        touched = _params_of(gm, n)
        if not touched:
            continue
        if n.op == "get_attr":
            at = [index[u] for u in n.users if u in index]
        else:
            at = [index[n]]
        for pid, name in touched.items():
            uses.setdefault(pid, []).extend(at)
            names.setdefault(pid, name)
    forbidden: dict[int, str] = {}
    for pid, at in uses.items():
        if not at:
            continue
        lo, hi = min(at), max(at)
        for b in range(lo + 1, hi + 1):
            forbidden.setdefault(
                b,
                f"parameter '{names[pid]}' is used by op {lo} ({ops[lo].name}) and op {hi} "
                f"({ops[hi].name}); tied weights must stay in one stage",
            )
    return forbidden


@dataclass
class Partition:
    """Which stage owns each node, and the values each stage receives and sends.

    ``inputs[s]`` are the values stage ``s`` receives (for stage 0: the model's
    inputs, in order); ``outputs[s]`` are the values it sends to stage ``s + 1``.
    A value produced in stage ``a`` and last read in stage ``c > a + 1`` crosses
    every boundary in between.
    """

    gm: fx.GraphModule
    cut: Cut
    ops: list[fx.Node]
    stage_of: dict[fx.Node, int]
    inputs: list[list[fx.Node]]
    outputs: list[list[fx.Node]]


def partition(gm: fx.GraphModule, cut: Cut) -> Partition:
    """Assign every node of ``gm`` to a stage of ``cut``; raise :class:`CutError` if invalid."""
    ops = operators(gm)
    b = cut.boundaries
    if any(x <= 0 or x >= len(ops) for x in b) or list(b) != sorted(set(b)):
        raise CutError(
            f"boundaries {list(b)} must be strictly increasing and within 1..{len(ops) - 1} "
            f"(the model has {len(ops)} ops)"
        )
    forbidden = forbidden_boundaries(gm)
    for x in b:
        if x in forbidden:
            raise CutError(f"cannot cut before op {x}: {forbidden[x]}")
    stage_of: dict[fx.Node, int] = {}
    last = cut.num_stages - 1
    for i, n in enumerate(ops):
        stage_of[n] = cut.stage_of_op(i)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            stage_of[n] = 0
        elif n.op == "output":
            stage_of[n] = last
    inputs: list[list[fx.Node]] = [[] for _ in range(cut.num_stages)]
    outputs: list[list[fx.Node]] = [[] for _ in range(cut.num_stages)]
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            inputs[0].append(n)
    for n in gm.graph.nodes:
        if n not in stage_of or n.op == "output":
            continue
        readers = [stage_of[u] for u in n.users]
        if not readers:
            continue
        produced, read_last = stage_of[n], max(readers)
        for s in range(produced, read_last):
            outputs[s].append(n)
            inputs[s + 1].append(n)
    return Partition(gm, cut, ops, stage_of, inputs, outputs)


def build_stage(part: Partition, stage: int) -> fx.GraphModule:
    """Rebuild stage ``stage`` as its own module.

    Its ``forward(*inputs)`` takes ``part.inputs[stage]`` and returns a tuple of
    ``part.outputs[stage]``; the last stage returns what the model returns (the
    loss). Submodules and parameters keep their qualified names from the model.
    """
    gm = part.gm
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in part.inputs[stage]:
        env[v] = g.placeholder(v.name)

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = g.node_copy(a)
        return env[a]

    for n in gm.graph.nodes:
        if n.op in OP_KINDS and part.stage_of[n] == stage:
            env[n] = g.node_copy(n, lookup)
        elif n.op == "output" and stage == part.cut.num_stages - 1:
            g.node_copy(n, lookup)
    if stage < part.cut.num_stages - 1:
        g.output(tuple(env[v] for v in part.outputs[stage]))
    g.lint()
    return fx.GraphModule(gm, g, class_name=f"Stage{stage}")


def stage_modules(model: nn.Module, cut: Cut) -> tuple[Partition, list[fx.GraphModule]]:
    """Trace ``model`` and rebuild all stages of ``cut``."""
    part = partition(trace(model), cut)
    return part, [build_stage(part, s) for s in range(cut.num_stages)]
