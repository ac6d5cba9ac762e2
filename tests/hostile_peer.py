"""A hostile volunteer for integration tests: joins like ``fusionllm join`` but
publishes an advert with a bad claim, then waits to be used.

``python -m tests.hostile_peer MODE --initial-peers MADDR --run RUN --identity KEY``
with MODE ``nan`` / ``inf`` / ``negative`` (its FLOP/s), ``maddr`` (an address
that does not parse), or ``poison``: an honest advert, but every value its stage
computes (activations or loss forward, gradients backward) is NaN; or ``framer``:
it reports every sender's (finite) values as poison; or ``noisy``: wrong but finite work,
small noise on a fraction ``FUSIONLLM_CHEAT_FRACTION`` (default 1) of the values its
stage computes forward (its activations, or its loss); or ``fakeloss``: it computes
honestly but reports a loss of 0.01 (on the last stage); or ``liar``: honest work, but
the frames it shows for a spot check have one payload byte changed."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
from typing import Any

import torch

from peer import epoch, spotcheck
from peer.adverts import Adverts
from peer.config import PeerConfig
from peer.executor import StageExecutor
from peer.node import PeerNode

CLAIMS = {"nan": float("nan"), "inf": float("inf"), "negative": -1e12, "maddr": None}
CLAIMS |= dict.fromkeys(("poison", "framer", "noisy", "fakeloss", "liar"))


def _nan(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.full_like(value, float("nan"))
    if isinstance(value, (tuple, list)):
        return type(value)(_nan(v) for v in value)
    return value


def frame_others(node: PeerNode) -> None:
    """Report every other peer's (finite) values as poison (not the coordinator's)."""
    honest = epoch._finite

    def accuse(inbound: Any, what: str, *args: Any, **kwargs: Any) -> Any:
        if node.link is not None and inbound.sender == node.link.peer_id:
            return honest(inbound, what, *args, **kwargs)
        raise epoch.Poisoned(inbound, what)

    epoch._finite = accuse  # type: ignore[assignment]


def lie() -> None:
    """Show spot checks frames with one payload byte changed (their signatures no longer hold)."""
    honest = spotcheck.evidence_for

    def tampered(*args: Any) -> Any:
        reply, values = honest(*args)
        if reply.kinds != ["weights"]:
            values = [v.clone() for v in values]
            for payload in values[1::2]:
                if payload.numel():
                    payload[0] ^= 1
        return reply, values

    spotcheck.evidence_for = tampered  # type: ignore[assignment]


def garble_addresses() -> None:
    """Every advert this process publishes names addresses that do not parse, its first
    too (it once published a good one at its start and the bad one after: under load the
    coordinator read the good one first and planned the peer, and CI failed on it)."""
    honest = Adverts.publish

    async def garbled(self: Adverts) -> None:
        assert self.advert is not None
        self.advert = dataclasses.replace(self.advert, maddrs=["/ip4/999.1.2.3/tcp/x", "\x1b[31mgarbage"])
        await honest(self)

    Adverts.publish = garbled  # type: ignore[method-assign]


def poison() -> None:
    """Make every stage this process runs send NaN."""
    forward, backward = StageExecutor.forward, StageExecutor.backward
    StageExecutor.forward = lambda self, *a, **k: _nan(forward(self, *a, **k))  # type: ignore[method-assign]
    StageExecutor.backward = lambda self, *a, **k: _nan(backward(self, *a, **k))  # type: ignore[method-assign]


def _noisy(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value + 1e-3 * torch.randn_like(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_noisy(v) for v in value)
    return value


def cheat(mode: str) -> None:
    """Wrong but finite work: noise on a fraction of the forward outputs, or a fake loss."""
    forward = StageExecutor.forward
    fraction = float(os.environ.get("FUSIONLLM_CHEAT_FRACTION", "1"))
    rng = random.Random()

    def noisy(self: StageExecutor, *a: Any, **k: Any) -> Any:
        out = forward(self, *a, **k)
        return _noisy(out) if rng.random() < fraction else out

    def fake(self: StageExecutor, *a: Any, **k: Any) -> Any:
        out = forward(self, *a, **k)
        return torch.full_like(out, 0.01) if self.is_last else out

    StageExecutor.forward = noisy if mode == "noisy" else fake  # type: ignore[method-assign]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=sorted(CLAIMS))
    ap.add_argument("--initial-peers", nargs="+", required=True)
    ap.add_argument("--run", default="fusionllm")
    ap.add_argument("--identity", required=True)
    ap.add_argument("--coordinator-key", default=None)
    args = ap.parse_args()
    if args.mode == "poison":
        poison()
    if args.mode == "liar":
        lie()
    if args.mode == "maddr":
        garble_addresses()
    if args.mode in ("noisy", "fakeloss"):
        cheat(args.mode)
    claim = CLAIMS[args.mode] or float(os.environ.get("FUSIONLLM_CLAIM_FLOPS", "0")) or None
    node = PeerNode(PeerConfig(args.initial_peers, args.run, identity=args.identity, advertise_flops=claim))
    if args.mode == "framer":
        frame_others(node)
    await node.start()
    assert node.adverts is not None and node.advert is not None
    print(f"joined run '{args.run}' as {node.advert.peer_id} claiming {args.mode}", flush=True)
    await node.serve()


if __name__ == "__main__":
    asyncio.run(main())
