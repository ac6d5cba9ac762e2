"""A model with its own operator (``fusiontest::scaled``, registered with
``torch.library`` when this file is imported): its stage programs call an operator
outside ``aten``, which a peer runs only after opting in to this file's code and to
the operator's namespace."""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("fusiontest::scaled", mutates_args=())
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad * ctx.factor, None  # type: ignore[attr-defined]


def _setup(ctx: object, inputs: tuple[torch.Tensor, float], output: torch.Tensor) -> None:
    ctx.factor = inputs[1]  # type: ignore[attr-defined]


scaled.register_autograd(_backward, setup_context=_setup)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.ops.fusiontest.scaled(self.a(x), 0.5)
        return ((self.b(h).squeeze(-1) - y) ** 2).mean()


def build() -> Scaled:
    return Scaled()


def data(seed: int, split: str = "train") -> object:
    gen = torch.Generator().manual_seed(seed + (1 if split == "val" else 0))
    while True:
        yield torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen)
