"""How many hellos a receiver takes from senders it has not admitted: a token bucket
per sender (the libp2p peer id the stream authenticated), in a table of bounded size,
and one bucket for all of them together. A hello over either is dropped before any
expensive work (no signature check, no admission check, no log line of its own): the
refusal costs less than the attack. The drops are logged once per sender per
``LOG_EVERY_S``, with their count.

The table cannot grow without bound: it holds at most ``max_senders`` senders;
when it is full, those whose buckets have refilled (idle senders, who lose nothing)
are dropped, and if none has, a new sender gets no bucket of its own and is refused
until room is made. So fresh identities buy an attacker no fresh burst, and the shared
bucket bounds the checks per second whatever the number of identities.

Where the receiver can tell a member's hello cheaply (a private swarm: the hello's
proof of the swarm's secret, one HMAC), hellos without that proof draw on a small
shared bucket of their own: a flood of them from any number of identities leaves the
members' bucket untouched, so an honest newcomer with the token still gets in."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from protocol.trust.text import clean

logger = logging.getLogger(__name__)

#: per sender: hellos a second, and the burst (an honest peer says hello on joining and
#: again after losing the coordinator or its certificate: a few a minute at most)
HELLO_RATE = 0.5
HELLO_BURST = 4.0
#: all unadmitted senders together
TOTAL_RATE = 100.0
TOTAL_BURST = 200.0
#: all unadmitted senders together whose hellos lack a private swarm's proof (each
#: checked is refused and told why: a member who forgot --token learns it)
UNPROVEN_RATE = 10.0
UNPROVEN_BURST = 20.0
MAX_SENDERS = 10_000
#: dropped hellos are logged at most once per sender per this many seconds
LOG_EVERY_S = 60.0


class Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``burst`` held."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.burst


class HelloLimits:
    """Whether a hello from an unadmitted sender may be checked now (``allow``)."""

    def __init__(
        self,
        rate: float = HELLO_RATE,
        burst: float = HELLO_BURST,
        total_rate: float = TOTAL_RATE,
        total_burst: float = TOTAL_BURST,
        max_senders: int = MAX_SENDERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.burst, self.max_senders, self.clock = rate, burst, max_senders, clock
        self.total = Bucket(total_rate, total_burst, clock())
        self.unproven = Bucket(UNPROVEN_RATE, UNPROVEN_BURST, clock())
        self.buckets: collections.OrderedDict[str, Bucket] = collections.OrderedDict()
        self.dropped = 0  # hellos dropped, in all
        self._drops: dict[str, tuple[float, int]] = {}  # sender -> (last logged, dropped since)
        self._swept = {"buckets": -float("inf"), "drops": -float("inf")}  # when each table was last swept

    def allow(self, sender: str, proven: bool = True) -> bool:
        """Take a token for ``sender``'s hello; False: drop it unchecked. A hello not
        ``proven`` (a private swarm's, without a valid proof) draws on the unproven bucket."""
        now = self.clock()
        bucket = self.buckets.get(sender)
        if bucket is None:
            bucket = self._new(sender, now)
        else:
            self.buckets.move_to_end(sender)
        if bucket is not None and bucket.take(now) and (self.total if proven else self.unproven).take(now):
            return True
        self.dropped += 1
        self._note_drop(sender, now)
        return False

    def _new(self, sender: str, now: float) -> Bucket | None:
        if len(self.buckets) >= self.max_senders:
            if not self._sweep("buckets", now, self.burst / self.rate):
                return None
            for idle in [s for s, b in self.buckets.items() if b.full(now)]:
                del self.buckets[idle]
            if len(self.buckets) >= self.max_senders:
                return None
        bucket = self.buckets[sender] = Bucket(self.rate, self.burst, now)
        return bucket

    def _sweep(self, table: str, now: float, every: float) -> bool:
        """Whether a full ``table`` may be swept now: once per ``every`` seconds at most, so
        a full table costs a flood of new senders one pass per period, not one each."""
        if now - self._swept[table] < every:
            return False
        self._swept[table] = now
        return True

    def _note_drop(self, sender: str, now: float) -> None:
        """Log the drops of ``sender`` once per ``LOG_EVERY_S`` (the table bounded as the buckets are)."""
        last, n = self._drops.get(sender, (-float("inf"), 0))
        if now - last < LOG_EVERY_S:
            self._drops[sender] = (last, n + 1)
            return
        if len(self._drops) >= self.max_senders:
            if self._sweep("drops", now, LOG_EVERY_S):
                self._drops = {s: d for s, d in self._drops.items() if now - d[0] < LOG_EVERY_S}
            if len(self._drops) >= self.max_senders:
                return  # that many senders within a period: their lines wait for room
        more = f" ({n} more since the last line)" if n else ""
        logger.warning("dropping hellos from %s: over %.1f a second%s", clean(sender)[:80], self.rate, more)
        self._drops[sender] = (now, 0)
