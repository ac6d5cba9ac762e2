"""A peer's admission to a private swarm, in one place: the proof of the swarm's
secret that its hello carries, the admission certificate the coordinator sends
(and renews) after it, which its advert carries, when the plan's peers'
certificates end (the gate refuses senders past theirs), and the watch that
leaves once this peer's certificate has lapsed unrenewed."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from peer.config import JoinError, PeerConfig
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.tasks import every, wait_until
from protocol.trust.admission import CertificateError, check_certificate, hello_proof, issued_at, lifetime
from protocol.trust.run_records import RunRecords
from protocol.wire.gate import Gate
from protocol.wire.messages import Certificate

logger = logging.getLogger(__name__)

#: how long a peer in a private swarm waits for its admission certificate after its hello
CERT_WAIT_S = 20.0
#: seconds between looks at whether this peer's certificate has lapsed
WATCH_S = 1.0


def revoked(late: float) -> str:
    """Why a peer whose admission certificate ran out leaves (one line)."""
    return (
        f"this peer's admission certificate ran out {late:.0f} s ago, and the coordinator neither renewed it "
        f"nor answered a hello within {CERT_WAIT_S:.0f} s; every peer of the swarm refuses this one now"
    )


class Credentials:
    """This peer's standing in a private swarm (``config.swarm_secret``; in a public
    one it holds nothing and every step here passes)."""

    def __init__(self, config: PeerConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.run_id = config.run_id
        self.secret = config.swarm_secret
        self.pinned = config.coordinator_key
        self.clock = clock
        #: this peer's admission certificate, renewed by the coordinator
        self.certificate: dict[str, Any] | None = None
        self.certified_at = 0.0  # clock.now() when the last one came

    @property
    def private(self) -> bool:
        return bool(self.secret)

    def validators(self) -> list[RunRecords]:
        """The run's DHT rule on this peer's node (``protocol.trust.run_records``): the
        coordinator's record signed by the pinned key (unpinned: any claim, each under
        its signer's key), adverts by the peers they describe; in a private swarm (the
        token pins the key) with the coordinator's certificate."""
        return [RunRecords(self.run_id, self.pinned, private=bool(self.secret and self.pinned))]

    def proof(self, peer_id: str, key: str) -> str:
        """The hello's proof that this peer holds the swarm's secret ('' in a public swarm)."""
        return hello_proof(self.secret, self.run_id, peer_id, key) if self.secret else ""

    async def wait(self) -> None:
        """Wait (a private swarm: the DHT stores only adverts with one) for the admission
        certificate the coordinator sends after the hello; JoinError if none comes."""

        async def came() -> bool | None:
            return True if not self.secret or self.certificate is not None else None

        if await wait_until(came, CERT_WAIT_S, interval=0.05, clock=self.clock) is None:
            raise JoinError(f"the coordinator sent no admission certificate within {CERT_WAIT_S:.0f} s")

    def take(self, msg: Certificate, coordinator_key: str, me: str, coordinator: str, gate: Gate) -> None:
        """Keep this peer's renewed certificate (``me``: its peer id), and take when the
        planned peers' certificates end (the gate refuses senders past theirs)."""
        try:  # not against this machine's clock, which may be off: its lifetime is what counts
            check_certificate(msg.cert, coordinator_key, self.run_id, -math.inf)
        except CertificateError as exc:
            logger.warning("ignoring a certificate: %s", exc)
            return
        mine = msg.cert.get("peer_id") == me
        if mine and issued_at(msg.cert) >= issued_at(self.certificate or {}):  # never an older one
            self.certificate, self.certified_at = msg.cert, self.clock.now()
        for p, end in msg.expires.items():
            if p in gate.keys and p != coordinator and math.isfinite(end):
                gate.until[p] = end

    def forget(self) -> None:
        """Drop the certificate (a coordinator that comes back may have its clock set
        back: take its next one)."""
        self.certificate = None

    async def watch(
        self, hello: Callable[[], Awaitable[None]], paused: Callable[[], bool], revoke: Callable[[str], None]
    ) -> None:
        """Once this peer's certificate has gone a whole lifetime without renewal (and
        ``paused`` is false: the coordinator not lost), say ``hello`` again: the
        coordinator renews it, or answers why it no longer admits this peer. Neither
        within ``CERT_WAIT_S``: ``revoke`` (every peer refuses this one now)."""
        asked: float | None = None

        async def look() -> bool:
            nonlocal asked
            now = self.clock.now()
            if self.certificate is None or paused():  # the clock starts again
                self.certified_at, asked = now, None
                return False
            late = now - self.certified_at - lifetime(self.certificate)
            if late <= 0:
                asked = None
            elif asked is None:
                asked = now
                await hello()  # unreachable, or anything else: the wait decides (logged by ``every``)
            elif now - asked > CERT_WAIT_S:
                revoke(revoked(late))
                return True
            return False

        await every(WATCH_S, look, what="saying hello again for a certificate", clock=self.clock)
