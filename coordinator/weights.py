"""Starting weights (``--init``): a safetensors file holding the model's whole state
dict, by the model's own names or, for the built-in GPT, in GPT-2's published
layout (``h.N.attn.c_attn.weight`` and so on, Conv1D weights stored transposed),
loaded strictly: every problem is refused in one line, nothing half-loaded."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from protocol.model.job import SpecError
from protocol.model.statecheck import Problems

#: GPT-2 tensor names (after an optional ``transformer.`` prefix) -> ours, and whether
#: the tensor is a Conv1D weight (stored as input x output: transposed for nn.Linear)
_GPT2_NAMES: list[tuple[re.Pattern[str], str, bool]] = [
    (re.compile(r"(wte|wpe|ln_f)\.(weight|bias)"), r"\1.\2", False),
    (re.compile(r"h\.(\d+)\.(ln_1|ln_2)\.(weight|bias)"), r"blocks.\1.\2.\3", False),
    (re.compile(r"h\.(\d+)\.attn\.(c_attn|c_proj)\.weight"), r"blocks.\1.attn.\2.weight", True),
    (re.compile(r"h\.(\d+)\.attn\.(c_attn|c_proj)\.bias"), r"blocks.\1.attn.\2.bias", False),
    (re.compile(r"h\.(\d+)\.mlp\.c_fc\.weight"), r"blocks.\1.fc.weight", True),
    (re.compile(r"h\.(\d+)\.mlp\.c_fc\.bias"), r"blocks.\1.fc.bias", False),
    (re.compile(r"h\.(\d+)\.mlp\.c_proj\.weight"), r"blocks.\1.proj.weight", True),
    (re.compile(r"h\.(\d+)\.mlp\.c_proj\.bias"), r"blocks.\1.proj.bias", False),
    (re.compile(r"lm_head\.weight"), "lm_head.weight", False),
]
#: GPT-2's causal-mask buffers: our attention builds its mask, so they are dropped
_GPT2_MASKS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
_GPT2_MARK = re.compile(r"(transformer\.)?h\.\d+\.attn\.c_attn\.weight")


class InitError(SpecError):
    """Starting weights that do not fit the model; ``str()`` is one line."""


def read_init(path: str | Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict from ``path``, checked against ``model`` (every tensor
    present, none extra, same shapes, floating where the model's are, finite), in
    the model's dtypes."""
    raw = _read(Path(path))
    if any(_GPT2_MARK.fullmatch(k) for k in raw):
        raw = from_gpt2(raw)
    want = model.state_dict()
    problems = Problems()
    problems.add("missing", [k for k in want if k not in raw])
    problems.add("unexpected", [k for k in raw if k not in want])
    for k, t in raw.items():
        if k in want:
            _check(problems, k, t, want[k])
    if problems:
        raise InitError(f"--init {path}: {problems}")
    return {k: raw[k].to(want[k].dtype).contiguous() for k in want}


def load_init(path: str | Path, model: nn.Module) -> None:
    """Load the checked starting weights of ``path`` into ``model``."""
    state = read_init(path, model)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def from_gpt2(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's names and layout -> the built-in GPT's; names it does not know stay as
    they are (and are then refused as unexpected). The LM head is GPT-2's token
    embedding unless the file has its own."""
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        name = key.removeprefix("transformer.")
        if _GPT2_MASKS.fullmatch(name):
            continue
        for pattern, ours, conv1d in _GPT2_NAMES:
            if pattern.fullmatch(name):
                out[pattern.sub(ours, name)] = t.t() if conv1d and t.ndim == 2 else t
                break
        else:
            out[key] = t
    if "lm_head.weight" not in out and "wte.weight" in out:
        out["lm_head.weight"] = out["wte.weight"]
    return out


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InitError(f"--init {path}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InitError(f"--init {path}: not a readable safetensors file ({first})") from None


def _check(problems: Problems, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        problems.check(name, got, want)
    elif got.is_floating_point() != want.is_floating_point():
        problems.add("mis-typed", [f"{name} {got.dtype} (want {want.dtype})"])
    elif got.is_floating_point() and not bool(torch.isfinite(got).all()):
        problems.add("non-finite", [name])
