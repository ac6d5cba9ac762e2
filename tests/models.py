"""Small models and data for the tests (loaded through --model tests/models.py:NAME)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Tied(nn.Module):
    """Two layers, then one weight used twice in a row (a tied pair), then a head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.l2 = nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        h = torch.tanh(self.shared(h))
        h = F.linear(h, self.shared.weight.t())
        return F.mse_loss(self.head(h).squeeze(-1), y)


def tied() -> Tied:
    return Tied()


def tied_data(seed: int, batch_size: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, 16, generator=g)
        yield x, x.sum(dim=1).tanh()


class Untraceable(nn.Module):
    """Runs on ``tied_data`` in eager mode; torch.fx cannot trace its data-dependent branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return F.mse_loss(h.sum(dim=1), y)


def untraceable() -> Untraceable:
    return Untraceable()


def small_gpt() -> nn.Module:
    from zoo.gpt import GPT

    return GPT(n_layer=2, n_embd=32, n_head=2, block_size=32)


def small_text(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from zoo.text import stdlib_text

    return stdlib_text(seed, batch_size=8, ctx=16)


def not_a_module() -> int:
    return 3


def branchy_wide() -> nn.Module:
    """The built-in branchy model, deep enough for three stages with skips."""
    from zoo.branchy import Branchy

    return Branchy(dim=32, depth=8)


@torch.fx.wrap
def _fails_late(x: torch.Tensor) -> torch.Tensor:
    if float(x.sum()) > 10:  # data-dependent: the first batches pass, a later one fails
        raise RuntimeError("late failure in the model")
    return x


class Late(nn.Module):
    """Traceable, fine on the first batch (so ``checked_model`` passes), raises on the fourth."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(_fails_late(x))
        return ((self.b(h).squeeze(-1) - y) ** 2).mean()


def late() -> Late:
    return Late()


def late_data(seed: int, split: str = "train") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for i in itertools.count():
        yield torch.randn(8, 8, generator=gen) + (1.0 if i >= 3 else 0.0), torch.randn(8, generator=gen)
