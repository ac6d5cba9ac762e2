"""``fusionllm export``: a run's weights (what ``--save`` writes) as another library's
model. ``--to gpt2-hf`` writes GPT-2's Hugging Face layout into DIR, ``config.json``
and ``model.safetensors``, which ``transformers.GPT2LMHeadModel.from_pretrained(DIR)``
loads and ``--init DIR/model.safetensors`` reads back bit for bit. Every refusal is
one line (``UsageError``); output here is the CLI's own, so ``print`` is allowed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from coordinator.gpt2_layout import LayoutError, gpt2_config, is_tied, to_gpt2
from coordinator.weights import fit_state, read_state
from fusionllm.usage import UsageError
from protocol.model.job import JobSpec

#: what ``--to gpt2-hf`` writes in DIR (``--force`` replaces them, and leaves the rest)
GPT2_HF_FILES = ("config.json", "model.safetensors")


def cmd_export(args: argparse.Namespace) -> int:
    src, out = Path(args.run), Path(args.dir)
    _check_out(out, args.force)
    if not src.is_file():
        raise UsageError(f"{src}: no such file")
    model = _shapes(args)
    try:
        config = gpt2_config(model)
    except LayoutError as exc:
        raise UsageError(f"{_model_text(args)} {exc}") from None
    raw = read_state(src, str(src))
    state = fit_state(raw, model, f"{src} does not fit {_model_text(args)}")
    tied = is_tied(model)
    if tied and not torch.equal(state["wte.weight"], state["lm_head.weight"]):
        raise UsageError(f"{src}: lm_head.weight differs from wte.weight, which {_model_text(args)} ties")
    tensors = to_gpt2(state, tied)
    _write(out, config, tensors)
    params = sum(t.numel() for t in tensors.values())
    print(
        f"exported {src} to {out}/ ({', '.join(GPT2_HF_FILES)}): GPT-2 for Hugging Face transformers "
        f"(GPT2LMHeadModel), {params:,} parameters" + (", the head tied to the token embedding" if tied else "")
    )
    return 0


def _model_text(args: argparse.Namespace) -> str:
    return f"--model {args.model}" + (f" --model-args {args.model_args}" if args.model_args else "")


def _shapes(args: argparse.Namespace) -> nn.Module:
    """The run's model on the meta device: its shapes and structure, no memory for weights."""
    with torch.device("meta"):
        return JobSpec(model=args.model, model_args=args.model_args).build_model()


def _check_out(out: Path, force: bool) -> None:
    """DIR must be absent, an empty folder, or (``--force``) any folder."""
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"{out} exists and is not a directory")
        if out.is_dir() and not force and any(out.iterdir()):
            raise UsageError(f"{out} is not empty (--force writes {' and '.join(GPT2_HF_FILES)} into it)")
    except OSError as exc:
        raise UsageError(f"cannot read {out}: {exc.strerror or exc}") from None


def _write(out: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
    """Write both files, each whole or not at all (a partial file never takes a name)."""
    parts = [out / f".{name}.part" for name in GPT2_HF_FILES]
    try:
        out.mkdir(parents=True, exist_ok=True)
        parts[0].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(parts[1]), metadata={"format": "pt"})
        for part, name in zip(parts, GPT2_HF_FILES):
            os.replace(part, out / name)
    except (OSError, SafetensorError) as exc:
        raise UsageError(f"cannot write {out}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        for part in parts:
            part.unlink(missing_ok=True)
