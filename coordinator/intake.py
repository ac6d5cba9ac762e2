"""What the coordinator takes from peers, and what it passes on: the kinds peers may
send it, who may send payloads and how large, where spot-check answers go, and which
frames it forwards between peers that cannot dial each other (both behind NATs).
The rules are hooks of the gate (``expect``) and the transport (``lane_ok``,
``divert``, ``relay_ok``)."""

from __future__ import annotations

from coordinator.reachability import Reach
from coordinator.roster import Roster
from protocol.net.transport import Inbound, Transport
from protocol.wire.envelope import Envelope
from protocol.wire.gate import Gate
from protocol.wire.link_probes import ProbeResult
from protocol.wire.messages import Evidence, Message, Verdict, kinds_from
from protocol.wire.reject import Reject, Rejected

#: what peers may send the coordinator
FROM_PEERS = kinds_from("peer")


class Intake:
    """The coordinator's rules for inbound frames, by the run's plan (``roster``)."""

    def __init__(self, roster: Roster, reach: Reach) -> None:
        self.roster, self.reach = roster, reach

    def hook_gate(self, gate: Gate) -> None:
        gate.accept_hello = True
        gate.expect = self.expect

    def hook_transport(self, transport: Transport) -> None:
        transport.lane_ok = self.lane_ok
        transport.forwarder.relay_ok = self.relay_ok
        transport.divert = self.divert

    def expect(self, env: Envelope, message: Message, sender: str) -> None:
        """Checked before a payload is read: peers send only their kinds, and only a
        planned peer's stage state carries tensors, no larger than the model's whole
        state with its optimizer's (so an admitted peer cannot make us hold more)."""
        if env.kind not in FROM_PEERS:
            raise Rejected(Reject.UNEXPECTED, f"peers do not send the coordinator '{env.kind}'")
        if env.payload_bytes == 0:
            return
        # tensors ride only on a stage's state and on evidence of poison (the offending signed frame)
        carries = env.kind == "state" or (env.kind == "failure" and bool(env.body.get("poison")))
        carries = carries or (env.kind == "evidence" and self.roster.auditing(sender))
        if not carries or sender not in self.roster.planned():
            raise Rejected(Reject.OVERSIZED, f"a {env.payload_bytes}-byte payload on '{env.kind}' from {sender}")
        limit = self.roster.max_payload_bytes()
        if env.payload_bytes > limit:
            raise Rejected(Reject.OVERSIZED, f"{env.kind} of {env.payload_bytes} bytes, over {limit}")

    def lane_ok(self, sender: str, nbytes: int) -> bool:
        """Lane parts (large payloads) only from planned peers, no larger than a payload
        the coordinator accepts from them (``expect``)."""
        return sender in self.roster.planned() and nbytes <= self.roster.max_payload_bytes()

    def divert(self, inbound: Inbound) -> bool:
        """Spot-check answers from planned peers go to the driver's audit box (spot checks
        run beside the step that the inbox serves); others are dropped. Probe results go
        to the planner (``coordinator.link_asking``), which keeps only those it asked for."""
        if isinstance(inbound.message, ProbeResult):
            self.roster.take_probe(inbound)
            return True
        if not self.roster.running() or not isinstance(inbound.message, (Evidence, Verdict)):
            return False
        if inbound.sender in self.roster.planned():
            self.roster.take_answer(inbound)
        return True

    def relay_ok(self, origin: str, dest: str, nbytes: int) -> bool:
        """Frames are forwarded only between planned peers that cannot dial each other,
        no larger than a payload the coordinator takes."""
        nat = self.reach.behind_nat()
        return {origin, dest} <= self.roster.planned() & nat and nbytes <= self.roster.max_payload_bytes()
