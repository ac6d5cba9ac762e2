"""What ``plan`` and ``sim`` offer, as names and numbers, without torch, so that the
command line parses its flags and prints its help before anything heavy is imported:
the schedulers, the churn policies, and the built-in workloads' shapes and default
batches (``workloads`` builds and traces them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the schedulers ``scheduler.plan`` runs by name
SCHEDULERS = ("opfence", "bw-blind", "petals", "dtfm", "even", "compute", "random")
#: what a swarm does about a change (the simulator compares them): ``rebalance``
#: (``replan``'s rules: recover from losses, move when the move pays), ``none``
#: (recover from losses only: slow peers stay, joiners wait) and ``restart`` (every
#: change stops the run, which restarts from the last checkpoint on a fresh plan)
POLICIES = ("rebalance", "none", "restart")
#: tokens per iteration of every built-in workload's default batch (2^18, about
#: GPT-2-scale practice: nanoGPT's GPT-2 runs use ~0.5M)
TOKENS_PER_ITERATION = 262_144
#: what plan and sim model for a workload unless told: mixed precision, as the GPU
#: speeds of the topology presets are (``sim.presets``)
DEFAULT_PRECISION = "bf16"


@dataclass(frozen=True)
class Workload:
    """A built-in model shape and its default batch: ``micro_batches`` micro-batches of
    ``batch_size`` sequences of ``context`` tokens, ``TOKENS_PER_ITERATION`` in all;
    ``batch_size`` is small enough that one micro-batch's activations fit a GPU."""

    name: str
    context: int  # the longest sequence it takes (and the default sequence length)
    batch_size: int  # default sequences per micro-batch
    summary: str
    context_arg: str  # the keyword of the model's builder (``workloads.BUILDERS``) that sets the context

    def context_of(self, shape: dict[str, Any] | None) -> int:
        """The context of the shape with ``shape``'s changes."""
        return int((shape or {}).get(self.context_arg, self.context))

    @property
    def micro_batches(self) -> int:
        """Default micro-batches per iteration."""
        return TOKENS_PER_ITERATION // (self.batch_size * self.context)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("gpt2", 1024, 8, "GPT-2 small: 12 layers, 768 wide, 12 heads, tied, 124M", "block_size"),
        Workload("gpt2-xl", 1024, 4, "GPT-2 XL: 48 layers, 1600 wide, 25 heads, tied, 1.56B", "block_size"),
        Workload("llama-7b", 2048, 1, "LLaMA-7B: 32 layers, 4096 wide, SwiGLU, rotary, untied, 6.7B", "context"),
    )
}


def defaults_text() -> str:
    """Each workload's default batch, M x B x S, for ``--help``."""
    return "; ".join(f"{w.name} {w.micro_batches} x {w.batch_size} x {w.context}" for w in WORKLOADS.values())
