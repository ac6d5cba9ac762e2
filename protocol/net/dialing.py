"""Dialling peers and opening libp2p streams to them through the p2p daemon: over a
connection we dial, or (a peer behind a NAT) over the one it dials to us."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr

from protocol.net.addrs import strip_p2p
from protocol.net.direct_io import Streams
from protocol.net.tasks import honour_cancel

logger = logging.getLogger(__name__)

#: how long a stream to a peer behind a NAT waits for its connection to us, and how
#: long such a peer's own dial to another may take
DIAL_IN_WAIT_S = 60.0
DIAL_OUT_S = 15.0
OPEN_RETRY_S = 1.0  # a stream that fails to open (a daemon busy a moment) is tried again this long


class PeerUnreachable(ConnectionError):
    """A destination peer could not be reached or dropped the stream; ``peer_id`` names it."""

    def __init__(self, message: str, peer_id: str = "") -> None:
        super().__init__(message)
        self.peer_id = peer_id


def daemon_addrs(maddrs: Iterable[str]) -> list[HivemindMultiaddr]:
    """``maddrs`` as the p2p daemon's client takes them."""
    return [HivemindMultiaddr(strip_p2p(a)) for a in maddrs]


async def connect(p2p: P2P, peer_id: str, maddrs: Iterable[str], timeout: float) -> None:
    """Dial ``peer_id`` at ``maddrs`` (raises when the daemon cannot within ``timeout``)."""
    await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), daemon_addrs(maddrs)), timeout)


async def open_p2p(p2p: P2P, peer_id: str, protocol: str, maddrs: list[str], dials_in: bool) -> Streams:
    """A new libp2p stream to ``peer_id``: over a connection we dial at ``maddrs``, or
    (``dials_in``: it is behind a NAT) over the one it dials to us, waited for a while."""
    if maddrs and not dials_in:
        try:
            await connect(p2p, peer_id, maddrs, 15)
        except Exception as exc:
            honour_cancel()
            logger.debug("direct connect to %s failed: %s", peer_id, exc)
    deadline = time.monotonic() + (DIAL_IN_WAIT_S if dials_in else OPEN_RETRY_S)
    pid = PeerID.from_base58(peer_id)
    while True:
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(pid, protocol), 20)
            return reader, writer
        except Exception as exc:
            honour_cancel()
            if time.monotonic() >= deadline:
                raise PeerUnreachable(
                    f"cannot open a stream to peer {peer_id}: {exc or type(exc).__name__}", peer_id
                ) from None
        await asyncio.sleep(0.5)


async def dial_out(p2p: P2P, known: dict[str, list[str]], peers: Iterable[str]) -> list[str]:
    """Connect to ``peers`` at their ``known`` addresses (this peer is behind a NAT: they
    cannot dial it, and use these connections both ways); returns those not reached."""

    async def dial(peer_id: str) -> str:
        try:
            await connect(p2p, peer_id, known.get(peer_id, []), DIAL_OUT_S)
            return ""
        except Exception as exc:
            logger.debug("dialling out to %s failed: %s", peer_id, exc)
            return peer_id

    return [p for p in await asyncio.gather(*(dial(p) for p in peers)) if p]
