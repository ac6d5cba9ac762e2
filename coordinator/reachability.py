"""Where the coordinator reaches each admitted peer: dialled back at the address its
connection comes from and the ports its hello named (``protocol.net.reach``), or only
over the connection the peer dials out (behind a NAT), and whether a connection can
be had now."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordinator.roster import Endpoint
from coordinator.status import StatusBoard
from protocol.net.reach import DIAL_BACK_TIMEOUT_S, dial_back, observed_ip, tcp_ports
from protocol.net.tasks import cancel_all, honour_cancel
from protocol.net.transport import PeerUnreachable
from protocol.wire.messages import Reachability

TELL_TIMEOUT_S = 10.0  # how long telling a peer its reachability may take
logger = logging.getLogger(__name__)


class Reach:
    """Dials each admitted peer back once; keeps whether it could (``reached``)."""

    def __init__(self, run_id: str, board: StatusBoard, endpoint: Endpoint) -> None:
        self.run_id, self.board, self.endpoint = run_id, board, endpoint
        self.reached: dict[str, bool] = {}  # admitted peer -> whether it could be dialled back
        self._hello_ports: dict[str, list[int]] = {}  # the ports its hello said it listens on
        self._dialling: set[asyncio.Task[None]] = set()

    def heard(self, sender: str, hello: dict[str, Any]) -> None:
        """Note the ports an admitted sender's hello says it listens on."""
        said = hello.get("maddrs")
        self._hello_ports[sender] = tcp_ports(
            [m for m in said[:16] if isinstance(m, str)] if isinstance(said, list) else []
        )

    def admitted(self, peer: str) -> None:
        """Dial ``peer`` back in the background (the gate's ``on_admit``)."""
        task = asyncio.get_running_loop().create_task(self.dial_back(peer))
        self._dialling.add(task)
        task.add_done_callback(self._dialling.discard)

    async def aclose(self, timeout: float) -> None:
        await cancel_all(self._dialling, timeout)

    def behind_nat(self) -> set[str]:
        """The peers that could not be dialled back: they dial out."""
        return {p for p, direct in self.reached.items() if not direct}

    async def dial_back(self, peer: str) -> None:
        """Whether ``peer`` can be dialled (``protocol.net.reach``): at the address its
        connection comes from, at the ports it listens on. Said on the page and to it."""
        transport = self.endpoint.transport
        assert transport is not None
        ports = self._hello_ports.pop(peer, [])
        try:
            infos = await asyncio.wait_for(transport.p2p.list_peers(), DIAL_BACK_TIMEOUT_S)
        except Exception as exc:  # the daemon may hiccup: then no address is known
            logger.debug("could not list connections: %s", exc)
            infos = []
        seen = [str(a) for info in infos if info.peer_id.to_base58() == peer for a in info.addrs]
        reach = await dial_back(observed_ip([a for a in seen if "p2p-circuit" not in a]), ports)  # not a relay's
        self.reached[peer] = reach.direct
        (transport.dials_in.discard if reach.direct else transport.dials_in.add)(peer)
        self.board.set_connection(peer, "direct" if reach.direct else "dial-out")
        if not reach.direct:
            self.board.event("join", f"peer {peer} is behind a NAT: it dials out ({reach.detail})")
        told = Reachability(self.run_id, reach.direct, reach.detail, ports)
        try:
            await asyncio.wait_for(transport.send(peer, told), TELL_TIMEOUT_S)
        except (PeerUnreachable, asyncio.TimeoutError) as exc:
            logger.debug("could not tell %s its reachability: %s", peer, exc)

    async def reachable(self, peer_id: str, timeout: float = 2.0) -> bool:
        """Whether a connection to ``peer_id`` exists or can be made within ``timeout``."""
        transport = self.endpoint.transport
        assert transport is not None
        try:
            if peer_id in await transport.connected():
                return True
            await asyncio.wait_for(transport.connect(peer_id), timeout)
            return True
        except Exception:
            honour_cancel()
            return False
