"""The built-in byte-level GPT (``--model gpt``) and GPT-2 small's shape (``--model gpt2``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=qkv_bias)  # a key bias has zero true gradient
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, qkv_bias: bool = False, gelu: str = "none") -> None:
        super().__init__()
        self.gelu = gelu
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, qkv_bias)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate=self.gelu))


class GPT(nn.Module):
    """A nanoGPT-like decoder over bytes; ``forward(idx, targets)`` returns the loss."""

    def __init__(
        self,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        block_size: int = 128,
        vocab_size: int = 256,
        tie_weights: bool = False,
        qkv_bias: bool = False,
        gelu: str = "none",
    ) -> None:
        super().__init__()
        _check_shape(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size, vocab_size=vocab_size)
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        if gelu not in ("none", "tanh"):
            raise ValueError(f"gelu {gelu!r}: choose none or tanh")
        self.n_layer, self.n_head = n_layer, n_head
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, qkv_bias, gelu) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _check_shape(**sizes: object) -> None:
    """Each size a whole number of at least 1 (``--model-args n_layer=-1`` built an empty model)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")


def gpt(**kwargs: object) -> GPT:
    """The demo's default GPT (about 0.8M parameters); keyword arguments override."""
    return GPT(**kwargs)  # type: ignore[arg-type]


def gpt2(**kwargs: object) -> GPT:
    """GPT-2 small's shape (124M parameters with GPT-2's 50257 vocabulary; bytes here),
    with its query/key/value bias and tanh GELU, so GPT-2's published weights fit
    (``--init``, see ``coordinator.weights``)."""
    cfg: dict[str, object] = dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, qkv_bias=True, gelu="tanh")
    cfg.update(kwargs)
    return GPT(**cfg)  # type: ignore[arg-type]
