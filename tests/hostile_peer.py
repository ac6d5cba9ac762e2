"""A hostile volunteer for integration tests: joins like ``fusionllm join`` but
publishes an advert with a bad claim, then waits to be used.

``python -m tests.hostile_peer MODE --initial-peers MADDR --run RUN --identity KEY``
with MODE ``nan`` / ``inf`` / ``negative`` (its FLOP/s), ``maddr`` (an address
that does not parse), or ``poison``: an honest advert, but every value its stage
computes (activations or loss forward, gradients backward) is NaN; or ``framer``:
it reports every sender's (finite) values as poison."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

import torch

from peer import epoch
from peer.executor import StageExecutor
from peer.node import PeerConfig, PeerNode

CLAIMS = {"nan": float("nan"), "inf": float("inf"), "negative": -1e12, "maddr": None, "poison": None, "framer": None}


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
        if node.coordinator is not None and inbound.sender == node.coordinator.peer_id:
            return honest(inbound, what, *args, **kwargs)
        raise epoch.Poisoned(inbound, what)

    epoch._finite = accuse  # type: ignore[assignment]


def poison() -> None:
    """Make every stage this process runs send NaN."""
    forward, backward = StageExecutor.forward, StageExecutor.backward
    StageExecutor.forward = lambda self, *a, **k: _nan(forward(self, *a, **k))  # type: ignore[method-assign]
    StageExecutor.backward = lambda self, *a, **k: _nan(backward(self, *a, **k))  # type: ignore[method-assign]


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
    node = PeerNode(PeerConfig(args.initial_peers, args.run, identity=args.identity, advertise_flops=CLAIMS[args.mode]))
    if args.mode == "framer":
        frame_others(node)
    await node.start()
    assert node.advert is not None
    if args.mode == "maddr":
        node.advert = dataclasses.replace(node.advert, maddrs=["/ip4/999.1.2.3/tcp/x", "\x1b[31mgarbage"])
        await node._publish()
    print(f"joined run '{args.run}' as {node.advert.peer_id} claiming {args.mode}", flush=True)
    await node.serve()


if __name__ == "__main__":
    asyncio.run(main())
