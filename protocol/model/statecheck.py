"""One-line reports of tensors that do not fit a model's state (missing, unexpected,
mis-shaped, mis-typed, non-finite), shared by the stage executor and the loader
of starting weights."""

from __future__ import annotations

import torch

#: How many names a state-mismatch message lists per kind of problem.
_MAX_NAMES = 3


class Problems:
    """Collects state mismatches per kind and renders them as one line."""

    def __init__(self) -> None:
        self.kinds: dict[str, list[str]] = {}

    def add(self, kind: str, names: list[str]) -> None:
        if names:
            self.kinds.setdefault(kind, []).extend(names)

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape:
            self.add("mis-shaped", [f"{name} {list(got.shape)} (want {list(want.shape)})"])
        elif got.dtype != want.dtype:
            self.add("mis-typed", [f"{name} {got.dtype} (want {want.dtype})"])

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def __str__(self) -> str:
        parts = []
        for kind, names in self.kinds.items():
            more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
            parts.append(f"{kind} {', '.join(names[:_MAX_NAMES])}{more}")
        return "; ".join(parts)
