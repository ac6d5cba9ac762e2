"""A peer's link probes: an epoch's, before it trains (``epoch_links``: the next
stage's peers and some of its own stage's replicas), and its answers to the
coordinator's probe requests (``ProbeLink``, before it commits to a plan): as the
answering end it lets the named peer's bandwidth probe in for a while; as the prober
it measures its upload to the other end with the same probe the epochs use
(``Transport.measure_bandwidth``), one request at a time, and sends back a
``ProbeResult``.

What bounds it is this peer's, not the request's: at most ``cap_bytes`` (its
``link_probe_bytes``) and ``PROBE_TIMEOUT_S`` a probe, at most ``MAX_WAITING``
requests waiting; and it dials the other end only where that end's own signed advert
for this run says it listens (the request carries the advert; an address alone is
never dialled), over libp2p, which makes sure the one answering is that peer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.transport import PeerUnreachable, Transport
from protocol.trust.advert_check import advert_problem
from protocol.trust.identity import IdentityError, check_record
from protocol.trust.text import clean
from protocol.wire.link_probes import ALLOW_S, MAX_ERROR_CHARS, ProbeLink, ProbeResult
from protocol.wire.messages import Advert
from protocol.wire.schema import MessageError

logger = logging.getLogger(__name__)

#: the longest one requested probe may take, opening its stream included (the
#: coordinator waits ``coordinator.link_asking.ASK_WAIT_S`` for all of them)
PROBE_TIMEOUT_S = 2.5
#: requests waiting at once; the rest are dropped (the coordinator's wait ends them)
MAX_WAITING = 16
#: the most replicas of its own stage a peer probes its link to before an epoch's
#: training (one ``link_probe_bytes`` probe each; every pair of a group of up to 9)
SIBLING_PROBES = 4
#: the most a peer spends on those probes together (a stalled replica must not hold
#: its epoch; 1 MiB at 1 Mbit/s takes 8.4 s)
SIBLING_PROBES_S = 20.0

T = TypeVar("T")


async def within(work: Awaitable[T], seconds: float, clock: Clock) -> T:
    """``work``'s result, or ``TimeoutError`` once ``seconds`` passed on ``clock`` (``work``
    is then cancelled)."""
    task, nap = asyncio.ensure_future(work), asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({task, nap}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        nap.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():  # cancelled above, or by its own doing
        raise TimeoutError(f"timed out after {seconds:.1f} s")
    return task.result()


def target_of(msg: ProbeLink, run_id: str, me: str) -> Advert:
    """The other end's advert, from the request: its own signed record for this run,
    naming the peer asked for; ``ValueError`` (one line) otherwise."""
    if msg.peer == me:
        raise ValueError("asked to probe itself")
    try:
        ad = Advert.from_header(msg.advert)
        check_record(msg.advert)
    except (MessageError, IdentityError) as exc:
        raise ValueError(f"the advert does not hold: {exc}") from None
    if not isinstance(ad, Advert) or ad.peer_id != msg.peer:
        raise ValueError("the advert is not the named peer's")
    if ad.run_id != run_id:
        raise ValueError("the advert is of another run")
    problem = advert_problem(ad)  # at least one address, each a multiaddr
    if problem:
        raise ValueError(f"the advert does not hold: {problem}")
    return ad


class LinkProber:
    """Answers ``ProbeLink``: ``take`` each request (from the peer's message routing),
    ``serve`` runs the probes and sends the results to the coordinator."""

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        coordinator: Callable[[], str],
        cap_bytes: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.transport = transport
        self.run_id = run_id
        self.coordinator = coordinator
        self.cap_bytes = cap_bytes
        self.clock = clock
        self.waiting: asyncio.Queue[ProbeLink] = asyncio.Queue()

    def take(self, msg: ProbeLink) -> None:
        """A request from the coordinator (the gate checked the sender and the run)."""
        if msg.role == "answer":
            self.transport.gate.allow_probe(msg.peer, ALLOW_S)
        elif self.waiting.qsize() >= MAX_WAITING:
            logger.warning("dropping a probe request: %d already wait", MAX_WAITING)
        else:
            self.waiting.put_nowait(msg)

    async def serve(self) -> None:
        """Probe each request in turn and send its result (one at a time: probes at once
        would share this peer's uplink and each measure a part of it)."""
        while True:
            msg = await self.waiting.get()
            result = await self.probe(msg)
            try:
                await within(self.transport.send(self.coordinator(), result), PROBE_TIMEOUT_S, self.clock)
            except (ConnectionError, TimeoutError) as exc:  # PeerUnreachable is one
                logger.info("could not send a probe's result to the coordinator: %s", exc)

    async def probe(self, msg: ProbeLink) -> ProbeResult:
        """Measure the upload to the request's peer, within this peer's caps."""
        try:
            ad = target_of(msg, self.run_id, self.transport.peer_id)
        except ValueError as exc:
            logger.warning("refused to probe %s: %s", clean(msg.peer)[:64], exc)
            return self._failed(msg, f"refused: {exc}")
        nbytes = min(msg.nbytes or self.cap_bytes, self.cap_bytes)
        self.transport.learn(ad.peer_id, ad.maddrs)
        try:
            work = self.transport.measure_bandwidth(ad.peer_id, nbytes, down=False)
            mbps, _ = await within(work, PROBE_TIMEOUT_S, self.clock)
        except (ConnectionError, OSError, TimeoutError) as exc:  # PeerUnreachable too
            return self._failed(msg, str(exc) or type(exc).__name__)
        if not math.isfinite(mbps) or mbps <= 0:
            return self._failed(msg, f"measured {mbps!r} Mbit/s")
        logger.info("probed the link to %s on request: %.1f Mbit/s", ad.peer_id, mbps)
        return ProbeResult(self.run_id, msg.nonce, msg.peer, mbit_s=mbps)

    def _failed(self, msg: ProbeLink, why: str) -> ProbeResult:
        return ProbeResult(self.run_id, msg.nonce, msg.peer, error=clean(why)[:MAX_ERROR_CHARS] or "failed")


def replicas_probed(group: list[str], r: int) -> list[str]:
    """The replicas of its stage (``group``) that replica ``r`` probes before training:
    the next ``SIBLING_PROBES`` round the group, at most half of it (a probe of one
    direction stands for both: every pair of a group of up to 9 is measured). Guessed
    from the peers' uplinks, two replicas on sites 5 Mbit/s apart were priced as
    1 Gbit/s: the summary's prediction for a plan's delivered compute read 66% under
    its measured step, and a rebalance check prices such links."""
    n = len(group)
    return [group[(r + i) % n] for i in range(1, min(SIBLING_PROBES, n // 2) + 1)]


async def epoch_links(
    transport: Transport, later: list[str], group: list[str], r: int, nbytes: int, up_mbps: float
) -> dict[str, float]:
    """What an epoch's peer (replica ``r`` of ``group``) measures before it trains, for
    its ``Ready``: its upload in Mbit/s to every peer of the next stage (``later``: the
    activations' way; a broken link there ends the epoch) and to ``replicas_probed``
    (the gradients' way: as many as answer within ``SIBLING_PROBES_S``). A peer reached
    through the coordinator gets this peer's uplink (``up_mbps``), which bounds the path."""

    async def probe(pid: str) -> float:
        if pid in transport.forward_via:
            return up_mbps
        return (await transport.measure_bandwidth(pid, nbytes, down=False))[0]

    out = {pid: await probe(pid) for pid in later}
    try:
        async with asyncio.timeout(SIBLING_PROBES_S):
            for pid in replicas_probed(group, r):
                with contextlib.suppress(PeerUnreachable):
                    out[pid] = await probe(pid)
    except TimeoutError:
        logger.info("replica %d: its links to the other replicas took over %.0f s to probe", r, SIBLING_PROBES_S)
    return out
