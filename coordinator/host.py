"""What the training driver and its components use of the coordinator that hosts
the run (``coordinator.swarm.Coordinator``): this narrow interface, and nothing else.
The driver never imports the networking shell; the shell hands itself in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from coordinator.assign import Assignment
from coordinator.config import CoordinatorConfig
from coordinator.runstate import RunState
from coordinator.status import StatusBoard
from protocol.net.transport import Transport
from protocol.wire.codecs import Codec
from protocol.wire.gate import Gate
from protocol.wire.messages import Advert


class Host(Protocol):
    """The coordinator, as the driver sees it."""

    config: CoordinatorConfig
    adverts: dict[str, Advert]  # admitted peers' live adverts, by peer id
    banned: set[str]  # peers the host banned during this run
    board: StatusBoard  # the status page's state
    gate: Gate  # the receiver's checks (its epoch, admitted keys, reject listeners)
    reached: dict[str, bool]  # admitted peer -> whether it could be dialled back
    transport: Transport | None  # set once the host has started

    async def wait_for_peers(self, on_change: Callable[[int], None] | None = None) -> dict[str, Advert]: ...

    async def live_adverts(self) -> dict[str, Advert]: ...

    def keep_adverts(self, live: dict[str, Advert], planned: set[str]) -> None: ...

    def keys_of(self, peers: set[str]) -> dict[str, str]: ...

    def where(self, peer_id: str, plan: Assignment | None) -> str: ...

    async def reachable(self, peer_id: str, timeout: float = 2.0) -> bool: ...

    def traffic(self, st: RunState) -> list[tuple[int, int]]: ...

    def choose_codecs(
        self, dag: Any, plan: Assignment, specs: list[list[Any]], measured: dict[str, dict[str, float]]
    ) -> tuple[list[Codec], list[float]]: ...
