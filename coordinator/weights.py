"""Starting weights (``--init``): a safetensors file holding the model's whole state
dict, by the model's own names or, for the built-in GPT, in GPT-2's published
layout (``h.N.attn.c_attn.weight`` and so on, Conv1D weights stored transposed; the
one table of names is ``coordinator.gpt2_layout``'s, which ``fusionllm export`` writes
with), loaded strictly: every problem is refused in one line, nothing half-loaded."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from coordinator.gpt2_layout import from_gpt2, is_gpt2_layout
from protocol.model.job import SpecError
from protocol.model.statecheck import Problems


class InitError(SpecError):
    """Starting weights that do not fit the model; ``str()`` is one line."""


def read_init(path: str | Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict from ``path``, checked against ``model`` (every tensor
    present, none extra, same shapes, floating where the model's are, finite), in
    the model's dtypes."""
    label = f"--init {path}"
    return fit_state(read_state(path, label), model, label)


def fit_state(raw: dict[str, torch.Tensor], model: nn.Module, label: str) -> dict[str, torch.Tensor]:
    """``raw`` (our names or GPT-2's layout) as ``model``'s state dict, checked as
    :func:`read_init` says; ``label`` starts the one-line ``InitError``."""
    if is_gpt2_layout(list(raw)):
        raw = from_gpt2(raw)
    want = model.state_dict()
    problems = Problems()
    problems.add("missing", [k for k in want if k not in raw])
    problems.add("unexpected", [k for k in raw if k not in want])
    for k, t in raw.items():
        if k in want:
            _check(problems, k, t, want[k])
    if problems:
        raise InitError(f"{label}: {problems}")
    return {k: raw[k].to(want[k].dtype).contiguous() for k in want}


def load_init(path: str | Path, model: nn.Module) -> None:
    """Load the checked starting weights of ``path`` into ``model``."""
    state = read_init(path, model)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def read_state(path: str | Path, label: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``; ``label`` starts the one-line
    ``InitError`` for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise InitError(f"{label}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InitError(f"{label}: not a readable safetensors file ({first})") from None


def _check(problems: Problems, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        problems.check(name, got, want)
    elif got.is_floating_point() != want.is_floating_point():
        problems.add("mis-typed", [f"{name} {got.dtype} (want {want.dtype})"])
    elif got.is_floating_point() and not bool(torch.isfinite(got).all()):
        problems.add("non-finite", [name])
