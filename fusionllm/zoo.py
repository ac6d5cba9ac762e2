"""Built-in models and data: a byte-level GPT, the standard library as text, and a
branchy example model with skip connections across stages."""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, ...]
#: the validation split of generated data draws from this seed offset
VAL_SEED_OFFSET = 1_000_003


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


@functools.lru_cache(maxsize=2)
def _stdlib_bytes(max_bytes: int) -> tuple[bytes, bytes]:
    """The standard library's ``.py`` files, every tenth file held out for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        if len(train) + len(val) >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % 10 == 9 else train).extend(data)
    if len(val) < 4096 or len(train) < 4096:
        raise RuntimeError(f"too little Python source under {root} to build the data set")
    return bytes(train), bytes(val)


def stdlib_text(
    seed: int,
    batch_size: int = 16,
    ctx: int = 64,
    split: str = "train",
    max_bytes: int = 8_000_000,
) -> Iterator[Batch]:
    """Endless batches ``(idx, targets)`` of ``ctx`` bytes from the standard library."""
    train, val = _stdlib_bytes(max_bytes)
    data = torch.frombuffer(bytearray(train if split == "train" else val), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - ctx - 1, (batch_size,), generator=gen)
        chunk = torch.stack([data[s : s + ctx + 1] for s in starts.tolist()]).long()
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


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


def branchy_data(seed: int, batch_size: int = 16, dim: int = 32, split: str = "train") -> Iterator[Batch]:
    """Endless regression batches ``(x, y)`` with ``y = sin(x . w)``; the ``val`` split
    draws other inputs for the same ``w``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, generator=gen)
    if split != "train":
        gen = torch.Generator().manual_seed(seed + VAL_SEED_OFFSET)
    while True:
        x = torch.randn(batch_size, dim, generator=gen)
        yield x, torch.sin(x @ w / dim**0.5)
