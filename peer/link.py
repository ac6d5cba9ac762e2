"""A peer's link to its run's coordinator: finding its signed record in the DHT (the
pinned key, or the only claim, trusted on first use), the hello, heartbeats,
watching that it stays reachable and following its record (a re-shard of the adverts),
and reattaching when it comes back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from peer.admission import Credentials
from peer.config import JoinError, PeerConfig
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.records import read_records
from protocol.net.tasks import every, honour_cancel, wait_until
from protocol.net.transport import PeerUnreachable, Transport
from protocol.trust.identity import Identity, check_record, key_hex, public_key
from protocol.trust.run_records import FOLLOW_S, MAX_SHARDS
from protocol.trust.text import clean
from protocol.wire.messages import PROTOCOL_VERSION, Beat, CoordinatorRecord, Hello, PeerFailure
from protocol.wire.reassign import Resend

logger = logging.getLogger(__name__)

#: seconds between a serving peer's heartbeats
BEAT_S = 1.0
#: the coordinator counts as lost when it cannot be reached for this long
LOST_AFTER_S = 3.0
#: seconds between looks at the coordinator's connection
WATCH_S = 1.0
#: the longest a peer waits for its DHT to tell its addresses
MADDRS_TIMEOUT_S = 5.0
#: seconds between looks for the coordinator's record while joining
FIND_EVERY_S = 0.5
#: the most coordinator records of the run an unpinned peer reads at a look (one
#: claim is trusted on first use; more are refused however many)
MAX_CLAIMS = 16


class CoordinatorLink:
    """Who this peer works for (``record``, ``key``) and how to reach it."""

    def __init__(
        self,
        config: PeerConfig,
        dht: hivemind.DHT,
        transport: Transport,
        identity: Identity,
        credentials: Credentials,
        say: Callable[[str], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.dht = dht
        self.transport = transport
        self.identity = identity
        self.credentials = credentials
        self.say = say
        self.clock = clock
        self.record: CoordinatorRecord | None = None
        self.key: Any = None  # its Ed25519 key, pinned at the first contact (trust on first use)
        #: this peer's addresses as its DHT last told them (see ``visible_maddrs``)
        self.maddrs: list[str] = []
        #: lost and not back yet: heartbeats and the watches pause
        self.reattaching = False
        self._foreign: dict[str, object] = {}  # key (hex) -> the other protocol version its coordinator record speaks
        self._down_since: float | None = None

    @property
    def peer_id(self) -> str:
        assert self.record is not None
        return self.record.peer_id

    @property
    def shards(self) -> int:
        """How many shards the run's adverts are cut into, as the coordinator's record says."""
        return self.record.shards if self.record is not None else 1

    # ---------------------------------------------------------------- finding it
    async def find(self) -> None:
        """Find the run's coordinator: the one whose key is pinned (``--coordinator-key``),
        or, unpinned, the only one claiming the run (trusted on first use, and said so);
        then admit it and learn its addresses (frames of NAT'd peers come through it)."""
        self.record, self.key = await self._find()
        gate = self.transport.gate
        gate.admit(self.record.peer_id, self.key)
        self.transport.learn(self.record.peer_id, self.record.maddrs)
        self.transport.forwarder.forwarders = {self.record.peer_id}

    async def _find(self) -> tuple[CoordinatorRecord, Any]:
        run, pinned = self.config.run_id, self.config.coordinator_key
        others: set[str] = set()

        async def look() -> tuple[CoordinatorRecord, Any] | None:
            records = await self.records()
            if pinned:
                self._refuse_other_version(pinned, records)
                if pinned in records:
                    return records[pinned], public_key(pinned)
                others.update(records)
            elif len(records) == 1:
                ((hexkey, rec),) = records.items()
                self.say(
                    f"trusting the coordinator of run '{run}' on first use: key {hexkey} "
                    f"(pin it with --coordinator-key {hexkey})"
                )
                return rec, public_key(hexkey)
            elif len(records) > 1:
                keys = ", ".join(k[:16] + "..." for k in sorted(records))
                raise JoinError(
                    f"{len(records)} coordinators claim run '{run}' (keys {keys}); pass the "
                    "--coordinator-key that your coordinator printed"
                )
            return None

        found = await wait_until(look, self.config.join_timeout, interval=FIND_EVERY_S, clock=self.clock)
        if found is not None:
            return found
        if not pinned and len(self._foreign) == 1:  # unpinned: anyone may claim the run, so only at the end
            self._refuse_other_version(next(iter(self._foreign)), {})
        ignored = f" ({len(others)} other claims of the run ignored)" if others else ""
        whose = " signed by the pinned key" if pinned else ""
        raise JoinError(
            f"no coordinator{whose} for run '{run}' in the DHT after {self.config.join_timeout:.0f} s{ignored}"
        )

    def _refuse_other_version(self, key: str, records: dict[str, CoordinatorRecord]) -> None:
        """A JoinError if the coordinator of ``key`` claims the run, fresh, only in
        another protocol version than this peer's."""
        foreign = self._foreign
        if key not in records and key in foreign:
            raise JoinError(
                f"the coordinator of run '{self.config.run_id}' speaks protocol version {clean(str(foreign[key]))[:20]}"
                f"; this peer speaks {PROTOCOL_VERSION}: install the fusionllm version the coordinator runs"
            )

    def _note_version(self, signer: str, record: dict[str, Any]) -> None:
        """Remember a signed coordinator record of this run, fresh, in another protocol
        version (forget it once the signer speaks this peer's)."""
        version = record.get("v")
        if version == PROTOCOL_VERSION:
            self._foreign.pop(signer, None)
            return
        expires = record.get("expires_at")
        fresh = isinstance(expires, (int, float)) and expires > get_dht_time()
        if fresh and record.get("run_id") == self.config.run_id:
            self._foreign[signer] = version

    async def records(self) -> dict[str, CoordinatorRecord]:
        """The run's fresh, validly signed coordinator records in the DHT, by key (hex).
        Each coordinator stores its record under its own key, so an outsider's claim
        cannot hide the real one."""
        out = {}
        pinned = self.config.coordinator_key
        wanted = [pinned] if pinned else None  # unpinned: every claim, each under its signer's key
        found = await read_records(self.dht, self.config.run_id, "coordinator", wanted=wanted, limit=MAX_CLAIMS)
        for value in found.values():
            try:
                signer = key_hex(check_record(value))
                self._note_version(signer, value)
                rec = CoordinatorRecord.from_header(value)
            except Exception as exc:
                logger.debug("ignoring a bad coordinator record: %s", exc)
                continue
            fresh = isinstance(rec, CoordinatorRecord) and rec.expires_at > get_dht_time()
            if fresh and rec.run_id == self.config.run_id and 1 <= rec.shards <= MAX_SHARDS:
                out[signer] = rec
        return out

    @property
    def fingerprint(self) -> str:
        """The first 16 hex digits of the coordinator's key: who this peer works for."""
        return key_hex(self.key)[:16] if self.key is not None else "unknown"

    # ---------------------------------------------------------------- talking to it
    async def greet(self) -> tuple[float, float]:
        """The first hello (the coordinator answers probes of admitted peers only), then
        this peer's uplink and downlink to it (Mbit/s); JoinError if it does not admit
        this peer or cannot be reached."""
        try:
            await self.transport.send(self.peer_id, await self.hello_message(again=False))
            return await self.transport.measure_bandwidth(self.peer_id, self.config.bandwidth_probe_bytes)
        except (PeerUnreachable, ConnectionError, asyncio.IncompleteReadError) as exc:
            raise JoinError(
                f"the coordinator {self.peer_id} did not admit this peer or cannot be reached ({exc}); "
                "a private swarm admits only peers joined with its --token"
            ) from None

    async def hello(self, again: bool = True) -> None:
        """Say hello again: after an eviction or a lost coordinator (``again``: no stage
        held), or to have a lapsed certificate renewed (the stage still held)."""
        hello = await self.hello_message(again=again)
        await asyncio.wait_for(self.transport.send(self.peer_id, hello), 5)

    async def hello_message(self, again: bool) -> Hello:
        """Hello, with the proof that this peer holds a private swarm's secret (if given)."""
        key = self.identity.public_hex
        proof = self.credentials.proof(self.transport.peer_id, key)
        return Hello(self.config.run_id, key, again=again, proof=proof, maddrs=await self.visible_maddrs())

    async def visible_maddrs(self) -> list[str]:
        """This peer's addresses as its DHT sees them now (relayed ones appear later),
        awaited (hivemind's own call blocks the event loop until the DHT process
        answers), or as last told if it does not answer within ``MADDRS_TIMEOUT_S``."""
        ask = self.dht.run_coroutine(hivemind.DHT._get_visible_maddrs, return_future=True)
        try:
            self.maddrs = [str(m) for m in await asyncio.wait_for(ask, MADDRS_TIMEOUT_S)]
        except asyncio.TimeoutError:
            logger.warning("the DHT did not tell this peer's addresses within %.0f s", MADDRS_TIMEOUT_S)
        return self.maddrs

    async def report(self, failure: PeerFailure, evidence: list[Any] | None = None) -> None:
        """Tell the coordinator why this peer's epoch failed (if it can be reached within 30 s)."""
        try:
            await asyncio.wait_for(self.transport.send(self.peer_id, failure, evidence), 30)
        except (PeerUnreachable, asyncio.TimeoutError):
            pass

    async def ask_whole(self, run_id: str, epoch: int) -> None:
        """Ask the coordinator for the whole assignment of ``epoch`` (its ``Reassign`` builds
        on one this peer does not hold); unanswered, the coordinator's wait for this peer ends it."""
        try:
            await asyncio.wait_for(self.transport.send(self.peer_id, Resend(run_id, epoch)), 30)
        except (PeerUnreachable, asyncio.TimeoutError) as exc:
            logger.warning("could not ask for the whole assignment of epoch %d: %s", epoch, exc)

    async def beat(self, beat: Callable[[], Beat | None]) -> None:
        """Heartbeats (``beat()``; None: this peer is in no plan) while not reattaching:
        the coordinator's stall detector, which counts any bytes it receives from a peer.
        A beat is skipped when this peer sent the coordinator something else since the
        last one (a step report, a ready): a planned peer's own traffic is its heartbeat."""
        sent = self.transport.bytes_sent
        last = [sent.get(self.peer_id, 0)]  # bytes sent to the coordinator as of the last tick

        async def once() -> None:
            msg, now = beat(), sent.get(self.peer_id, 0)
            quiet, last[0] = now == last[0], now
            if msg is None or self.reattaching or not quiet:
                return
            await asyncio.wait_for(self.transport.send(self.peer_id, msg), 5)  # a failure: logged, next beat
            last[0] = sent.get(self.peer_id, 0)

        await every(BEAT_S, once, what="heartbeat", clock=self.clock)

    # ---------------------------------------------------------------- losing it
    async def watch(self, lost: Callable[[str], None]) -> None:
        """Tell ``lost`` once the coordinator's connection is gone and cannot be made
        again for ``LOST_AFTER_S`` (then pause until reattached); and read its record
        every ``FOLLOW_S`` (``follow``)."""
        await asyncio.gather(
            every(WATCH_S, lambda: self._look(lost), what="watching the coordinator", clock=self.clock),
            every(FOLLOW_S, lambda: self.follow(lost), what="reading the coordinator's record", clock=self.clock),
        )

    async def follow(self, lost: Callable[[str], None] | None = None) -> None:
        """Take the coordinator's newest record (the same coordinator's: a re-shard of the
        adverts), unless lost; a record of another libp2p node waits for ``reattach``. A
        record of a new start of the same node (``--resume``: it admits nobody yet) tells
        ``lost`` at once, so that this peer says hello again rather than being refused."""
        if self.reattaching or self.record is None:
            return
        rec = (await self.records()).get(key_hex(self.key))
        if rec is None or rec.peer_id != self.record.peer_id:
            return
        if rec.incarnation != self.record.incarnation:  # a stale copy of an earlier start is older
            if lost is not None and rec.expires_at > self.record.expires_at:
                self.reattaching = True
                lost("it restarted (its record names a new start of the same node)")
            return
        if rec.shards != self.record.shards:
            logger.info("the run's adverts are now cut into %d shard(s)", rec.shards)
        self.record = rec

    async def _look(self, lost: Callable[[str], None]) -> None:
        if self.reattaching:
            self._down_since = None
            return
        try:
            if self.peer_id not in await self.transport.connected():
                await asyncio.wait_for(self.transport.connect(self.peer_id), 2)
            self._down_since = None
        except Exception as exc:
            honour_cancel()
            logger.debug("the coordinator is unreachable: %s", exc)
            now = self.clock.now()
            if self._down_since is None:
                self._down_since = now
            if now - self._down_since >= LOST_AFTER_S:
                self.reattaching = True
                lost(f"its connection dropped and it cannot be reached for {now - self._down_since:.0f} s")

    async def reattach(self, grace: float, rejoined: Callable[[str], None]) -> bool:
        """Wait up to ``grace`` s for the coordinator's record (signed by the pinned key)
        to reappear and answer a hello; whether it did. ``rejoined`` is told its peer
        id once the record is taken, before the hello."""

        async def back() -> bool | None:
            try:
                rec = (await self.records()).get(key_hex(self.key))
                if rec is None:
                    return None
                self.record = rec
                self.transport.gate.admit(rec.peer_id, self.key)
                self.transport.learn(rec.peer_id, rec.maddrs)
                self.transport.forget(rec.peer_id)
                rejoined(rec.peer_id)
                await self.hello()
                return True
            except (PeerUnreachable, asyncio.TimeoutError, ConnectionError) as exc:
                logger.debug("reattaching failed: %s", exc)
                return None

        if await wait_until(back, grace, interval=1.0, clock=self.clock) is None:
            return False
        self.reattaching = False
        return True
