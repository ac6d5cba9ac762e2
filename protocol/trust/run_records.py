"""A run's DHT rule, a hivemind record validator on every node of the swarm, public
or private: under each of the run's keys only records signed by the identity their
subkey names are stored or believed (the coordinator's record by the key the join
line pins, each advert by the peer it describes; in a private swarm that peer must
also hold the coordinator's admission certificate). A plain value, an unsigned or
wrongly signed record, one stored under another's subkey, another run's record
and an oversized one are refused on every node. Refusals are counted and said in
one line per period (``Tally``), never one line each."""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.trust.admission import CertificateError, check_certificate
from protocol.trust.identity import IdentityError, check_record
from protocol.wire.messages import dht_key

logger = logging.getLogger(__name__)

#: the largest record a run's key takes (an advert with its certificate and a dozen
#: addresses is under 2 KiB): what a poll reads is at most this times its record limit
MAX_RECORD_BYTES = 16 << 10
#: seconds between two lines about refused records (of one sender, where it is known)
LOG_PERIOD_S = 60.0
#: the most senders a ``Tally`` tells apart in one period; the rest are counted together
MAX_SENDERS = 1024
#: hivemind's subkeys of a regular value and of a whole dictionary (never a signer's)
_RESERVED = (MSGPackSerializer.dumps(None), b"")

#: a rule's extra check of a record that names its signer: why it is refused, or None
Check = Callable[["RunRecords", dict[str, Any], str], "str | None"]


class Tally:
    """Counts bad things per sender and says when a line is due: the first of each
    sender in a period (at most ``MAX_SENDERS`` told apart; the others share one)."""

    def __init__(self, period: float = LOG_PERIOD_S, clock: Clock = SYSTEM_CLOCK) -> None:
        self.period, self.clock = period, clock
        self.total = 0
        self._counts: Counter[str] = Counter()  # sender -> count since its last line
        self._said: dict[str, float] = {}  # sender -> when its last line was said

    def note(self, sender: str) -> int | None:
        """Count one for ``sender``; how many since its last line if a line is due now."""
        self.total += 1
        now = self.clock.now()
        if len(self._said) >= MAX_SENDERS and sender not in self._said:
            self._said = {s: t for s, t in self._said.items() if now - t < self.period}
            if len(self._said) >= MAX_SENDERS:
                sender = "others"
        self._counts[sender] += 1
        last = self._said.get(sender)
        if last is not None and now - last < self.period:
            return None
        self._said[sender] = now
        return self._counts.pop(sender)


def _coordinator(rules: RunRecords, value: dict[str, Any], signer: str) -> str | None:
    if rules.coordinator_key and signer != rules.coordinator_key:
        return "a coordinator record not signed by the run's coordinator"
    return None


def _advert(rules: RunRecords, value: dict[str, Any], signer: str) -> str | None:
    if not isinstance(value.get("peer_id"), str):
        return "an advert naming no peer"
    if not rules.private:
        return None
    try:
        cert = check_certificate(value.get("cert"), rules.coordinator_key or "", rules.run, -math.inf)
    except CertificateError as exc:
        return str(exc)
    if cert["subject"] != signer or cert["peer_id"] != value["peer_id"]:
        return "an advert with someone else's admission certificate"
    return None


#: the run's DHT keys: name -> (the kind of record stored there, its extra check, whether
#: its subkey also names the peer the record describes). Each record is stored under its
#: signer's key (hex) as its subkey, or ``<key>/<peer id>`` where peers on one machine may
#: share an identity (``join``'s default key file) and must not hide each other's
#: records. A new key is a new row
RULES: dict[str, tuple[str, Check, bool]] = {
    "coordinator": ("coordinator", _coordinator, False),
    "adverts": ("advert", _advert, True),
}
#: the keys cut into shards as a swarm grows: ``<name>/<i>`` for ``i < MAX_SHARDS`` is
#: ruled by ``name``'s row (a node sees only a key's hash, so every shard a run may use
#: is named here, and none past them: a key per peer could not be checked)
SHARDED = frozenset({"adverts"})
#: the most shards of one key (a run's shard count is at most this: ``discovery_cost``)
MAX_SHARDS = 1024
#: seconds within which a serving peer reads the coordinator's record again and so
#: follows a re-shard (the coordinator reads the old shards too for twice this)
FOLLOW_S = 30.0


def shard_name(name: str, shard: int) -> str:
    """The name of shard ``shard`` of the run's sharded key ``name`` (``dht_key``'s ``what``)."""
    if name not in SHARDED or not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"no shard {shard} of the run's key {name!r}")
    return f"{name}/{shard}"


def shard_of(peer_id: str, shards: int) -> int:
    """The shard (``0 <= i < shards``) that ``peer_id``'s records go to when the run cuts
    its key into ``shards``: a stable hash of the id, the same on every node."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"a shard count of {shards!r} (1 to {MAX_SHARDS})")
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % shards


def rule_of(name: str) -> str:
    """The row of ``RULES`` that rules the run's key ``name`` (a shard's: its key's)."""
    return name.split("/", 1)[0]


def record_subkey(name: str, signer: str, peer_id: object = None) -> str:
    """The subkey a record under the run's key ``name``, signed by ``signer`` (hex) and
    describing ``peer_id``, is stored under (the only one every node takes for it)."""
    return f"{signer}/{peer_id}" if RULES[rule_of(name)][2] else signer


class RunRecords(RecordValidatorBase):
    """The rule of ``run``'s keys (``RULES``) on one DHT node. ``coordinator_key``: the
    coordinator's key (hex) where this node knows it (the coordinator itself, a peer
    whose join line pins it); None (a peer trusting on first use) takes any signer's
    claim of the run, each under its own subkey, so that no claim hides another.
    Every shard of a sharded key (``SHARDED``) is ruled as its key.
    ``private``: adverts must carry the coordinator's admission certificate. (Expiry is
    the coordinator's business, not the DHT's: a record stored while valid stays
    readable.) Runs in the DHT's own process: its counts are that process's."""

    def __init__(
        self, run: str, coordinator_key: str | None, private: bool = False, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        super().__init__()
        if private and not coordinator_key:
            raise ValueError("a private swarm's rule needs the coordinator's key")
        self.run, self.coordinator_key, self.private = run, coordinator_key, private
        names = [*RULES, *(shard_name(n, i) for n in sorted(SHARDED) for i in range(MAX_SHARDS))]
        self._names = {DHTID.generate(source=dht_key(run, name)).to_bytes(): rule_of(name) for name in names}
        self.dropped = 0
        #: per key name: why records were refused since its last line
        self.reasons: dict[str, Counter[str]] = {name: Counter() for name in RULES}
        self._tally = Tally(LOG_PERIOD_S, clock)

    def validate(self, record: DHTRecord) -> bool:
        name = self._names.get(record.key)
        if name is None:
            return True  # another run's key, or not FusionLLM's
        why = self.problem(name, record)
        if why is None:
            return True
        self._refused(name, why)
        return False

    def problem(self, name: str, record: DHTRecord) -> str | None:
        """Why ``record`` under the run's key ``name`` is refused (None: it is taken).
        The cheap checks come first; a signature is verified last."""
        if len(record.value) > MAX_RECORD_BYTES:
            return f"a record over {MAX_RECORD_BYTES} bytes"
        if record.subkey in _RESERVED:
            return "a plain value (not a signed record under its signer's subkey)"
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except Exception:  # anything unreadable is not the run's
            return "an unreadable record"
        kind, check, _ = RULES[name]
        if not isinstance(value, dict) or value.get("kind") != kind:
            return f"not a record of kind {kind!r}"
        signer = value.get("pubkey")
        if not isinstance(signer, str) or subkey != record_subkey(name, signer, value.get("peer_id")):
            return "a record under a subkey other than its signer's key (and peer id)"
        if value.get("run_id") != self.run:
            return "another run's record"
        why = check(self, value, signer)
        if why is not None:
            return why
        try:
            check_record(value)
        except IdentityError:
            return "an unsigned or wrongly signed record"
        return None

    def _refused(self, name: str, why: str) -> None:
        """Count a refusal; one line per period says them all (the sender is not known here)."""
        self.dropped += 1
        reasons = self.reasons[name]
        reasons[why] += 1
        count = self._tally.note(name)
        if count is not None:
            whys = "; ".join(f"{n} {w}" for w, n in reasons.most_common(4))
            logger.warning(
                "refused %d DHT record(s) under %s since the last such line: %s",
                count,
                dht_key(self.run, name),
                whys,
            )
            reasons.clear()
