"""The OP-DAG: a model's operators with forward FLOPs, parameter bytes and
activation bytes, measured by running the traced graph once on example inputs
(real tensors, or meta tensors for a model's shape without its weights)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from protocol.model.graph import (
    OP_KINDS,
    Cut,
    CutError,
    Partition,
    forbidden_boundaries,
    operators,
    partition,
    trace,
)


@dataclass(frozen=True)
class OpInfo:
    """One operator of the OP-DAG."""

    index: int
    name: str
    kind: str  # call_module / call_function / call_method
    target: str
    flops: int  # forward FLOPs on the example micro-batch
    param_bytes: int
    out_bytes: int  # the output's size (what a cut right after this op would carry)
    saved_bytes: int  # new memory the output takes: 0 for a view of (or the same tensor as) an input
    out_shape: str


@dataclass(frozen=True)
class ValueMeta:
    """What a value in the graph looked like on the example inputs."""

    is_tensor: bool
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _describe(value: Any) -> ValueMeta:
    if isinstance(value, torch.Tensor):
        return ValueMeta(True, str(value.dtype).removeprefix("torch."), tuple(value.shape), value.nbytes)
    if isinstance(value, (tuple, list)):
        total = sum(_describe(v).nbytes for v in value)
        return ValueMeta(False, type(value).__name__, (len(value),), total)
    return ValueMeta(False, type(value).__name__, (), 0)


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


#: operators that only reshape, view or index: no arithmetic
FREE_OPS = frozenset(
    "view reshape transpose permute contiguous split chunk getitem getattr size expand "
    "unsqueeze squeeze flatten unflatten narrow select arange to type float long".split()
)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, looking inside tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` uses: its base if it is a view, else itself."""
    return t._base if t._base is not None else t


def new_bytes(out: Any, inputs: list[Any]) -> int:
    """Bytes of the tensors in ``out`` that are new memory: a tensor that is an input
    (or an item of an input tuple) or a view of an input's memory counts 0 (view,
    transpose, split, getitem, expand, a reshape or ``contiguous`` that copies nothing)."""
    held = {id(_storage_root(t)) for v in inputs for t in _tensors(v)}
    fresh = {id(t): t for t in _tensors(out) if id(_storage_root(t)) not in held}
    return sum(t.nbytes for t in fresh.values())


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Forward FLOPs of ``scaled_dot_product_attention``: ``Q K^T`` and ``(.) V``, two
    FLOPs per multiply-add, ``4 B H Tq Tk hs`` when query and value heads are equally wide.
    The full score matrix is counted, with no discount for a causal mask, as
    ``torch.utils.flop_counter.sdpa_flop_count`` does (a causal kernel that skips the
    masked blocks does about half of it)."""
    rows = query.numel() // query.shape[-1]  # B x H x Tq (key/value heads broadcast, as in GQA)
    return 2 * rows * key.shape[-2] * (query.shape[-1] + value.shape[-1])


def _is_attention(n: fx.Node) -> bool:
    return n.op == "call_function" and _target_name(n) == "scaled_dot_product_attention"


class _Meter(fx.Interpreter):
    """Runs the graph once and records every node's FLOPs, output and new memory."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.flops: dict[fx.Node, int] = {}
        self.meta: dict[fx.Node, ValueMeta] = {}
        self.saved: dict[fx.Node, int] = {}

    def _inputs(self, n: fx.Node) -> list[Any]:
        return [self.env[a] for a in n.all_input_nodes if a in self.env]

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        counted = self.counter.get_total_flops() - before
        if _is_attention(n):
            # the counter sees attention only where it decomposes (0 on CPU): use the formula
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            qkv = [*args[:3], *(kwargs[k] for k in ("query", "key", "value") if k in kwargs)]
            counted = attention_flops(*qkv[:3])
        elif counted == 0 and n.op in OP_KINDS and _target_name(n) not in FREE_OPS:
            # elementwise and reduction ops: about one FLOP per element read or written
            sizes = [a.numel() for a in (*self._inputs(n), out) if _is_float(a)]
            counted = max(sizes, default=0)
        self.flops[n] = counted
        self.meta[n] = _describe(out)
        self.saved[n] = new_bytes(out, self._inputs(n))
        return out


@dataclass
class OpDag:
    """A traced model with per-operator costs."""

    gm: fx.GraphModule
    ops: list[OpInfo]
    meta: dict[str, ValueMeta]  # node name -> value description
    forbidden: dict[int, str]  # boundary position -> why it would split tied weights
    #: cut -> each stage's FLOPs (``stage_flops``: read on every StepDone)
    _flops: dict[Cut, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def total_flops(self) -> int:
        return sum(o.flops for o in self.ops)

    @property
    def total_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.gm.parameters())

    def partition(self, cut: Cut) -> Partition:
        return partition(self.gm, cut)

    def boundary_bytes(self, cut: Cut) -> list[int]:
        """Bytes crossing each boundary of ``cut`` per example micro-batch (forward)."""
        part = self.partition(cut)
        return [sum(self.meta[v.name].nbytes for v in part.outputs[s]) for s in range(cut.num_stages - 1)]

    def stage_flops(self, cut: Cut) -> tuple[int, ...]:
        """Each stage's FLOPs under ``cut``, summed once per cut."""
        got = self._flops.get(cut)
        if got is None:
            got = self._flops[cut] = tuple(c["flops"] for c in self.stage_costs(cut))
        return got

    def stage_costs(self, cut: Cut) -> list[dict[str, int]]:
        out = []
        for lo, hi in cut.ranges(self.num_ops):
            ops = self.ops[lo:hi]
            out.append(
                {
                    "first_op": lo,
                    "last_op": hi - 1,
                    "flops": sum(o.flops for o in ops),
                    "param_bytes": sum(o.param_bytes for o in ops),
                }
            )
        return out


def _params_read(gm: fx.GraphModule, n: fx.Node) -> list[nn.Parameter]:
    """The parameters operator ``n`` reads: its module's, and those it gets as attributes."""
    params: list[nn.Parameter] = []
    if n.op == "call_module":
        params = list(gm.get_submodule(str(n.target)).parameters())
    for a in n.all_input_nodes:
        if a.op == "get_attr":
            obj = gm
            for part in str(a.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, nn.Parameter):
                params.append(obj)
    return params


def build_opdag(model: nn.Module, example: tuple[torch.Tensor, ...], param_dtype: torch.dtype | None = None) -> OpDag:
    """Trace ``model`` and measure every operator on the ``example`` micro-batch (real
    or meta tensors). ``param_dtype``: count parameter bytes in this dtype instead of
    the model's own (fp32 master weights of a model traced in bf16 for bf16 activations)."""
    gm = trace(model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        meter = _Meter(gm, counter)
        meter.run(*example)
    ops = []
    seen_params: set[int] = set()  # a parameter read by several ops counts at its first
    for i, n in enumerate(operators(gm)):
        pbytes = 0
        for p in _params_read(gm, n):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                pbytes += p.numel() * (p.element_size() if param_dtype is None else param_dtype.itemsize)
        m = meter.meta[n]
        ops.append(
            OpInfo(
                index=i,
                name=n.name,
                kind=n.op,
                target=_target_name(n),
                flops=int(meter.flops[n]),
                param_bytes=pbytes,
                out_bytes=m.nbytes,
                saved_bytes=meter.saved[n],
                out_shape="x".join(map(str, m.shape)) if m.is_tensor else m.dtype,
            )
        )
    meta = {n.name: m for n, m in meter.meta.items()}
    return OpDag(gm=gm, ops=ops, meta=meta, forbidden=forbidden_boundaries(gm))


def balanced_cut(dag: OpDag, num_stages: int, weights: list[float] | None = None) -> Cut:
    """Cut ``dag`` into ``num_stages`` stages whose FLOPs follow ``weights`` (equal by
    default), never splitting tied parameters. Raises :class:`CutError` if impossible."""
    n = dag.num_ops
    if num_stages < 1:
        raise CutError("the number of stages must be at least 1")
    if num_stages > n:
        raise CutError(f"cannot cut {n} ops into {num_stages} stages (at most {n})")
    allowed = [b for b in range(1, n) if b not in dag.forbidden]
    if len(allowed) < num_stages - 1:
        reason = next(iter(dag.forbidden.values()), "")
        raise CutError(
            f"only {len(allowed)} cut positions keep tied weights together; "
            f"{num_stages} stages need {num_stages - 1} ({reason})"
        )
    w = weights or [1.0] * num_stages
    # Every op costs at least one unit so that cheap ops still spread out.
    cost = [max(o.flops, 1) for o in dag.ops]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    total = prefix[-1]
    bounds: list[int] = []
    share = 0.0
    for s in range(num_stages - 1):
        share += w[s] / sum(w)
        goal = share * total
        lo = bounds[-1] + 1 if bounds else 1
        remaining = num_stages - 2 - s  # boundaries still to place after this one
        cands = [b for b in allowed if b >= lo]
        cands = cands[: len(cands) - remaining] if remaining else cands
        if not cands:
            raise CutError(f"no room for {num_stages} stages between tied weights")
        bounds.append(min(cands, key=lambda b: abs(prefix[b] - goal)))
    return Cut(tuple(bounds))


def cost_lists(dag: OpDag) -> dict[str, Any]:
    """The per-op cost lists the estimator plans with (``DagCosts`` fields): what
    crosses each cut position comes from every value's producer and last consumer;
    ``cross_cols`` is 0 where no floating matrix crosses."""
    ops = list(operators(dag.gm))
    index = {n: i for i, n in enumerate(ops)}
    cross, fcross = _crossings(dag, index)
    return {
        "flops": [max(o.flops, 1) for o in dag.ops],
        "param_bytes": [o.param_bytes for o in dag.ops],
        "act_bytes": [o.saved_bytes for o in dag.ops],
        "cross_bytes": cross,
        "float_cross": fcross,
        "forbidden": frozenset(dag.forbidden),
        "kernels": [0 if o.target in FREE_OPS else 1 for o in dag.ops],
        "float_itemsize": _float_itemsize(dag.meta.values()),
        "cross_cols": _cross_cols(dag, index),
    }


def _crossings(dag: OpDag, index: dict[fx.Node, int]) -> tuple[list[int], list[int]]:
    """Bytes crossing each cut position, and their floating part."""
    n = len(index)
    diff = [0] * (n + 1)
    fdiff = [0] * (n + 1)
    for node in dag.gm.graph.nodes:
        if node.op == "placeholder":
            born = 0  # batch inputs reach stage 0 with the batch
        elif node in index:
            born = index[node] + 1
        else:
            continue
        users = [index[u] for u in node.users if u in index]
        if not users:
            continue
        last = max(users)
        if last >= born:  # crosses positions born .. last
            meta = dag.meta.get(node.name)
            nbytes = meta.nbytes if meta is not None else 0
            floating = nbytes if meta is not None and meta.dtype.startswith(("float", "bfloat")) else 0
            lo = max(born, 1)
            if last >= lo:
                diff[lo] += nbytes
                diff[last + 1] -= nbytes
                fdiff[lo] += floating
                fdiff[last + 1] -= floating
    cross, fcross, run, frun = [0] * n, [0] * n, 0, 0
    for p in range(n):
        run += diff[p]
        frun += fdiff[p]
        cross[p], fcross[p] = run, frun
    return cross, fcross


def _cross_cols(dag: OpDag, index: dict[fx.Node, int]) -> list[int]:
    """Per cut position, the last dimension of the widest floating tensor crossing it (0: none)."""
    cols = [0] * len(index)
    for node in dag.gm.graph.nodes:
        meta = dag.meta.get(node.name)
        users = [index[u] for u in node.users if u in index]
        if meta is None or not users or not meta.dtype.startswith(("float", "bfloat")) or not meta.shape:
            continue
        born = 1 if node.op == "placeholder" else index[node] + 1 if node in index else None
        if born is None:
            continue
        for p in range(born, max(users) + 1):
            cols[p] = max(cols[p], meta.shape[-1])
    return cols


def _float_itemsize(values: Iterable[ValueMeta]) -> int:
    """Bytes per element of the floating values a model makes (most of their bytes)."""
    by_size: dict[int, int] = {}
    for v in values:
        if v.is_tensor and v.dtype.startswith(("float", "bfloat")):
            size = 2 if v.dtype in ("float16", "bfloat16") else 8 if v.dtype == "float64" else 4
            by_size[size] = by_size.get(size, 0) + v.nbytes
    return max(by_size, key=lambda k: by_size[k], default=4)
