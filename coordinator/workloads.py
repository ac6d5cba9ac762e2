"""Built-in workloads for planning: published model shapes (GPT-2 small, GPT-2 XL,
LLaMA-7B) built on the meta device and traced into an OP-DAG with costs, without
weights, in seconds and little memory. Their names, summaries and default batches
(the batch a realistic iteration uses) are ``plan_options``'s, which needs no torch.

Precision, as the swarm trains with ``--precision``: weights, gradients and Adam's
two moments stay fp32 (parameter bytes are 4 per parameter; the estimator adds the
rest, 16 bytes per parameter in all); activations and the tensors crossing cuts
are fp32, or bf16/fp16 under mixed precision (the model is traced in that dtype).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from coordinator.estimator import DagCosts
from coordinator.opdag import OpDag, build_opdag
from coordinator.plan_options import WORKLOADS, Workload
from protocol.model.graph import operators
from protocol.model.options import PRECISIONS
from zoo.gpt import gpt2
from zoo.llama import Llama

GPT2_VOCAB = 50257
#: the dtype activations have under each ``--precision`` (``PRECISIONS``, in order)
ACTIVATION_DTYPES = dict(zip(PRECISIONS, (torch.float32, torch.bfloat16, torch.float16), strict=True))
#: weights, gradients and optimizer state stay fp32 under every precision
MASTER_DTYPE = torch.float32


class WorkloadError(ValueError):
    """An unknown workload or a batch it cannot take; ``str()`` is one line."""


def _gpt2(**shape: Any) -> nn.Module:
    """The demo's GPT (``zoo.gpt``) in GPT-2's published shape: biases, tanh GELU,
    a 50,257-token vocabulary, context 1024, tied embeddings; ``shape`` overrides."""
    return gpt2(vocab_size=GPT2_VOCAB, tie_weights=True, **shape)


#: each workload's model (``plan_options.WORKLOADS``) on the current default device;
#: keywords change the shape
BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "gpt2": _gpt2,
    "gpt2-xl": functools.partial(_gpt2, n_layer=48, n_embd=1600, n_head=25),
    "llama-7b": Llama,
}


def workload(name: str) -> Workload:
    """The built-in workload called ``name`` (:class:`WorkloadError` if none is)."""
    if name not in WORKLOADS:
        raise WorkloadError(f"no built-in workload '{name}' (known: {', '.join(WORKLOADS)})")
    return WORKLOADS[name]


def meta_model(name: str, precision: str = "fp32", shape: dict[str, Any] | None = None) -> nn.Module:
    """The workload's model on the meta device (shapes only, no memory for weights), in
    the activation dtype of ``precision``; ``shape`` overrides the model's keyword
    arguments (e.g. ``n_layer``)."""
    w = workload(name)
    if precision not in ACTIVATION_DTYPES:
        raise WorkloadError(f"precision '{precision}': choose from {', '.join(ACTIVATION_DTYPES)}")
    try:
        with torch.device("meta"):
            model = BUILDERS[w.name](**(shape or {}))
    except Exception as exc:  # an unknown keyword, or a value the model cannot take
        raise WorkloadError(f"{name} cannot take {shape}: {_first_line(exc)}") from None
    return model.to(ACTIVATION_DTYPES[precision])


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def meta_batch(
    name: str, batch_size: int, seq_len: int, shape: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of token ids and targets, ``batch_size x seq_len``, on the meta device
    (``shape``: the model's changes, which may change its context)."""
    context = workload(name).context_of(shape)
    if batch_size < 1 or seq_len < 1:
        raise WorkloadError(f"a micro-batch needs at least 1 sequence of 1 token, not {batch_size} x {seq_len}")
    if seq_len > context:
        raise WorkloadError(f"{name} takes sequences of at most {context} tokens, not {seq_len}")
    ids = torch.empty((batch_size, seq_len), dtype=torch.long, device="meta")
    return ids, torch.empty_like(ids)


def workload_dag(
    name: str, micro_batch_size: int, seq_len: int, precision: str = "fp32", shape: dict[str, Any] | None = None
) -> OpDag:
    """The workload's OP-DAG, measured on one meta micro-batch (see :func:`meta_model`)."""
    example = meta_batch(name, micro_batch_size, seq_len, shape)
    model = meta_model(name, precision, shape)
    try:
        return build_opdag(model, example, param_dtype=MASTER_DTYPE)
    except (RuntimeError, ValueError, IndexError) as exc:  # e.g. a width that the heads do not divide
        raise WorkloadError(f"{name} with {shape or 'its shape'} fails: {_first_line(exc)}") from None


def workload_costs(
    name: str, micro_batch_size: int, seq_len: int, precision: str = "fp32", shape: dict[str, Any] | None = None
) -> DagCosts:
    """Per-op costs of one micro-batch of ``micro_batch_size`` sequences of ``seq_len``
    tokens under ``precision`` (see the module), for the estimator and the schedulers.
    Tied weights (GPT-2's embedding and head) may sit in two stages, each keeping a
    copy, as Megatron-style pipelines do (``DagCosts.tied``): the live swarm keeps them
    in one stage, which would leave GPT-2 a single stage."""
    dag = workload_dag(name, micro_batch_size, seq_len, precision, shape)
    return dataclasses.replace(DagCosts.from_opdag(dag), forbidden=frozenset(), tied=tied_weights(dag))


def tied_weights(dag: OpDag) -> tuple[tuple[int, int, int], ...]:
    """(first op, last op, bytes) of every parameter that more than one op uses."""
    users: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, node in enumerate(operators(dag.gm)):
        found = list(dag.gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                obj = dag.gm.get_parameter(str(a.target)) if _is_parameter(dag.gm, str(a.target)) else None
                found += [obj] if obj is not None else []
        for p in found:
            params[id(p)] = p
            if i not in users.setdefault(id(p), []):
                users[id(p)].append(i)
    return tuple(
        (min(ops), max(ops), params[k].numel() * MASTER_DTYPE.itemsize) for k, ops in users.items() if len(ops) > 1
    )


def _is_parameter(gm: torch.fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def parameter_count(dag: OpDag) -> int:
    """Parameters of a traced model (tied weights once)."""
    return sum(p.numel() for p in dag.gm.parameters())
