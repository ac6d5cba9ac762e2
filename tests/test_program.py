"""Stages as programs of ATen operators (issue 16): they compute exactly what the
model's stages compute, forward and backward, under every precision; they carry no
Python; and a peer refuses a program outside its allowed operators, a malformed one,
or one that does not fit the plan's shapes, in one line, before anything runs."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from coordinator.links import boundary_specs
from peer.executor import StageExecutor
from protocol.model.graph import Cut, forbidden_boundaries, operators, stage_modules, trace
from protocol.model.job import JobSpec
from protocol.model.program import DEFAULT_NAMESPACES, Program, ProgramError
from protocol.model.program_check import build_checked, dry_run
from protocol.model.program_export import export_stage, export_stages
from protocol.model.program_load import _BOUND, _callable, check_operators, load_stage, resolve_op
from protocol.model.recipe import Recipe

GPT = JobSpec(model_args="n_layer=2,n_embd=64,n_head=4")
BRANCHY = JobSpec(model="tests/models.py:branchy_wide", data="branchy")
CUSTOM = JobSpec(model="tests/custom_op_model.py:build", data="tests/custom_op_model.py:data")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """These models are too small for a second thread to help, and on a loaded machine
    torch's threads wait for each other (the exports ran 2-5x slower): one thread here,
    as the swarm tests' peers run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _exported(job: JobSpec, cut: Cut) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Each stage's program of ``cut`` in its wire form, exported once for every test
    (a job's model is the same for every build: seeded)."""
    programs = export_stages(job.build_model(), cut, job.first_micro_batch(), job.recipe())
    return tuple(tuple(program.to_payload()) for program in programs)


def _programs(job: JobSpec, cut: Cut) -> list[Program]:
    """The stages' programs, each a fresh copy: what one test does to its own leaves
    the next one's as exported."""
    return [Program.from_payload([t.clone() for t in payload]) for payload in _exported(job, cut)]


def _stages(job: JobSpec, cut: Cut) -> tuple[list[nn.Module], list[Program]]:
    _, stages = stage_modules(job.build_model(), cut)
    return stages, _programs(job, cut)


def _loaded(program: Program, stage: nn.Module) -> nn.Module:
    module = load_stage(Program.from_payload(program.to_payload()))  # as a peer gets it: through the wire form
    module.load_state_dict(stage.state_dict())
    return module


def _run(ex: StageExecutor, inputs: list[Any]) -> list[Any]:
    """Forward and backward of one micro-batch: outputs, the inputs' and the parameters' gradients."""
    out = ex.forward(0, inputs)
    outs = [out] if ex.is_last else list(out)
    gen = torch.Generator().manual_seed(1)
    grads = (
        None
        if ex.is_last
        else [torch.randn(o.shape, generator=gen).to(o.dtype) if _floating(o) else None for o in outs]
    )
    in_grads = ex.backward(0, grads)
    params = [p.grad for _, p in sorted(ex.module.named_parameters())]
    return [*outs, *in_grads, *params]


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("job,cut", [(GPT, Cut((10, 30))), (BRANCHY, Cut((6, 14)))], ids=["gpt", "branchy"])
def test_a_program_computes_exactly_what_its_stage_computes(job: JobSpec, cut: Cut, precision: str) -> None:
    """Outputs, input gradients and parameter gradients bit for bit, stage by stage
    (the branchy model's skips cross two boundaries; the GPT passes sizes along)."""
    job = JobSpec(**{**job.__dict__, "precision": precision})
    recipe = job.recipe()
    stages, programs = _stages(job, cut)
    inputs: list[Any] = list(job.first_micro_batch())
    for s, (stage, program) in enumerate(zip(stages, programs, strict=True)):
        last = s == len(stages) - 1
        ours = StageExecutor(_loaded(program, stage), recipe, last, casts_inside=True)
        theirs = StageExecutor(stage, recipe, last)
        mine, reference = _run(ours, inputs), _run(theirs, inputs)
        assert _equal(mine, reference), f"stage {s} under {precision}"
        if not last:
            inputs = list(theirs.evaluate(inputs))


def test_a_program_names_no_kernel_of_the_cpu_it_was_traced_on() -> None:
    """Traced on a CPU, attention records the kernel it picked there
    (``_scaled_dot_product_flash_attention_for_cpu``), which a peer on a GPU cannot run:
    on the first GPU run every stage's peer failed on it. The program carries
    ``scaled_dot_product_attention`` instead, and still computes bit for bit what its
    stage does (the test above)."""
    ops = [{node["op"] for node in program.graph["nodes"]} for program in _programs(GPT, Cut((10, 30)))]
    assert not any(op.endswith("_for_cpu.default") for stage in ops for op in stage), ops
    assert any("aten.scaled_dot_product_attention.default" in stage for stage in ops), ops


def test_a_program_is_data_not_python() -> None:
    """The wire form is JSON of ATen operator names and plain values, and the tensors
    it needs; the state it names is the stage's own, tied names included."""
    job = JobSpec(model="tests/models.py:tied", data="tests/models.py:tied_data")
    stages, programs = _stages(job, Cut(()))
    payload = programs[0].to_payload()
    graph = json.loads(payload[0].numpy().tobytes())
    assert all(op.startswith("aten.") or op == "getitem" for op in programs[0].operators())
    assert "import" not in payload[0].numpy().tobytes().decode()
    module = load_stage(Program.from_payload(payload))
    assert set(module.state_dict()) == set(stages[0].state_dict()), "tied weights keep both names"
    assert {n for e in graph["state"] for n in e["names"]} >= set(stages[0].state_dict())


def _edited(program: Program, edit: Any) -> list[torch.Tensor]:
    graph = json.loads(json.dumps(program.graph))
    edit(graph)
    return Program(graph, dict(program.constants)).to_payload()


def _gpt_last() -> Program:
    return _programs(GPT, Cut((10,)))[1]


def _set_op(graph: dict[str, Any], op: str) -> None:
    graph["nodes"][0]["op"] = op


REFUSALS = {
    "an operator outside the allowed namespaces": (
        lambda g: _set_op(g, "prims.mul.default"),
        "calls prims.mul.default, outside the allowed operator namespaces (aten)",
    ),
    "an ATen operator that reads files": (lambda g: _set_op(g, "aten.from_file.default"), "which no program may call"),
    "an operator this torch lacks": (lambda g: _set_op(g, "aten.no_such_op.default"), "which this torch does not have"),
    "a name that is not an operator": (lambda g: _set_op(g, "aten.__class__.x"), "which is not ns.op.overload"),
    "a tensor named like a method": (lambda g: g["state"][0]["names"].append("forward"), "cannot be an attribute"),
    "a reference to nothing": (
        lambda g: g["nodes"][0]["args"]["tuple"].insert(0, {"ref": "elsewhere"}),
        "refers to 'elsewhere' before it is computed",
    ),
    "an argument of an unknown kind": (
        lambda g: g["nodes"][0]["args"]["tuple"].append({"pickle": "x"}),
        "a node argument of the stage program is malformed",
    ),
    "a negative shape": (lambda g: g["state"][0].update(shape=[-1]), "a malformed shape"),
    "another format": (lambda g: g.update(format=99), "is not of format 1"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_program_is_refused_in_one_line(case: str) -> None:
    edit, expected = REFUSALS[case]
    payload = _edited(_gpt_last(), edit)
    with pytest.raises(ProgramError) as err:
        load_stage(Program.from_payload(payload))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_bytes_that_are_not_a_program_are_refused() -> None:
    junk = torch.frombuffer(bytearray(b"\x80not json"), dtype=torch.uint8)
    for values, expected in [
        ([], "missing its graph"),
        ([junk], "not JSON"),
        ([torch.zeros(3)], "missing its graph"),
        ([*_gpt_last().to_payload(), torch.zeros(1)], "constants do not match"),
    ]:
        with pytest.raises(ProgramError, match=expected):
            Program.from_payload(values)


def test_a_program_outside_the_allowlist_is_refused_before_it_runs() -> None:
    """The custom-operator model's first stage calls ``fusiontest.scaled``: refused
    unless the namespace is allowed (and then it runs)."""
    _, programs = _stages(CUSTOM, Cut((2,)))
    with pytest.raises(ProgramError, match="fusiontest.scaled.default, outside the allowed"):
        check_operators(programs[0], DEFAULT_NAMESPACES)
    module = load_stage(programs[0], namespaces=("aten", "fusiontest"))
    assert isinstance(module(*CUSTOM.first_micro_batch()), tuple)


def test_a_program_is_checked_against_the_plans_shapes() -> None:
    model = GPT.build_model()
    cut = Cut((10,))
    specs = boundary_specs(model, cut, GPT.first_micro_batch())
    first, last = _programs(GPT, cut)
    assert dry_run(first, specs[0], specs[1]) > 0
    assert dry_run(last, specs[1], None) > 0
    wrong = json.loads(json.dumps(specs[1]))
    wrong[1]["shape"] = [4, 64, 65]
    with pytest.raises(ProgramError, match="does not run on its inputs"):
        dry_run(last, wrong, None)
    with pytest.raises(ProgramError, match="does not return the values the next stage takes"):
        dry_run(first, specs[0], wrong)
    with pytest.raises(ProgramError, match="does not return a scalar loss"):
        dry_run(first, specs[0], None)


class _Clipped(torch.autograd.Function):
    """A custom backward (straight-through): tracing below autograd would lose it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-0.1, 0.1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@torch.fx.wrap
def _clipped(x: torch.Tensor) -> torch.Tensor:
    return _Clipped.apply(x)


class _CustomBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _clipped(self.a(x)).sum()


def test_a_model_whose_program_would_differ_is_not_sent_as_one() -> None:
    """A custom autograd function, or data-dependent Python: the export refuses, and
    the coordinator falls back to the model's code (for peers that opt in)."""
    torch.manual_seed(0)
    with pytest.raises(ProgramError, match="does not compute what the stage computes"):
        export_stage(torch.fx.symbolic_trace(_CustomBackward()), [torch.randn(4, 8) * 10], Recipe())
    late = JobSpec(model="tests/models.py:late", data="tests/models.py:late_data")
    with pytest.raises(ProgramError, match="cannot be traced to ATen operators"):
        export_stages(late.build_model(), Cut(()), late.first_micro_batch())


@functools.cache
def _every_other_boundary() -> tuple[int, ...]:
    """Every other boundary the GPT can be cut at (half the cuts: half the time)."""
    gm = trace(GPT.build_model())
    forbidden = forbidden_boundaries(gm)
    return tuple(b for b in range(1, len(operators(gm)), 2) if b not in forbidden)


def test_every_cut_gives_programs_that_run_on_what_the_wire_delivers() -> None:
    """Boundary values arrive contiguous: a program traced on a transposed view once
    recorded an ``aten.view`` that only those strides allow (a 2-peer swarm cut there)."""
    model = GPT.build_model()
    for b in _every_other_boundary():
        cut = Cut((b,))
        first, last = stage_modules(model, cut)[1]
        program = _programs(GPT, cut)[1]
        with torch.no_grad():
            values = list(first(*GPT.first_micro_batch()))
        arrived = [v.contiguous().requires_grad_(v.is_floating_point()) if _floating(v) else v for v in values]
        loss = _loaded(program, last)(*arrived)
        loss.backward()
        assert torch.equal(loss, last(*values)), f"boundary {b}"


def test_every_cut_passes_the_peers_dry_run_against_the_plans_specs() -> None:
    """A peer's checks before it runs a stage (``build_checked``) on every other cut,
    both stages: a cut that passes ``idx.device`` on once failed the dry run (its
    device was meta there, cpu in the plan), and the NAT test's planner chose it."""
    model = GPT.build_model()
    for b in _every_other_boundary():
        cut = Cut((b,))
        specs = boundary_specs(model, cut, GPT.first_micro_batch())
        programs = _programs(GPT, cut)
        for s, outputs in ((0, specs[1]), (1, None)):
            build_checked(programs[s], specs[s], outputs, "cpu", DEFAULT_NAMESPACES)


def _node(name: str, op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"name": name, "op": op, "args": {"tuple": list(args)}, "kwargs": {"kwargs": kwargs}}


def _with_node(node: dict[str, Any]) -> Any:
    return lambda g: g["nodes"].insert(0, node)


def _checked(payload: list[torch.Tensor], memory: int | None = None) -> Any:
    """A peer's whole check of the GPT's last stage, as ``_build_checked`` runs it."""
    model, cut = GPT.build_model(), Cut((10,))
    specs = boundary_specs(model, cut, GPT.first_micro_batch())
    return build_checked(Program.from_payload(payload), specs[1], None, "cpu", DEFAULT_NAMESPACES, memory)


HOSTILE = {  # what a review found a hostile coordinator could do with the first version
    "Python in a keyword name": (
        _with_node(_node("x", "aten.zeros.default", {"list": [1]}, **{"zz=0) if print('pwned') else (None": 0})),
        "a node argument of the stage program is malformed",
    ),
    "a keyword the operator does not take": (
        _with_node(_node("x", "aten.zeros.default", {"list": [1]}, evil=1)),
        "keyword arguments it does not take",
    ),
    "sparse tensors (forged indices write out of bounds)": (
        _with_node(_node("x", "aten._to_sparse.default", {"ref": "i:1"})),
        "which no program may call",
    ),
    "a sparse gradient (embedding's)": (
        _with_node(
            _node(
                "x", "aten.embedding.default", {"ref": "s:blocks.0.attn.c_proj.weight"}, {"ref": "i:0"}, -1, False, True
            )
        ),
        "for a sparse result",
    ),
    "process-wide state": (_with_node(_node("x", "aten.set_grad_enabled.default", False)), "returns no tensor"),
    "a terabyte allocation": (
        _with_node(_node("x", "aten.empty.memory_format", {"list": [1 << 38]})),
        "more than the memory lent",
    ),
    "a giant parameter": (lambda g: g["state"][0].update(shape=[1 << 20, 1 << 20]), "more than the"),
    "arguments nested 100 deep": (
        _with_node(_node("x", "aten.zeros.default", functools.reduce(lambda a, _: {"list": [a]}, range(100), 1))),
        "nests deeper than",
    ),
    "a node that is not one": (lambda g: g["nodes"].append(1), "a node of the stage program is malformed"),
    "a view past its storage (reads and writes the heap)": (
        _with_node(_node("x", "aten.as_strided.default", {"ref": "i:1"}, {"list": [8]}, {"list": [16384]})),
        "reaches outside its storage",
    ),
    "an unchecked alias": (
        _with_node(_node("x", "aten._reshape_alias.default", {"ref": "i:1"}, {"list": [8]}, {"list": [1]})),
        "which no program may call",
    ),
    "values that together exceed the memory": (
        lambda g: g["nodes"].__setitem__(
            slice(0, 0), [_node(f"z{i}", "aten.zeros.default", {"list": [1 << 18]}) for i in range(12)]
        ),
        "for one micro-batch, more than the",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_program_is_refused_before_it_touches_the_device(case: str) -> None:
    edit, expected = HOSTILE[case]
    with pytest.raises(ProgramError) as err:
        _checked(_edited(_gpt_last(), edit), memory=8 << 20 if "together" in case else 1 << 30)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_json_nested_past_any_program_is_refused_in_one_line() -> None:
    deep = torch.frombuffer(bytearray(b"[" * 200_000 + b"]" * 200_000), dtype=torch.uint8)
    with pytest.raises(ProgramError, match="nests too deep"):
        Program.from_payload([deep])


def test_uninitialised_memory_never_reaches_a_program() -> None:
    """``aten.empty`` gives zeros here, and so do state entries before they are loaded."""
    graph = {
        "format": 1,
        "inputs": [[0]],
        "state": [],
        "output": {"ref": "x"},
        "nodes": [_node("x", "aten.empty.memory_format", {"list": [1 << 16]})],
    }
    module = load_stage(Program(graph))
    for _ in range(3):
        garbage = torch.full((1 << 16,), 7.0)
        del garbage
        assert torch.count_nonzero(module(torch.zeros(1))) == 0


def _floats(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bound_cases() -> dict[str, tuple[Any, ...]]:
    """Each bound operator's arguments, as a traced program gives them (positional, then keywords)."""
    x, y, m = _floats(2, 3, 4), _floats(2, 3, 4, seed=1), _floats(4, 5, seed=2)
    q, k, v = (_floats(1, 2, 6, 8, seed=s) for s in (3, 4, 5))
    w = _floats(10, 4, seed=6)
    return {
        "aten.view.default": ((x, [6, 4]), {}),
        "aten.expand.default": ((_floats(1, 3), [4, 3]), {}),
        "aten.t.default": ((m,), {}),
        "aten.transpose.int": ((x, 0, 2), {}),
        "aten.permute.default": ((x, [2, 0, 1]), {}),
        "aten.unsqueeze.default": ((x, 1), {}),
        "aten.clone.default": ((x.transpose(0, 1),), {"memory_format": torch.contiguous_format}),
        "aten.detach.default": ((x,), {}),
        "aten.cat.default": (([x, y], 1), {}),
        "aten.add.Tensor": ((x, y), {"alpha": 2}),
        "aten.sub.Tensor": ((x, 1.5), {}),
        "aten.mul.Tensor": ((x, y), {}),
        "aten.div.Tensor": ((x, y), {}),
        "aten.neg.default": ((x,), {}),
        "aten.rsqrt.default": ((x.abs() + 1,), {}),
        "aten.pow.Tensor_Scalar": ((x, 2), {}),
        "aten.mean.dim": ((x, [-1], True), {}),
        "aten.sum.dim_IntList": ((x, [1]), {}),
        "aten.mm.default": ((m.t(), m), {}),
        "aten.bmm.default": ((x, y.transpose(1, 2)), {}),
        "aten.addmm.default": ((_floats(5, seed=7), _floats(3, 4, seed=8), m), {"beta": 0.5}),
        "aten.embedding.default": ((w, torch.tensor([[1, 9], [0, 3]])), {}),
        "aten.native_layer_norm.default": ((x, [4], _floats(4, seed=9), _floats(4, seed=10), 1e-5), {}),
        "aten._softmax.default": ((x, -1, False), {}),
        "aten._log_softmax.default": ((x, -1, False), {}),
        "aten.gelu.default": ((x,), {"approximate": "tanh"}),
        "aten.silu.default": ((x,), {}),
        "aten.scaled_dot_product_attention.default": ((q, k, v), {"is_causal": True}),
    }


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _leaves(v)] if isinstance(value, (tuple, list)) else []


def _mapped(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to each tensor in it (lists and tuples kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return type(value)(_mapped(v, fn) for v in value) if isinstance(value, (tuple, list)) else value


class _Dispatched(TorchDispatchMode):
    """Records the ATen overloads that run below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run_op(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """``fn``'s results and the gradients of its floating inputs under a fixed upstream
    gradient, and the ATen overloads that ran for them."""
    inputs: list[torch.Tensor] = []

    def fresh(t: torch.Tensor) -> torch.Tensor:
        inputs.append(t.clone().requires_grad_(t.is_floating_point()))
        return inputs[-1]

    args = _mapped(args, fresh)
    with _Dispatched() as seen:
        outs = [o for o in _leaves(fn(*args, **kwargs)) if o.is_floating_point()]
        grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(11)) for o in outs]
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    values = [o.detach() for o in outs] + [t.grad for t in inputs if t.is_floating_point()]
    return values, seen.ops


def test_every_bound_operator_computes_what_its_overload_computes() -> None:
    """A program's node calls some operators through torch's Python binding rather than
    the ``OpOverload`` (``program_load._BOUND``): the same ATen overloads run, forward
    and backward, with the same results and gradients, bit for bit; on the meta device
    (a peer's dry run) too."""
    cases = _bound_cases()
    assert set(cases) == set(_BOUND)  # a new entry needs its case here
    for op, (args, kwargs) in cases.items():
        overload = resolve_op(op)
        (ours, ran), (theirs, expected) = _run_op(_BOUND[op], args, kwargs), _run_op(overload, args, kwargs)
        assert ran == expected and ran, op
        assert len(ours) == len(theirs), op
        for a, b in zip(ours, theirs, strict=True):
            assert (a is None) == (b is None) and (a is None or _equal(a, b)), op
        meta = _mapped(args, lambda t: t.to("meta"))
        got, want = _leaves(_BOUND[op](*meta, **kwargs)), _leaves(overload(*meta, **kwargs))
        assert [(o.shape, o.dtype, o.stride()) for o in got] == [(o.shape, o.dtype, o.stride()) for o in want], op


def test_a_node_whose_arguments_could_pick_another_overload_calls_its_own() -> None:
    """A hostile program may give a bound operator arguments for which the binding would
    pick another overload than the one the node names: such a node calls the named one."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    other = {
        "aten.pow.Tensor_Scalar": [((x, y), {}), ((2, x), {})],  # pow.Tensor_Tensor, pow.Scalar
        "aten.view.default": [((x, torch.float16), {}), ((x, 6, 4), {})],  # view.dtype, sizes as varargs
        "aten.add.Tensor": [((x, 2, y), {}), ((2, x), {}), ((x, y), {"self": x})],  # alpha first; a number first
        "aten.sum.dim_IntList": [((x,), {}), ((x, None), {}), ((x, [1]), {"dtype": y})],  # sum.default; None
        "aten.mean.dim": [((x, ["a"]), {})],
        "aten.transpose.int": [((x, "a", "b"), {})],  # transpose.Dimname
        "aten.cat.default": [(([x, y], "a"), {}), ((x,), {})],  # cat.names; one tensor for the list
        "aten.mm.default": [((x, y, y), {}), ((x,), {"mat2": y})],
    }
    for op, forms in other.items():
        target = resolve_op(op)
        for args, kwargs in forms:
            assert _callable(op, target, args, kwargs) is target, (op, args, kwargs)
    normal = {
        "aten.pow.Tensor_Scalar": ((x, 2), {}),
        "aten.view.default": ((x, [6, 4]), {}),
        "aten.add.Tensor": ((x, y), {"alpha": 2}),
        "aten.sum.dim_IntList": ((x, [1], True), {}),
        "aten.scaled_dot_product_attention.default": ((x, y, y), {"is_causal": True}),
    }
    for op, (args, kwargs) in normal.items():
        assert _callable(op, resolve_op(op), args, kwargs) is _BOUND[op], op
