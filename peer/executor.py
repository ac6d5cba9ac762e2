"""The stage executor: forward and backward of one stage's sub-graph per
micro-batch, and its optimizer. Transport-free, so one process can chain
executors and a peer can drive one from the network."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def make_optimizer(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer every stage and the reference use: AdamW, no weight decay.

    Per-parameter (``foreach=False``) so that a stage's optimizer does exactly what
    the whole model's would do to the same parameters.
    """
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


def _as_leaf(x: Any) -> Any:
    """A value as a fresh autograd leaf (tensors inside tuples and lists too)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(True) if x.is_floating_point() else x
    if type(x) in (tuple, list):
        return type(x)(_as_leaf(v) for v in x)
    return x


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if type(x) in (tuple, list):
        return type(x)(_detached(v) for v in x)
    return x


def _grad_of(x: Any) -> Any:
    """The gradient of a value: a tensor, a tuple of them, or None."""
    if isinstance(x, torch.Tensor):
        return x.grad if x.requires_grad else None
    if type(x) in (tuple, list):
        grads = tuple(_grad_of(v) for v in x)
        return grads if any(g is not None for g in grads) else None
    return None


def _pairs(out: Any, grad: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output tensor, its gradient) pairs of two values of the same structure."""
    if grad is None:
        return []
    if isinstance(out, torch.Tensor):
        if not isinstance(grad, torch.Tensor):
            raise ValueError(f"gradient of a tensor output is {type(grad).__name__}")
        return [(out, grad)] if out.requires_grad else []
    if type(out) in (tuple, list) and isinstance(grad, (tuple, list)) and len(grad) == len(out):
        return [p for o, g in zip(out, grad, strict=True) for p in _pairs(o, g)]
    raise ValueError(f"gradient structure does not match the output ({type(out).__name__})")


class StageExecutor:
    """Runs one stage. ``forward`` keeps what backward needs per micro-batch;
    ``backward`` frees it and returns the gradients of the stage's inputs."""

    def __init__(self, module: nn.Module, lr: float, is_last: bool) -> None:
        self.module = module
        self.is_last = is_last
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(params, lr) if params else None
        self._saved: dict[int, tuple[list[Any], Any]] = {}

    @property
    def pending(self) -> int:
        """Micro-batches whose forward ran and whose backward has not."""
        return len(self._saved)

    def forward(self, mb: int, inputs: Sequence[Any]) -> Any:
        """Run the stage on ``inputs``; returns the output tuple (or the loss, last stage)."""
        if mb in self._saved:
            raise ValueError(f"micro-batch {mb} already ran forward on this stage")
        # Values may be tensors or (nested) tuples of them, e.g. the result of split().
        leaves = [_as_leaf(x) for x in inputs]
        with torch.enable_grad():
            out = self.module(*leaves)
        self._saved[mb] = (leaves, out)
        if self.is_last:
            return out.detach()
        return tuple(_detached(o) for o in out)

    def backward(
        self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None, loss_divisor: int = 1
    ) -> list[torch.Tensor | None]:
        """Back-propagate micro-batch ``mb``: the last stage from its loss divided by
        ``loss_divisor``; others from ``grad_outputs``. Returns the inputs' gradients."""
        if mb not in self._saved:
            raise ValueError(f"micro-batch {mb} has no saved forward on this stage")
        leaves, out = self._saved.pop(mb)
        if self.is_last:
            torch.autograd.backward([out / loss_divisor])
        else:
            assert grad_outputs is not None
            if len(grad_outputs) != len(out):
                raise ValueError(f"expected {len(out)} output gradients, got {len(grad_outputs)}")
            pairs = _pairs(tuple(out), tuple(grad_outputs))
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [_grad_of(x) for x in leaves]

    def step(self) -> None:
        """Apply the optimizer to the accumulated gradients and clear them."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
