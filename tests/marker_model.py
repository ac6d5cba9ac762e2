"""A user model that records every process importing it (for the test that a peer
imports no model code it did not opt in to): each import appends its PID to the file
named by ``FUSIONLLM_IMPORT_MARKER``."""

from __future__ import annotations

import os

import torch
from torch import nn

from zoo.gpt import gpt

_MARKER = os.environ.get("FUSIONLLM_IMPORT_MARKER")
if _MARKER:
    with open(_MARKER, "a") as f:
        f.write(f"{os.getpid()}\n")


def build(**kwargs: object) -> nn.Module:
    return gpt(**kwargs)


@torch.fx.wrap
def _checked(x: torch.Tensor) -> torch.Tensor:
    if float(x.float().sum()) != float(x.float().sum()):  # data-dependent Python: no program of ATen operators
        raise ValueError("not a number")
    return x


class Checked(nn.Module):
    """The GPT behind a data-dependent check: its stages cannot be sent as programs."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.gpt = gpt(**kwargs)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt(_checked(idx), targets)


def build_checked(**kwargs: object) -> nn.Module:
    return Checked(**kwargs)
