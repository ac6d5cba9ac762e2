"""The built-in branchy model (``--model branchy``): an MLP with skip connections
across stages, and its regression data (``--data branchy``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

#: the validation split of generated data draws from this seed offset
VAL_SEED_OFFSET = 1_000_003


class Branchy(nn.Module):
    """An MLP whose first hidden value is read by every later layer and whose middle
    value skips to the end: any multi-stage cut carries values across several stages."""

    def __init__(self, dim: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)
        self.mid = depth // 2

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.inp(x))
        h = h0
        mid = h0
        for i, layer in enumerate(self.layers):
            h = torch.relu(layer(h)) + 0.5 * h0
            if i == self.mid:
                mid = h
        h = h + mid * x.mean(dim=1, keepdim=True)
        return F.mse_loss(self.out(h).squeeze(-1), y)


def branchy(**kwargs: object) -> Branchy:
    return Branchy(**kwargs)  # type: ignore[arg-type]


def branchy_data(
    seed: int, batch_size: int = 16, dim: int = 32, split: str = "train"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless regression batches ``(x, y)`` with ``y = sin(x . w)``; the ``val`` split
    draws other inputs for the same ``w``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, generator=gen)
    if split != "train":
        gen = torch.Generator().manual_seed(seed + VAL_SEED_OFFSET)
    while True:
        x = torch.randn(batch_size, dim, generator=gen)
        yield x, torch.sin(x @ w / dim**0.5)
