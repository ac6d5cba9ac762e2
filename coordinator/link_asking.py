"""The live coordinator asks before it commits to a plan: the guessed links that decide
between OP-Fence's finalists (``Assignment.deciding``, ``coordinator.asking``) are
measured on request by their ends (``ProbeLink`` to both, a ``ProbeResult`` back from
the prober), all within ``ASK_WAIT_S``. One round: a link whose prober does not answer
in time stays a guess. ``planning.Planner`` folds what was measured into the links the
epochs' own probes fill (``RunState.link_mbps``) and plans once more."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass

from coordinator.asking import Pair
from coordinator.host import Host
from coordinator.netmodel import Network
from protocol.net.clock import Clock
from protocol.net.transport import Inbound
from protocol.trust.text import clean
from protocol.wire.link_probes import ProbeLink, ProbeResult
from protocol.wire.messages import Advert

logger = logging.getLogger(__name__)

#: the most the coordinator waits for the links it asked about, sends included
ASK_WAIT_S = 3.0


@dataclass(frozen=True)
class Reading:
    """What one asked link measured: ``prober``'s upload to ``target`` in Mbit/s (None:
    no measurement, ``error`` says why)."""

    prober: str
    target: str
    mbps: float | None = None
    error: str = ""


def ends(pair: Pair, nat: Collection[str]) -> tuple[str, str] | None:
    """(prober, target) of a link: the end behind a NAT probes (it can dial out, not be
    dialled); None when both are (their frames go through the coordinator: a direct
    probe measures nothing the plan uses)."""
    a, b = pair
    if a in nat and b in nat:
        return None
    return (b, a) if b in nat else (a, b)


class LinkAsker:
    """Sends the probe requests of one planning and collects their answers (``take``,
    from the coordinator's intake)."""

    def __init__(self, host: Host, clock: Clock, wait_s: float = ASK_WAIT_S) -> None:
        self.host = host
        self.clock = clock
        self.wait_s = wait_s
        self._nonces = itertools.count(1)
        self._pending: dict[int, tuple[str, str]] = {}  # nonce -> (prober, target), while asking
        self._readings: dict[int, Reading] = {}
        self._all_in = asyncio.Event()

    def take(self, inbound: Inbound) -> None:
        """A ``ProbeResult``: kept if it answers a pending request, from its prober."""
        msg = inbound.message
        if not isinstance(msg, ProbeResult) or msg.run_id != self.host.config.run_id:
            return
        asked = self._pending.get(msg.nonce)
        if asked is None or asked != (inbound.sender, msg.peer):
            logger.info("ignoring a probe result of %s that answers no request of it", inbound.sender)
            return
        mbps = msg.mbit_s if msg.ok and math.isfinite(msg.mbit_s) else None
        self._settle(msg.nonce, Reading(*asked, mbps, msg.error))

    def _settle(self, nonce: int, reading: Reading) -> None:
        if self._pending.pop(nonce, None) is not None:
            self._readings[nonce] = reading
        if not self._pending:
            self._all_in.set()

    async def ask(self, pairs: list[Pair], adverts: dict[str, Advert], nat: Collection[str]) -> list[Reading]:
        """Ask the ends of ``pairs`` to measure them; the readings that came within
        ``wait_s`` (a link with no answer: ``mbps`` None). Pairs an advert is missing
        for, or both of whose ends are behind NATs, are not asked."""
        requests: dict[int, tuple[str, str]] = {}
        for pair in pairs:
            found = ends(pair, nat)
            if found is not None and all(p in adverts for p in found):
                requests[next(self._nonces)] = found
        if not requests:
            return []
        self._pending, self._readings, self._all_in = dict(requests), {}, asyncio.Event()
        sends = [asyncio.ensure_future(self._request(n, *ends_, adverts)) for n, ends_ in requests.items()]
        waits = {asyncio.ensure_future(self._all_in.wait()), asyncio.ensure_future(self.clock.sleep(self.wait_s))}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*sends, *waits]:
                task.cancel()
            self._pending = {}
        late = f"no answer within {self.wait_s:.1f} s"
        return [self._readings.get(n) or Reading(*pair, None, late) for n, pair in requests.items()]

    async def _request(self, nonce: int, prober: str, target: str, adverts: dict[str, Advert]) -> None:
        """Tell the target to let the prober in, then the prober to probe it."""
        run_id, transport = self.host.config.run_id, self.host.transport
        assert transport is not None
        answer = ProbeLink(run_id, nonce, prober, "answer")
        probe = ProbeLink(run_id, nonce, target, "probe", advert=adverts[target].header())
        try:
            await transport.send(target, answer)
            await transport.send(prober, probe)
        except Exception as exc:  # PeerUnreachable, a broken stream: that link stays a guess
            self._settle(nonce, Reading(prober, target, None, f"could not ask: {exc or type(exc).__name__}"))


def asked_line(readings: list[Reading], guessed: Network, before: list[list[str]], after: list[list[str]]) -> str:
    """The run's event for one asking: each link probed, what it measured against the
    guess (``guessed``, the view before), and whether the plan changed."""
    said = []
    for r in readings:
        guess = guessed.link(r.prober, r.target).mbps
        got = f"{r.mbps:.1f} Mbit/s" if r.mbps is not None else clean(r.error)[:120]
        said.append(f"{r.prober[:8]}->{r.target[:8]} {got} (guessed {guess:.1f})")
    measured = sum(r.mbps is not None for r in readings)
    verdict = f"the plan changed: {_shown(before)} -> {_shown(after)}" if before != after else "the plan stayed"
    if not measured:
        verdict = "planned on the guesses"
    return (
        f"probed {measured} of {len(readings)} guessed links that decide the plan before committing it: "
        f"{'; '.join(said)}; {verdict}"
    )


def _shown(stages: list[list[str]]) -> str:
    return " | ".join(",".join(p[:8] for p in group) for group in stages)
