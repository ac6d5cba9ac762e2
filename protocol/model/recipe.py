"""The optimizer recipe every stage and the reference share: AdamW with decoupled
weight decay, a learning rate that is a pure function of the step (so every
stage agrees on it without a message), global gradient-norm clipping, and mixed
precision with (fp16) a dynamic loss scale.

The step's update is decided from every parameter's gradient norm
(:func:`decide_update`): the one formula the reference, the stages in one
process and the swarm's coordinator use."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from protocol.model.options import PRECISIONS, SCHEDULES, RecipeError, betas_ok

#: torch's clip_grad_norm_ adds this to the norm before dividing
CLIP_EPS = 1e-6
#: fp16 loss scale: torch.amp.GradScaler's defaults
LOSS_SCALE_INIT = 2.0**16
LOSS_SCALE_GROWTH = 2.0
LOSS_SCALE_BACKOFF = 0.5
LOSS_SCALE_INTERVAL = 2000
#: the scale backs off no lower (forged overflows must not drive it to 0)
LOSS_SCALE_MIN = 1.0


@dataclass(frozen=True)
class RecipeFields:
    """The recipe's part of a job spec (``protocol.model.job.JobSpec`` has these fields too).

    ``lr`` is the peak rate: reached after ``warmup`` steps (linear from lr/warmup),
    then held (``constant``) or brought down to ``min_lr`` at the last step
    (``linear``, ``cosine``). ``weight_decay`` is decoupled (AdamW) and skips
    parameters of fewer than 2 dimensions (biases, norms) unless ``decay_all``."""

    lr: float = 3e-3
    lr_schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    decay_all: bool = False
    clip_grad_norm: float = 0.0  # 0: no clipping
    precision: str = "fp32"


@dataclass(frozen=True)
class Recipe(RecipeFields):
    """A checked recipe for a run of ``steps`` steps."""

    steps: int = 1

    def __post_init__(self) -> None:
        if self.lr_schedule not in SCHEDULES:
            raise RecipeError(f"lr schedule '{self.lr_schedule}': choose from {', '.join(SCHEDULES)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise RecipeError(f"learning rate {self.lr} is not a positive, finite number")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise RecipeError(f"min lr {self.min_lr} is not between 0 and the learning rate {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise RecipeError(f"weight decay {self.weight_decay} is not a non-negative, finite number")
        if not betas_ok(self.betas):
            raise RecipeError(f"betas {self.betas} are not two numbers in [0, 1)")
        if not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            raise RecipeError(f"gradient-norm clip {self.clip_grad_norm} is not a non-negative, finite number")
        if self.precision not in PRECISIONS:
            raise RecipeError(f"precision '{self.precision}': choose from {', '.join(PRECISIONS)}")
        if self.warmup < 0 or self.steps < 1:
            raise RecipeError(f"warmup {self.warmup} and steps {self.steps} must be at least 0 and 1")

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that ends step ``step`` (0-based)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.lr_schedule == "constant":
            return self.lr
        span = max(self.steps - 1 - self.warmup, 1)
        done = min(max(step - self.warmup, 0) / span, 1.0)
        if self.lr_schedule == "linear":
            return self.lr + (self.min_lr - self.lr) * done
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * done))

    def decays(self, ndim: int) -> bool:
        return self.weight_decay > 0 and (self.decay_all or ndim >= 2)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16 only: bf16 has fp32's range)."""
        return self.precision == "fp16"

    @property
    def needs_norm(self) -> bool:
        """Whether a step's update waits for the global gradient norm."""
        return self.clip_grad_norm > 0 or self.scales_loss


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale: halved after a step with non-finite gradients (which
    is skipped), doubled after ``LOSS_SCALE_INTERVAL`` good steps in a row."""

    scale: float = LOSS_SCALE_INIT
    good: int = 0

    def after(self, found_inf: bool) -> LossScale:
        if found_inf:
            return LossScale(max(self.scale * LOSS_SCALE_BACKOFF, LOSS_SCALE_MIN), 0)
        if self.good + 1 >= LOSS_SCALE_INTERVAL:
            return LossScale(self.scale * LOSS_SCALE_GROWTH, 0)
        return LossScale(self.scale, self.good + 1)


#: the loss scale of a run that does not scale its loss
NO_SCALE = LossScale(1.0, 0)


@dataclass(frozen=True)
class Update:
    """How every stage ends a step: multiply the (unscaled) gradients by ``factor`` and
    step, or ``skip`` the update; ``scale`` is the next step's loss scale."""

    factor: float = 1.0
    skip: bool = False
    scale: LossScale = NO_SCALE


#: autocast dtype of each precision (fp32: none)
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(recipe: Recipe, device: torch.device | str = "cpu") -> Iterator[None]:
    """The recipe's mixed precision for a forward pass (weights stay fp32)."""
    dtype = AUTOCAST_DTYPES[recipe.precision]
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


def initial_scale(recipe: Recipe) -> LossScale:
    return LossScale() if recipe.scales_loss else NO_SCALE


def recipe_of(spec: RecipeFields, steps: int) -> Recipe:
    """The checked recipe of a job spec (whose betas may arrive as a JSON list)."""
    values = {f.name: getattr(spec, f.name) for f in fields(RecipeFields)}
    betas = values["betas"]
    if not isinstance(betas, (tuple, list)) or not all(isinstance(b, (int, float)) for b in betas):
        raise RecipeError(f"betas {betas!r} are not two numbers")
    values["betas"] = tuple(float(b) for b in betas)
    return Recipe(**values, steps=steps)


def decide_update(recipe: Recipe, norms: list[float], scale: LossScale) -> Update:
    """The step's update from the 2-norms of every parameter's unscaled gradient (fp32
    values, in the whole model's parameter order, replicas counted once): the global
    norm and clip coefficient are computed as ``torch.nn.utils.clip_grad_norm_``
    computes them, bit for bit. fp16 skips a step whose norm is not finite."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32)) if norms else torch.tensor(0.0)
    found_inf = not bool(torch.isfinite(total))
    if recipe.scales_loss and found_inf:
        return Update(1.0, True, scale.after(True))
    factor = 1.0
    if recipe.clip_grad_norm > 0:
        coef = recipe.clip_grad_norm / (total + CLIP_EPS)
        factor = float(torch.clamp(coef, max=1.0))
    return Update(factor, False, scale.after(False) if recipe.scales_loss else scale)


def in_model_order(names: list[str], norms: dict[str, float]) -> list[float]:
    """The gradient norms of the parameters that have one, in the whole model's order
    (``names``: its ``named_parameters``), as ``clip_grad_norm_`` stacks them."""
    return [norms[n] for n in names if n in norms]
