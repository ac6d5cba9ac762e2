"""A peer's way into the swarm's network: its DHT node, joined through the initial
peers (a one-line ``JoinError`` where it cannot), and the transport over that node's
libp2p daemon."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from peer.config import JoinError, PeerConfig
from protocol.net.dhtstart import DhtNotReady, start_dht, started
from protocol.net.reach import why_unreachable
from protocol.net.transport import Transport
from protocol.trust.identity import Identity
from protocol.wire.gate import Gate

#: builds the peer's transport from its DHT (the default: over the DHT's own libp2p daemon)
TransportFactory = Callable[[hivemind.DHT, Identity, Gate], Awaitable[Transport]]

__all__ = ["TransportFactory", "dht_transport", "join_dht"]

logger = logging.getLogger(__name__)


async def dht_transport(dht: hivemind.DHT, identity: Identity, gate: Gate) -> Transport:
    """A transport over the DHT's own libp2p daemon."""
    return Transport(await dht.replicate_p2p(), identity, gate)


#: hivemind's check that the node a peer joins through can dial it back (``call_ping``'s
#: ``available``); that ping back also fails when it times out on a busy machine (seen:
#: a CI run with two swarms on two cores), so a join that fails it is tried again
DIAL_BACK_FAILED = "can't access this node"
JOIN_TRIES = 3


async def join_dht(cfg: PeerConfig, validators: Sequence[RecordValidatorBase]) -> hivemind.DHT:
    """This peer's DHT node (with the run's record ``validators``), joined through the
    initial peers (JoinError, one line, if not), within ``cfg.join_timeout`` in all;
    a join refused by the dial-back check is tried ``JOIN_TRIES`` times in that time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.join_timeout
    attempt = 1
    while True:
        try:
            return await _join_once(cfg, validators, max(deadline - loop.time(), 0.0))
        except JoinError as exc:
            if DIAL_BACK_FAILED not in str(exc) or attempt == JOIN_TRIES or loop.time() >= deadline:
                raise JoinError(f"{exc} ({attempt} tries)" if attempt > 1 else str(exc)) from None
            logger.info("the DHT join was refused (%s); trying again", exc)
        attempt += 1


async def _join_once(cfg: PeerConfig, validators: Sequence[RecordValidatorBase], timeout: float) -> hivemind.DHT:
    def join() -> hivemind.DHT:
        return start_dht(
            timeout=timeout,  # past it, the node and its p2p daemon are ended: none joins late
            initial_peers=cfg.initial_peers,
            host_maddrs=cfg.host_maddrs,
            announce_maddrs=cfg.announce_maddrs or None,
            record_validators=validators,
        )

    try:
        return await started(join, timeout)
    except DhtNotReady:
        why = await why_unreachable(cfg.initial_peers)
        raise JoinError(f"could not join the DHT within {cfg.join_timeout:.0f} s: {why}") from None
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "bootstrap" in first:  # the p2p daemon's "failed to connect to bootstrap peers", hivemind's own
            why = await why_unreachable(cfg.initial_peers)
            raise JoinError(f"could not reach any initial peer: {why}") from None
        raise JoinError(f"could not join the DHT through {', '.join(cfg.initial_peers)}: {first}") from None
