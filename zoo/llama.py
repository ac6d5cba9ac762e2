"""A LLaMA-shaped decoder (LLaMA-7B's shape by default): the model of the planner's
``llama-7b`` workload (``coordinator.workloads``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RotaryAttention(nn.Module):
    """LLaMA's attention: bias-free projections, rotary positions, causal SDPA."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q = _rotate(self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2), cos, sin)
        k = _rotate(self.k_proj(x).view(B, T, self.n_head, hs).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the half-split form of HF's LLaMA)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: RMSNorm, attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attn = RotaryAttention(dim, n_head)
        self.post_norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """A LLaMA-shaped decoder (untied head, no biases); ``forward(idx, targets)``
    returns the loss. The defaults are LLaMA-7B's shape."""

    def __init__(
        self,
        n_layer: int = 32,
        n_embd: int = 4096,
        n_head: int = 32,
        hidden: int = 11008,
        vocab_size: int = 32000,
        context: int = 2048,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList(LlamaBlock(n_embd, n_head, hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd, eps=1e-6)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        hs = n_embd // n_head
        inv_freq = 1.0 / rope_base ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = torch.narrow(self.cos, 0, 0, T), torch.narrow(self.sin, 0, 0, T)
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
