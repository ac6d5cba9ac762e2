"""Training in one process: the whole model (the reference) or its stages one
after another. Both see the same initial weights, batches and micro-batches."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from coordinator.opdag import balanced_cut, build_opdag
from coordinator.weights import load_init
from peer.executor import StageExecutor, make_optimizer, scale_loss, set_lr, unscale_and_norms
from protocol.model.graph import Cut, build_stage, partition, trace
from protocol.model.job import JobSpec, mean_loss, model_error, split_batch
from protocol.model.recipe import LossScale, Recipe, autocast, decide_update, in_model_order, initial_scale

Progress = Callable[[int, float], None]


@dataclass
class TrainResult:
    model: nn.Module
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation loss)
    seconds: float = 0.0
    tokens: int = 0
    cut: Cut | None = None


def _batch_items(batch: tuple[torch.Tensor, ...]) -> int:
    return batch[0].numel()


def job_model(job: JobSpec) -> nn.Module:
    """The model with the run's starting weights: seeded, or ``--init``'s."""
    model = job.build_model()
    if job.init:
        load_init(job.init, model)
    return model


def train_reference(job: JobSpec, progress: Progress | None = None) -> TrainResult:
    """Train the whole model, accumulating gradients over the micro-batches."""
    model = job_model(job)
    recipe = job.recipe()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, recipe)
    scale = initial_scale(recipe)
    result = TrainResult(model)
    start = time.perf_counter()
    for step, batch in enumerate(itertools.islice(job.batches(), job.steps)):
        total = 0.0
        for mb in split_batch(batch, job.micro_batches):
            try:
                with autocast(recipe):
                    loss = model(*mb)
                scale_loss(loss, scale, job.micro_batches).backward()
            except Exception as exc:  # the model's own code: one line with its file:line
                raise model_error(exc) from None
            total += float(loss.detach())
        scale = _reference_update(params, opt, recipe, scale, step)
        _record(result, job, step, total, _batch_items(batch), progress)
        if job.eval_due(step + 1):
            result.val_losses.append((step + 1, _evaluate_model(model, job)))
    result.seconds = time.perf_counter() - start
    return result


def _reference_update(
    params: list[nn.Parameter], opt: torch.optim.Optimizer, recipe: Recipe, scale: LossScale, step: int
) -> LossScale:
    """The whole model's update, with torch's own global clip: what the stages must match."""
    norms = unscale_and_norms([(str(i), p) for i, p in enumerate(params)], scale)
    update = decide_update(recipe, list(norms.values()), scale)  # the skip and the next loss scale
    if not update.skip:
        if recipe.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, recipe.clip_grad_norm)
        set_lr(opt, recipe, step)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return update.scale


def _record(result: TrainResult, job: JobSpec, step: int, total: float, items: int, progress: Progress | None) -> None:
    result.losses.append(total / job.micro_batches)
    result.tokens += items
    if progress:
        progress(step, result.losses[-1])


def _evaluate_model(model: nn.Module, job: JobSpec) -> float:
    recipe = job.recipe()
    model.eval()
    try:
        with torch.no_grad(), autocast(recipe):
            losses = [float(model(*mb)) for mb in job.eval_micro_batches()]
    finally:
        model.train()
    return mean_loss(losses)


def pick_cut(job: JobSpec, model: nn.Module, stages: int) -> Cut:
    dag = build_opdag(model, job.first_micro_batch())
    return balanced_cut(dag, stages)


def _executors(model: nn.Module, cut: Cut, job: JobSpec) -> list[StageExecutor]:
    part = partition(trace(model), cut)
    k = cut.num_stages
    recipe = job.recipe()
    return [StageExecutor(build_stage(part, s), recipe, s == k - 1) for s in range(k)]


def _forward(execs: list[StageExecutor], mb_index: int, mb: tuple[torch.Tensor, ...]) -> float:
    values = mb
    for ex in execs:
        values = ex.forward(mb_index, values)
    return float(values)


def _backward(execs: list[StageExecutor], mb_index: int, divisor: int) -> None:
    grads = execs[-1].backward(mb_index, None, divisor)
    for ex in reversed(execs[:-1]):
        grads = ex.backward(mb_index, grads)


def train_staged(job: JobSpec, stages: int | Cut, progress: Progress | None = None) -> TrainResult:
    """Train through the rebuilt stages of a cut, run one after another (GPipe order)."""
    model = job_model(job)
    cut = stages if isinstance(stages, Cut) else pick_cut(job, model, stages)
    execs = _executors(model, cut, job)
    recipe = job.recipe()
    result = TrainResult(model, cut=cut)
    start = time.perf_counter()
    for step, batch in enumerate(itertools.islice(job.batches(), job.steps)):
        mbs = split_batch(batch, job.micro_batches)
        total = sum(_forward(execs, i, mb) for i, mb in enumerate(mbs))
        for i in range(len(mbs)):
            _backward(execs, i, job.micro_batches)
        update = None
        if recipe.needs_norm:
            norms = {n: v for ex in execs for n, v in ex.grad_norms().items()}
            order = [n for n, _ in model.named_parameters()]
            update = decide_update(recipe, in_model_order(order, norms), execs[0].loss_scale)
        for ex in execs:
            ex.step(update)
        _record(result, job, step, total, _batch_items(batch), progress)
        if job.eval_due(step + 1):
            result.val_losses.append((step + 1, _evaluate_stages(execs, job)))
    result.seconds = time.perf_counter() - start
    return result


def _evaluate_stages(execs: list[StageExecutor], job: JobSpec) -> float:
    losses = []
    for mb in job.eval_micro_batches():
        values: Any = mb
        for ex in execs:
            values = ex.evaluate(values)
        losses.append(float(values))
    return mean_loss(losses)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / max(|a|, |b|)`` in the 2-norm (0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    return 0.0 if scale == 0.0 else float((a - b).norm()) / scale


def check_stages(job: JobSpec, cut: Cut) -> dict[str, float]:
    """Loss and parameter gradients of one batch: whole model vs the stages of ``cut``."""
    batch = next(iter(job.batches()))
    mbs = split_batch(batch, job.micro_batches)
    ref = job_model(job)
    recipe = job.recipe()
    ref_loss = 0.0
    for mb in mbs:
        with autocast(recipe):
            loss = ref(*mb)
        scale_loss(loss, initial_scale(recipe), len(mbs)).backward()
        ref_loss += float(loss.detach()) / len(mbs)
    staged = job_model(job)
    execs = _executors(staged, cut, job)
    st_loss = 0.0
    for i, mb in enumerate(mbs):
        st_loss += _forward(execs, i, mb) / len(mbs)
        _backward(execs, i, len(mbs))
    ref_params = dict(ref.named_parameters())
    grad_err = 0.0
    for name, p in staged.named_parameters():
        g_ref, g = ref_params[name].grad, p.grad
        if g_ref is None and g is None:
            continue
        if g_ref is None or g is None:
            return {"loss": math.inf, "grad": math.inf, "max": math.inf}
        grad_err = max(grad_err, relative_error(g, g_ref))
    loss_err = relative_error(torch.tensor(st_loss), torch.tensor(ref_loss))
    return {"loss": loss_err, "grad": grad_err, "max": max(loss_err, grad_err)}


def save_state(model: nn.Module, path: str | Path) -> None:
    """Write the model's state_dict (original names) as safetensors."""
    state = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))


def compare_checkpoints(a: str | Path, b: str | Path) -> float:
    """Largest relative error between two checkpoints' tensors (inf if keys differ)."""
    return state_error(load_file(str(a)), load_file(str(b)))


def state_error(sa: dict[str, torch.Tensor], sb: dict[str, torch.Tensor]) -> float:
    """Largest relative error between two states' tensors (inf if names or shapes differ)."""
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return math.inf
    return max((relative_error(sa[k].float(), sb[k].float()) for k in sa), default=0.0)


def validation_loss(job: JobSpec, checkpoint: str | Path, batches: int = 20) -> float:
    """Mean loss of the model in ``checkpoint`` on the first ``batches`` batches of
    the data's validation split (the same batches for every checkpoint)."""
    model = job.build_model()
    model.load_state_dict(load_file(str(checkpoint)))
    model.eval()
    total = 0.0
    with torch.no_grad():
        for batch in itertools.islice(job.batches("val"), batches):
            total += float(model(*batch))
    return total / batches
