"""GPT-2's published layout (Hugging Face's ``GPT2LMHeadModel``) and the built-in GPT's
(``zoo.gpt``), both ways, from one table of names: ``--init`` reads GPT-2's files
(:func:`from_gpt2`), ``fusionllm export --to gpt2-hf`` writes them (:func:`to_gpt2`,
:func:`gpt2_config`). GPT-2 stores its Conv1D weights as input x output, transposed
from ``nn.Linear``'s."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from protocol.model.job import SpecError
from zoo.gpt import GPT

# fmt: off
# a table: one row per tensor, GPT-2's name (``{n}``: the block), ours, a Conv1D weight
GPT2_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("wte.weight",                "wte.weight",                    False),
    ("wpe.weight",                "wpe.weight",                    False),
    ("h.{n}.ln_1.weight",         "blocks.{n}.ln_1.weight",        False),
    ("h.{n}.ln_1.bias",           "blocks.{n}.ln_1.bias",          False),
    ("h.{n}.attn.c_attn.weight",  "blocks.{n}.attn.c_attn.weight", True),
    ("h.{n}.attn.c_attn.bias",    "blocks.{n}.attn.c_attn.bias",   False),
    ("h.{n}.attn.c_proj.weight",  "blocks.{n}.attn.c_proj.weight", True),
    ("h.{n}.attn.c_proj.bias",    "blocks.{n}.attn.c_proj.bias",   False),
    ("h.{n}.ln_2.weight",         "blocks.{n}.ln_2.weight",        False),
    ("h.{n}.ln_2.bias",           "blocks.{n}.ln_2.bias",          False),
    ("h.{n}.mlp.c_fc.weight",     "blocks.{n}.fc.weight",          True),
    ("h.{n}.mlp.c_fc.bias",       "blocks.{n}.fc.bias",            False),
    ("h.{n}.mlp.c_proj.weight",   "blocks.{n}.proj.weight",        True),
    ("h.{n}.mlp.c_proj.bias",     "blocks.{n}.proj.bias",          False),
    ("ln_f.weight",               "ln_f.weight",                   False),
    ("ln_f.bias",                 "ln_f.bias",                     False),
    ("lm_head.weight",            "lm_head.weight",                False),
)
# fmt: on
#: GPT-2's causal-mask buffers: our attention builds its mask, so they are dropped
_MASKS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
#: a tensor only GPT-2's layout has: a file holding one is read as GPT-2's
_MARK = re.compile(r"(transformer\.)?h\.\d+\.attn\.c_attn\.weight")
#: Hugging Face's GPT2LMHeadModel keeps every tensor but the head under this prefix
HF_PREFIX = "transformer."
#: our GELU (``F.gelu``'s ``approximate``) -> Hugging Face's ``activation_function``
HF_ACTIVATIONS = {"tanh": "gelu_new", "none": "gelu"}
#: GPT-2's vocabulary, whose end-of-text token is 50256
GPT2_VOCAB = 50257


class LayoutError(SpecError):
    """A model or state that GPT-2's layout cannot hold; ``str()`` is one line."""


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{n\}", r"(?P<n>\d+)"))


#: (source pattern, destination template, Conv1D) in each direction, from the one table
_FROM_GPT2 = [(_pattern(theirs), ours, conv1d) for theirs, ours, conv1d in GPT2_TABLE]
_TO_GPT2 = [(_pattern(ours), theirs, conv1d) for theirs, ours, conv1d in GPT2_TABLE]


def _rename(name: str, rules: list[tuple[re.Pattern[str], str, bool]]) -> tuple[str, bool] | None:
    """``name`` in the other layout, and whether it is a Conv1D weight; None if unknown."""
    for pattern, template, conv1d in rules:
        m = pattern.fullmatch(name)
        if m:
            return template.format(**m.groupdict()), conv1d
    return None


def _flip(t: torch.Tensor, conv1d: bool) -> torch.Tensor:
    return t.t().contiguous() if conv1d and t.ndim == 2 else t


def is_gpt2_layout(names: list[str]) -> bool:
    """Whether tensors by these names are in GPT-2's layout rather than ours."""
    return any(_MARK.fullmatch(k) for k in names)


def from_gpt2(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's names and layout (an optional ``transformer.`` prefix) -> the built-in
    GPT's; names it does not know stay as they are (and are then refused as
    unexpected). The LM head is GPT-2's token embedding unless the file has its own."""
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        name = key.removeprefix(HF_PREFIX)
        if _MASKS.fullmatch(name):
            continue
        renamed = _rename(name, _FROM_GPT2)
        if renamed is None:
            out[key] = t
        else:
            out[renamed[0]] = _flip(t, renamed[1])
    if "lm_head.weight" not in out and "wte.weight" in out:
        out["lm_head.weight"] = out["wte.weight"]
    return out


def to_gpt2(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The built-in GPT's state dict -> ``GPT2LMHeadModel``'s names and layout, as its
    ``save_pretrained`` writes them; a ``tied`` head is left out (GPT-2 ties it to the
    token embedding). ``LayoutError`` names tensors the layout has no place for."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in state.items():
        renamed = _rename(name, _TO_GPT2)
        if renamed is None:
            unknown.append(name)
        elif renamed[0] == "lm_head.weight":
            if not tied:  # its own copy: safetensors refuses tensors that share memory
                out["lm_head.weight"] = t.clone(memory_format=torch.contiguous_format)
        else:
            out[HF_PREFIX + renamed[0]] = _flip(t, renamed[1]).contiguous()
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise LayoutError(f"GPT-2's layout has no place for {', '.join(unknown[:3])}{more}")
    return out


def is_tied(model: nn.Module) -> bool:
    """Whether the model's LM head is its token embedding (``tie_weights``)."""
    return isinstance(model, GPT) and model.lm_head.weight is model.wte.weight


def gpt2_config(model: nn.Module) -> dict[str, Any]:
    """Hugging Face's ``config.json`` of a ``GPT2LMHeadModel`` that computes what
    ``model`` does (no dropout: ours has none); ``LayoutError`` for a model that GPT-2's
    layout cannot hold."""
    if not isinstance(model, GPT):
        raise LayoutError(f"is a {type(model).__name__}, not the built-in GPT (zoo.gpt), the only GPT-2-shaped model")
    block = model.blocks[0] if len(model.blocks) else None
    if block is None:
        raise LayoutError("has no blocks (n_layer=0)")
    if block.attn.c_attn.bias is None:
        raise LayoutError("has no query/key/value bias, which GPT-2 has (use --model gpt2, or qkv_bias=true)")
    if block.gelu not in HF_ACTIVATIONS:
        raise LayoutError(f"uses GELU approximation '{block.gelu}', which GPT-2 has no activation for")
    vocab, n_embd = model.wte.weight.shape
    if n_embd % model.n_head:
        raise LayoutError(f"has n_embd={n_embd}, which is not a multiple of n_head={model.n_head}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(vocab),
        "n_positions": int(model.wpe.weight.shape[0]),
        "n_embd": int(n_embd),
        "n_layer": len(model.blocks),
        "n_head": model.n_head,
        "n_inner": block.fc.out_features,
        "activation_function": HF_ACTIVATIONS[block.gelu],
        "layer_norm_epsilon": model.ln_f.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": is_tied(model),
        "bos_token_id": GPT2_VOCAB - 1 if vocab == GPT2_VOCAB else None,
        "eos_token_id": GPT2_VOCAB - 1 if vocab == GPT2_VOCAB else None,
        "use_cache": True,
        "dtype": str(model.wte.weight.dtype).removeprefix("torch."),
    }
