"""The pipelining anchor's stage wrapper (``benchmarks/_pipelining.py``): integer
boundary values cross a cut as floating carriers, exactly, and where pipelining asks
them for gradients (torch 2.11 asks every received value) each gets one, zeros,
while no value the stages compute changes. Runs the stages in one process, as
torch 2.11's pipelining would drive them, on whatever torch is installed."""

from __future__ import annotations

import torch

from benchmarks._pipelining import CARRIER, TensorsOnly, stage_shapes
from fusionllm.local import job_model
from protocol.model.graph import Cut, stage_modules
from protocol.model.job import JobSpec, split_batch

CUT = (34, 61, 110)  # a cut the swarm's planner picked for the default job


def _stages() -> tuple[JobSpec, list[torch.nn.Module]]:
    job = JobSpec(steps=1)
    torch.manual_seed(0)
    return job, stage_modules(job_model(job), Cut(CUT))[1]


def test_integer_boundary_values_cross_as_carriers_and_get_zero_gradients() -> None:
    job, modules = _stages()
    values = split_batch(next(iter(job.batches())), job.micro_batches)[0]
    plain = values  # the stages as the swarm runs them, without the wrapper
    for rank, module in enumerate(modules):
        shapes = stage_shapes(modules, rank, job)
        wrapped = TensorsOnly(module, shapes.ints, shapes.carried)
        # as torch 2.11 receives them: every received value a leaf that needs a gradient
        received = [
            v.detach().to(CARRIER) if i in shapes.carried else v.detach()
            for i, v in enumerate(x for x in plain if isinstance(x, torch.Tensor))
        ]
        if rank:
            assert shapes.carried and all(not t.requires_grad for t in shapes.inputs if t.dtype == CARRIER)
            received = [t.requires_grad_(True) for t in received]
        out = wrapped(*received)
        raw = module(*plain)
        raw_tensors = [v for v in raw if isinstance(v, torch.Tensor)] if isinstance(raw, tuple) else [raw]
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o.is_floating_point() for o in outs)
        for o, r in zip(outs, raw_tensors, strict=True):
            assert torch.equal(o.detach().to(r.dtype), r.detach()), rank  # bit for bit
        if rank:
            grads = torch.autograd.grad(
                [o for o in outs if o.requires_grad],
                received,
                [torch.ones_like(o) for o in outs if o.requires_grad],
            )
            for i, g in enumerate(grads):
                assert g is not None, (rank, i)
                if i in shapes.carried:
                    assert g.dtype == CARRIER and not g.any(), (rank, i)
        plain = raw


def test_carriers_that_need_no_gradient_are_left_untied() -> None:
    job, modules = _stages()
    shapes = stage_shapes(modules, len(modules) - 1, job)
    loss = TensorsOnly(modules[-1], shapes.ints, shapes.carried)(*shapes.inputs)
    # the loss's graph reaches the hidden state alone: the carrier (the targets) is not in it
    (g,) = torch.autograd.grad(loss, [shapes.inputs[1]])
    assert g is not None
    assert loss.grad_fn is not None and "Add" not in type(loss.grad_fn).__name__
