"""What the coordinator's network components know of the run: the one place they read
the training driver (and the parts of the coordinator that ``start()`` brings up).

Before a run starts there is no driver: nobody is planned or lost, no payload is
taken, no spot-check answer is awaited. The components read the driver only through
:class:`Roster`, so that the driver's own shape stays its business."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import hivemind

from coordinator.runstate import EXCLUDED, RunState
from protocol.net.transport import Inbound, Transport
from protocol.trust.identity import Identity
from protocol.wire.assign_shape import neighbourhood


@dataclass
class Endpoint:
    """The coordinator's presence on the network, shared by its components: its
    identity, its DHT node and its transport (None until ``start()`` brings them up,
    or given to the coordinator already built)."""

    identity: Identity | None = None
    dht: hivemind.DHT | None = None
    transport: Transport | None = None

    def visible_maddrs(self) -> list[str]:
        """Where other machines reach the coordinator's DHT node."""
        assert self.dht is not None
        return [str(m) for m in self.dht.get_visible_maddrs()]


class Driving(Protocol):
    """The parts of the training driver (``coordinator.run``) that the components read."""

    st: RunState
    max_payload_bytes: int
    auditing: set[str]

    def take_answer(self, inbound: Inbound) -> None: ...

    def take_probe(self, inbound: Inbound) -> None: ...

    def fail(self, peer: str, why: str) -> None: ...


class Roster:
    """The run's peers as the driver sees them (the driver is set once a run starts)."""

    def __init__(self) -> None:
        self.driver: Driving | None = None

    def running(self) -> bool:
        """Whether a run has started."""
        return self.driver is not None

    def planned(self) -> set[str]:
        """The peers of the current plan."""
        return self.driver.st.planned if self.driver is not None else set()

    def neighbourhoods(self) -> dict[str, list[str]]:
        """Each planned peer's neighbourhood: the peers of its stage and the stages beside
        it, those its gate admits (``protocol.wire.assign_shape``); one list a stage."""
        plan = self.driver.st.plan if self.driver is not None else None
        stages = plan.stages if plan is not None else []
        out: dict[str, list[str]] = {}
        for s, group in enumerate(stages):
            out.update(dict.fromkeys(group, [q for i in neighbourhood(s, len(stages)) for q in stages[i]]))
        return out

    def lost(self) -> dict[str, str]:
        """Dropped peers and why (one line each)."""
        return self.driver.st.lost if self.driver is not None else {}

    def excluded(self) -> set[str]:
        """Peers excluded from the run for what they sent."""
        return {p for p, why in self.lost().items() if why.startswith(EXCLUDED)}

    def planning(self) -> bool:
        """Whether a plan is under way (joiners then wait as standby)."""
        return self.driver is not None and self.driver.st.plan is not None

    def max_payload_bytes(self) -> int:
        """The largest payload taken from a planned peer (0 before a run)."""
        return self.driver.max_payload_bytes if self.driver is not None else 0

    def auditing(self, peer: str) -> bool:
        """Whether ``peer`` checks a step for the coordinator now (its evidence carries tensors)."""
        return self.driver is not None and peer in self.driver.auditing

    def take_answer(self, inbound: Inbound) -> None:
        """A spot-check answer, for the driver's audit box."""
        if self.driver is not None:
            self.driver.take_answer(inbound)

    def take_probe(self, inbound: Inbound) -> None:
        """A probe's result, for the driver's planner."""
        if self.driver is not None:
            self.driver.take_probe(inbound)

    def fail(self, peer: str, why: str) -> None:
        """Drop a planned peer from the run (its stage is recovered)."""
        if self.driver is not None:
            self.driver.fail(peer, why)
