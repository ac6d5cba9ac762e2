"""Built-in workloads traced on the meta device, attention FLOPs by formula, activation
memory without views, and ``plan``/``sim`` with a workload and its batch flags."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coordinator.estimator import DagCosts
from coordinator.opdag import build_opdag
from coordinator.plan_options import TOKENS_PER_ITERATION
from coordinator.workloads import (
    WORKLOADS,
    WorkloadError,
    meta_batch,
    meta_model,
    parameter_count,
    workload_costs,
    workload_dag,
)
from fusionllm.cli import build_parser
from fusionllm.plan_cmds import _costs, batch_of
from fusionllm.usage import UsageError
from zoo.gpt import GPT

#: published parameter counts (tied embeddings counted once)
PARAMETERS = {"gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "llama-7b": 6_738_415_616}
#: a generous bound on one trace: a model that materialised its weights would take far longer
MAX_TRACE_S = 60.0


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_traces_on_meta_with_published_size(name: str) -> None:
    w = WORKLOADS[name]
    start = time.perf_counter()
    dag = workload_dag(name, w.batch_size, w.context, "bf16")
    seconds = time.perf_counter() - start
    costs = DagCosts.from_opdag(dag)
    params = parameter_count(dag)
    tokens = w.batch_size * w.context
    print(
        f"{name}: {params:,} parameters, {dag.num_ops} ops, traced in {seconds:.2f} s; per micro-batch of "
        f"{tokens} tokens: {dag.total_flops / 1e12:.2f} TFLOP, {sum(costs.act_bytes) / 1e9:.2f} GB kept"
    )
    assert params == PARAMETERS[name]
    assert all(p.is_meta for p in dag.gm.parameters()), "no weights are materialised"
    assert sum(costs.param_bytes) == 4 * params, "parameters count as fp32 master weights"
    # matmuls are 2 FLOPs per parameter and token; attention and elementwise ops add a little
    assert 1.0 < dag.total_flops / (2 * params * tokens) < 1.25
    assert w.micro_batches * tokens == TOKENS_PER_ITERATION
    assert seconds < MAX_TRACE_S


def test_precision_sets_activation_bytes_not_parameter_bytes() -> None:
    full = workload_costs("gpt2", 2, 128, "fp32", {"n_layer": 2})
    half = workload_costs("gpt2", 2, 128, "bf16", {"n_layer": 2})
    assert full.param_bytes == half.param_bytes
    assert sum(half.act_bytes) * 2 == pytest.approx(sum(full.act_bytes), rel=0.01)
    assert sum(half.float_cross) * 2 == pytest.approx(sum(full.float_cross), rel=0.01)


def test_workload_refusals_are_one_line() -> None:
    with pytest.raises(WorkloadError, match="at most 1024 tokens"):
        meta_batch("gpt2", 1, 1025)
    with pytest.raises(WorkloadError, match="no built-in workload 'gpt3'"):
        meta_model("gpt3")
    with pytest.raises(WorkloadError, match="llama-7b cannot take"):
        meta_model("llama-7b", shape={"n_layers": 2})
    with pytest.raises(WorkloadError, match="precision 'fp8'"):
        meta_model("gpt2", "fp8")
    with pytest.raises(
        WorkloadError,
        match="gpt2 cannot take {'n_layer': 1, 'n_head': 7}: ValueError: n_embd 768 is not a multiple of n_head 7",
    ):
        workload_dag("gpt2", 1, 16, shape={"n_layer": 1, "n_head": 7})
    assert meta_batch("gpt2", 1, 2048, {"block_size": 2048})[0].shape == (1, 2048), "a changed context counts"


def _tiny_gpt() -> GPT:
    return GPT(n_layer=1, n_embd=32, n_head=4, block_size=16, vocab_size=64)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_attention_flops_by_formula(device: str) -> None:
    B, T, H, hs = 2, 16, 4, 8
    with torch.device(device):
        model = _tiny_gpt()
        ids = torch.zeros((B, T), dtype=torch.long)
    dag = build_opdag(model, (ids, ids))
    attention = [o for o in dag.ops if o.target == "scaled_dot_product_attention"]
    # Q K^T and (.) V: 2 FLOPs per multiply-add, the full T x T matrix (no causal discount)
    assert [o.flops for o in attention] == [4 * B * H * T * T * hs]


class Viewy(nn.Module):
    """Views of every kind between two real computations."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.w)  # new memory
        t = h.view(4, 2, 4).transpose(1, 2)  # views
        c = t.contiguous()  # a copy: t is not contiguous
        same = h.contiguous()  # h already is: no copy
        a, b = h.split(4, dim=1)  # views, read through getitem
        flat = h.unsqueeze(0).squeeze(0).flatten().reshape(4, 8).permute(1, 0).expand(2, 8, 4)
        return F.relu(c).sum() + (a * b).sum() + same.sum() + flat.sum()


def test_views_take_no_activation_memory() -> None:
    dag = build_opdag(Viewy(), (torch.randn(4, 8),))
    saved = {o.target: o.saved_bytes for o in dag.ops}
    out = {o.target: o.out_bytes for o in dag.ops}
    for view in ("view", "transpose", "split", "getitem", "unsqueeze", "squeeze", "flatten", "reshape", "permute"):
        assert saved[view] == 0, view
    assert saved["expand"] == 0 and out["expand"] == 2 * 4 * 32
    assert saved["matmul"] == out["matmul"] == 4 * 8 * 4, "a matmul's output is new memory"
    contiguous = [o.saved_bytes for o in dag.ops if o.target == "contiguous"]
    assert contiguous == [4 * 8 * 4, 0], "contiguous copies a transposed tensor, not a contiguous one"
    costs = DagCosts.from_opdag(dag)
    assert 0 < sum(costs.act_bytes) < sum(o.out_bytes for o in dag.ops)


def test_gpt_views_and_getitems_are_free_its_linears_are_not() -> None:
    dag = build_opdag(_tiny_gpt(), (torch.zeros((2, 16), dtype=torch.long),) * 2)
    for o in dag.ops:
        if o.target in ("split", "getitem", "view", "transpose", "getattr"):
            assert o.saved_bytes == 0, o
        if o.name.endswith("c_attn"):
            assert o.saved_bytes == o.out_bytes == 2 * 16 * 96 * 4, o


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", "--topology", "testbed1", *argv])


def test_batch_defaults_and_flags() -> None:
    for name, w in WORKLOADS.items():
        b = batch_of(_args("--model", name))
        assert (b.micro_batches, b.batch_size, b.seq_len) == (w.micro_batches, w.batch_size, w.context)
        assert b.precision == "bf16" and b.tokens == TOKENS_PER_ITERATION
    b = batch_of(_args("--model", "llama-7b", "--micro-batches", "8", "--batch-size", "2", "--seq-len", "512"))
    assert (b.micro_batches, b.batch_size, b.seq_len, b.tokens) == (8, 2, 512, 8192)
    b = batch_of(_args("--model", "gpt"))
    assert (b.workload, b.micro_batches, b.precision) == (None, 4, "fp32"), "other models: as before"
    with pytest.raises(UsageError, match="--seq-len applies to the built-in workloads"):
        batch_of(_args("--model", "gpt", "--seq-len", "64"))
    with pytest.raises(UsageError, match="gpt2 takes sequences of at most 1024 tokens, not 2048"):
        _costs(_args("--model", "gpt2", "--seq-len", "2048"))


def test_plan_each_workload_on_a_preset(cli) -> None:
    r = cli("plan", "--model", "llama-7b", "--topology", "testbed3")
    assert r.returncode == 0, r.stderr
    assert "llama-7b: 6.74B parameters" in r.stdout and "262,144 tokens per iteration" in r.stdout
    assert "opfence:" in r.stdout and "stage 1:" in r.stdout, "7B on 24 GB GPUs takes several stages"
    assert "DOES NOT FIT" not in r.stdout
    r = cli("plan", "--model", "gpt2", "--topology", "testbed3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["workload"]["parameters"] == PARAMETERS["gpt2"] and out["fits_memory"]
    # GPT-2 XL's tied embeddings keep it in one stage: only an 80 GB A100 holds it
    r = cli("plan", "--model", "gpt2-xl", "--topology", "testbed1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["workload"]["tokens_per_iteration"] == TOKENS_PER_ITERATION and out["fits_memory"]


def test_sim_workload_and_scheduler_choices(cli) -> None:
    sim_args = ["--schedulers", "even,opfence,even", "--iterations", "2", "--micro-batches", "8", "--json"]
    r = cli("sim", "--model", "llama-7b", "--model-args", "n_layer=2", "--topology", "testbed1", *sim_args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out["schedulers"]) == ["even", "opfence"] and out["workload"]["micro_batches"] == 8
    r = cli("plan", "--help")
    assert "--batch-size B" in r.stdout and "--seq-len S" in r.stdout and "llama-7b 128 x 1 x 2048" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["sim", "--schedulers", "opfence,nope"], "unknown 'nope'; choose from opfence"),
        (["plan", "--scheduler", "nope"], "invalid choice: 'nope'"),
        (["plan", "--model", "gpt2", "--seq-len", "4096"], "gpt2 takes sequences of at most 1024 tokens"),
        (["plan", "--model", "llama-7b", "--batch-size", "0"], "0 must be at least 1"),
        (["plan", "--model", "gpt", "--batch-size", "4"], "--batch-size applies to the built-in workloads"),
        (["plan", "--model", "llama-7b", "--model-args", "depth=2"], "llama-7b cannot take {'depth': 2}"),
    ],
)
def test_plan_and_sim_usage_errors_are_one_line(cli, args: list[str], needle: str) -> None:
    r = cli(*args, "--topology", "testbed1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
