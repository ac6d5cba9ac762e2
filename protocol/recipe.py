"""The optimizer recipe every stage and the reference share: AdamW with decoupled
weight decay, and a learning rate that is a pure function of the step (so every
stage agrees on it without a message)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

SCHEDULES = ("constant", "linear", "cosine")


class RecipeError(ValueError):
    """A recipe that cannot train; ``str()`` is one line."""


@dataclass(frozen=True)
class RecipeFields:
    """The recipe's part of a job spec (``protocol.job.JobSpec`` has these fields too).

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
        if not _betas_ok(self.betas):
            raise RecipeError(f"betas {self.betas} are not two numbers in [0, 1)")
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


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` -> (0.9, 0.95); a one-line error otherwise."""
    parts = [p.strip() for p in text.split(",")]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        raise RecipeError(f"betas '{text}' are not two comma-separated numbers") from None
    if not _betas_ok(betas):
        raise RecipeError(f"betas '{text}' are not two numbers in [0, 1)")
    return betas  # type: ignore[return-value]


def _betas_ok(betas: tuple[float, ...]) -> bool:
    return len(betas) == 2 and all(isinstance(b, float) and 0 <= b < 1 for b in betas)


def recipe_of(spec: RecipeFields, steps: int) -> Recipe:
    """The checked recipe of a job spec (whose betas may arrive as a JSON list)."""
    values = {f.name: getattr(spec, f.name) for f in fields(RecipeFields)}
    betas = values["betas"]
    if not isinstance(betas, (tuple, list)) or not all(isinstance(b, (int, float)) for b in betas):
        raise RecipeError(f"betas {betas!r} are not two numbers")
    values["betas"] = tuple(float(b) for b in betas)
    return Recipe(**values, steps=steps)
