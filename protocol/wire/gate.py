"""A receiver's gate: the checks every incoming signed frame passes, in this order,
before anything else sees it, each failure a ``Reject`` code: frame shape and sizes
(before reading anything large), envelope fields, version, run, that the named
sender is the authenticated libp2p sender and is admitted, the signature, the replay
window, the message body, the tensor metadata, the plan's expectations, and last the
payload digest. It also counts and logs rejections (a few lines per sender), mutes
abusive senders, and reads what a signed frame held as evidence says."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.trust.identity import IdentityError, public_key, verify
from protocol.trust.text import clean
from protocol.wire.encoding import Frame, WireError, all_finite, check_descriptions
from protocol.wire.envelope import (
    Envelope,
    check_lanes,
    hash_threads,
    head_length,
    message_of,
    split_head,
)
from protocol.wire.hello_limits import HelloLimits
from protocol.wire.messages import PROTOCOL_VERSION, Hello, Message
from protocol.wire.reject import Reject, Rejected

logger = logging.getLogger(__name__)


class _Window:
    """Sequence numbers seen from one sender: the highest and the recent ones."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.high = -1
        self.seen: set[int] = set()

    def check(self, seq: int) -> None:
        if self.high >= 0 and seq <= self.high - self.size:
            raise Rejected(Reject.REPLAY, f"sequence number {seq} is older than the replay window")
        if seq in self.seen:
            raise Rejected(Reject.REPLAY, f"sequence number {seq} was already received")

    def commit(self, seq: int) -> None:
        self.seen.add(seq)
        self.high = max(self.high, seq)
        if len(self.seen) > 2 * self.size:
            self.seen = {s for s in self.seen if s > self.high - self.size}


@dataclass(frozen=True)
class Opened:
    """A message that passed every check."""

    envelope: Envelope
    message: Message


#: the plan's check of an admitted, correctly signed message; raises Rejected
Expectation = Callable[[Envelope, Message, str], None]


#: rejections logged per sender per window (the rest are counted, and said in the next line)
LOG_BURST = 5
LOG_WINDOW_S = 10.0
#: an abusive sender: more than MUTE_REJECTS rejections (stale-epoch ones aside, which an
#: honest peer sends after a re-plan) within MUTE_WINDOW_S get it muted for MUTE_S: every
#: stream it opens is closed unread, and counted as one MUTED rejection
MUTE_REJECTS = 200
MUTE_WINDOW_S = 10.0
MUTE_S = 60.0
#: per-sender tables hold at most this many senders (fresh identities: they start over)
MAX_SENDERS = 10_000
#: senders let in to probe at once without being admitted (``Gate.allow_probe``)
MAX_PROBERS = 64
#: the detail of a hello dropped unchecked, over its sender's limit (``hello_limits``; logged there)
HELLO_DROPPED = "a hello over its sender's limit, dropped unchecked"


class Gate:
    """A receiver's checks on incoming signed frames, and their tally."""

    def __init__(
        self, run_id: str, max_payload: int = 4 << 30, window: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.run_id = run_id
        self.clock = clock
        self.max_payload = max_payload
        self.window = window
        self.keys: dict[str, Ed25519PublicKey] = {}
        #: the keys of revoked senders (at most MAX_SENDERS, oldest dropped first): what they
        #: signed while admitted is still checked against them (a spot check's evidence)
        self.former: collections.OrderedDict[str, Ed25519PublicKey] = collections.OrderedDict()
        #: senders the coordinator let probe this receiver's bandwidth, not admitted (-> until, ``clock``)
        self.probers: dict[str, float] = {}
        #: sender -> when its admission certificate ends (wall-clock seconds; absent: it does not end)
        self.until: dict[str, float] = {}
        self.wall: Callable[[], float] = time.time
        #: the receiver's plan epoch: frames of an older one are refused (-1: no epochs yet)
        self.epoch = -1
        self.expect: Expectation | None = None
        #: admit a sender by its first message, a ``hello`` signed with the key it names
        self.accept_hello = False
        #: why a hello's sender may not be admitted ('' : it may), e.g. a private swarm's proof
        self.admission: Callable[[str, dict[str, Any]], str] | None = None
        #: senders whose hello ``admission`` refused (their probes are refused at once)
        self.refused: set[str] = set()
        #: hellos of unadmitted senders checked per sender and in all (the rest dropped unchecked)
        self.hellos = HelloLimits(clock=clock)
        #: a cheap test of an unadmitted sender's hello body, before its bucket is drawn on
        #: (a private swarm's coordinator: the proof of its secret); None: every hello passes
        self.proven: Callable[[str, dict[str, Any]], bool] | None = None
        self.counts: collections.Counter[Reject] = collections.Counter()
        self.recent: collections.deque[tuple[float, str, str, str]] = collections.deque(maxlen=200)
        #: called with (sender, code, detail) on every rejection, e.g. by the status page; a
        #: muted sender's refused streams are only counted: listeners hear once, when it is muted
        self.listeners: list[Callable[[str, str, str], None]] = []
        #: called with the sender when it gets muted (e.g. to disconnect it)
        self.on_mute: list[Callable[[str], None]] = []
        #: called with the sender when its hello admits it (e.g. to certify it)
        self.on_admit: list[Callable[[str], None]] = []
        self._windows: dict[str, _Window] = {}
        self._log_window: dict[str, tuple[float, int, int]] = {}  # sender -> (window start, logged, not logged)
        self._abuse: dict[str, tuple[float, int]] = {}  # sender -> (window start, rejections in it)
        self._muted: dict[str, tuple[float, int]] = {}  # sender -> (muted until, streams refused since)

    def admit(self, peer_id: str, key: Ed25519PublicKey) -> None:
        self.keys[peer_id] = key
        self.former.pop(peer_id, None)
        self.refused.discard(peer_id)

    def revoke(self, peer_id: str) -> None:
        """Refuse ``peer_id``'s messages from now on (until admitted again)."""
        key = self.keys.pop(peer_id, None)
        self.until.pop(peer_id, None)
        if key is not None:
            self.former[peer_id] = key
            self.former.move_to_end(peer_id)
            while len(self.former) > MAX_SENDERS:
                self.former.popitem(last=False)

    def signer_key(self, peer_id: str) -> Ed25519PublicKey | None:
        """The key ``peer_id`` signs with: its admitted one, else the one it had when it
        was revoked (frames it signed before a ban are still its own)."""
        return self.keys.get(peer_id) or self.former.get(peer_id)

    def expired(self, peer_id: str) -> float | None:
        """Seconds since ``peer_id``'s admission certificate ended, or None if it holds."""
        until = self.until.get(peer_id)
        late = self.wall() - until if until is not None else None
        return late if late is not None and late >= 0 else None

    def check_admitted(self, sender: str, what: str) -> None:
        """Raise ``Rejected`` unless ``sender`` is admitted now (``what`` names the message)."""
        if sender not in self.keys:
            raise Rejected(Reject.NOT_ADMITTED, f"{what} from {sender}, who is not admitted")
        late = self.expired(sender)
        if late is not None:
            raise Rejected(Reject.EXPIRED, f"{what} from {sender}, whose admission certificate ended {late:.0f} s ago")

    def allow_probe(self, peer_id: str, seconds: float) -> None:
        """Let ``peer_id`` probe this receiver's bandwidth for ``seconds`` though it is not
        admitted (the coordinator asked this receiver to answer its probe); at most
        ``MAX_PROBERS`` at once."""
        now = self.clock()
        self.probers = {p: t for p, t in self.probers.items() if t > now}
        if peer_id in self.probers or len(self.probers) < MAX_PROBERS:
            self.probers[peer_id] = now + seconds

    def may_probe(self, sender: str) -> bool:
        """Whether ``sender`` is admitted, or allowed to probe now (``allow_probe``)."""
        return sender in self.keys or self.probers.get(sender, 0.0) > self.clock()

    def check_prober(self, sender: str) -> None:
        """Raise ``Rejected`` unless ``sender`` may open a bandwidth probe now."""
        if self.probers.get(sender, 0.0) <= self.clock():
            self.check_admitted(sender, "a bandwidth probe")

    def reject(self, sender: str, exc: Rejected) -> None:
        """Count and log a rejection (the caller drops the message). The log takes at
        most ``LOG_BURST`` lines per sender per ``LOG_WINDOW_S``, control characters
        stripped; the rest are counted and said in the next line."""
        self.counts[exc.code] += 1
        self.recent.append((time.time(), sender, exc.code.value, exc.detail))
        now = self.clock()
        if exc.code is not Reject.STALE_EPOCH:
            if len(self._abuse) > MAX_SENDERS:
                self._abuse.clear()
            begun, n = self._abuse.get(sender, (now, 0))
            self._abuse[sender] = (begun, n + 1) if now - begun <= MUTE_WINDOW_S else (now, 1)
        if len(self._log_window) > MAX_SENDERS:  # many senders (fresh identities): start over
            self._log_window.clear()
        start, logged, quiet = self._log_window.get(sender, (now, 0, 0))
        if now - start > LOG_WINDOW_S:
            start, logged = now, 0
        if exc.detail == HELLO_DROPPED:  # counted; the limiter logs once per sender per period
            pass
        elif logged < LOG_BURST:
            more = f" ({quiet} more from this sender were not logged)" if quiet else ""
            logger.warning("rejected a message from %s: %s%s", clean(sender)[:80], clean(exc)[:300], more)
            logged, quiet = logged + 1, 0
        else:
            quiet += 1
        self._log_window[sender] = (start, logged, quiet)
        for listener in self.listeners:
            listener(sender, exc.code.value, exc.detail)

    def count_unblamed(self, sender: str, exc: Rejected, why: str) -> None:
        """Count a rejection that proves nothing against ``sender`` (``why``): the listeners
        (the status page) hear of it as of any other; nothing is held against the sender."""
        self.counts[exc.code] += 1
        for listener in self.listeners:
            listener(sender, exc.code.value, f"{exc.detail} ({why})")

    def muted(self, sender: str) -> bool:
        """Whether ``sender``'s streams are to be closed unread: it is muted, or its
        rejections just crossed ``MUTE_REJECTS`` in ``MUTE_WINDOW_S``, which mutes it for
        ``MUTE_S`` (one log line, one event for the listeners, and ``on_mute``)."""
        now = self.clock()
        if sender in self._muted:
            until, refused = self._muted[sender]
            if now < until:
                return True
            del self._muted[sender]
            logger.info("%s is no longer muted (%d streams were refused while it was)", clean(sender)[:80], refused)
        begun, n = self._abuse.get(sender, (now, 0))
        if n <= MUTE_REJECTS or now - begun > MUTE_WINDOW_S:
            return False
        self._abuse.pop(sender, None)
        if len(self._muted) >= MAX_SENDERS:
            self._muted = {s: m for s, m in self._muted.items() if m[0] > now}
            if len(self._muted) >= MAX_SENDERS:  # that many abusive identities at once: start over
                self._muted.clear()
        self._muted[sender] = (now + MUTE_S, 0)
        detail = f"{n} rejected messages within {MUTE_WINDOW_S:.0f} s: its streams are closed unread for {MUTE_S:.0f} s"
        logger.warning(
            "muting %s until %s: %s",
            clean(sender)[:80],
            time.strftime("%H:%M:%S", time.localtime(time.time() + MUTE_S)),
            detail,
        )
        for listener in self.listeners:
            listener(sender, Reject.MUTED.value, detail)
        for callback in self.on_mute:
            callback(sender)
        return True

    def refuse_stream(self, sender: str) -> bool:
        """Whether a new stream from ``sender`` is to be closed unread because it is muted;
        each such stream is counted as a ``MUTED`` rejection (nothing else: no log line,
        no event)."""
        if not self.muted(sender):
            return False
        self.counts[Reject.MUTED] += 1
        until, refused = self._muted[sender]
        self._muted[sender] = (until, refused + 1)
        return True

    def check_head(self, head: bytes, sender: str) -> tuple[Envelope, Message]:
        """Check everything but the payload's digest; ``head`` is magic, length,
        header and signature."""
        signed, sig, env = split_head(head)
        if env.payload_bytes > self.max_payload:
            raise Rejected(Reject.OVERSIZED, f"payload of {env.payload_bytes} bytes is over {self.max_payload}")
        if env.v != PROTOCOL_VERSION:
            raise Rejected(Reject.VERSION, f"protocol version {env.v}, this process speaks {PROTOCOL_VERSION}")
        if env.run != self.run_id:
            raise Rejected(Reject.WRONG_RUN, f"run '{env.run[:64]}', expected '{self.run_id}'")
        if env.sender != sender:
            raise Rejected(Reject.SENDER_MISMATCH, f"envelope names {env.sender[:64]} but the stream is {sender}")
        key, hello = self._signer(env, sender)
        if not verify(key, bytes(sig), bytes(signed)):
            raise Rejected(Reject.BAD_SIGNATURE, "the signature does not verify")
        if hello:  # the key signed it and libp2p authenticated the stream: bind the two
            self._bind(env, sender, key)
        self._windows.setdefault(sender, _Window(self.window)).check(env.seq)
        if 0 <= env.epoch < self.epoch:
            detail = f"{env.kind} of plan epoch {env.epoch}; this run is at epoch {self.epoch}"
            raise Rejected(Reject.STALE_EPOCH, detail)
        message = message_of(env)
        try:
            check_descriptions(env.values, env.payload_bytes)
        except WireError as exc:
            raise Rejected(Reject.BAD_TENSORS, str(exc)) from None
        if env.lanes is not None:
            check_lanes(env)
        if self.expect is not None:
            self.expect(env, message, sender)
        return env, message

    def _signer(self, env: Envelope, sender: str) -> tuple[Ed25519PublicKey, bool]:
        """The key ``sender``'s frame must verify with, and whether the frame is a hello
        that names it (a sender not admitted, or whose certificate ended, where hellos
        are accepted)."""
        key = self.keys.get(sender)
        hello = (key is None or self.expired(sender) is not None) and self.accept_hello and env.kind == Hello.KIND
        if key is not None and not hello:
            self.check_admitted(sender, env.kind)
        if hello:
            proven = self.proven is None or self.proven(sender, env.body)
            if not self.hellos.allow(sender, proven):  # before any expensive work: no parse, no signature check
                raise Rejected(Reject.NOT_ADMITTED, HELLO_DROPPED)
            try:
                key = public_key(str(env.body.get("pubkey", "")))
            except IdentityError as exc:
                raise Rejected(Reject.BAD_BODY, f"hello: {exc}") from None
        if key is None:
            raise Rejected(Reject.NOT_ADMITTED, f"sender {sender} is not admitted to run '{self.run_id}'")
        return key, hello

    def _bind(self, env: Envelope, sender: str, key: Ed25519PublicKey) -> None:
        """Admit the sender of a signed hello with its key, unless ``admission`` refuses it."""
        why = self.admission(sender, env.body) if self.admission is not None else ""
        if why:
            if len(self.refused) > 10_000:
                self.refused.clear()
            self.refused.add(sender)
            raise Rejected(Reject.NOT_ADMITTED, why)
        self.admit(sender, key)
        self.until.pop(sender, None)
        for listener in self.on_admit:
            listener(sender)

    def check_payload(self, env: Envelope, payload: bytes | memoryview, sender: str, digest: str | None = None) -> None:
        """Check the payload against the signed digest (``digest``: its BLAKE3 hex digest,
        computed as it arrived; else hashed now), then record the sequence number."""
        if len(payload) != env.payload_bytes:
            raise Rejected(Reject.TRUNCATED, f"payload of {len(payload)} bytes, announced {env.payload_bytes}")
        if digest is None:
            digest = blake3(payload, max_threads=hash_threads(len(payload))).hexdigest()
        if digest != env.digest:
            raise Rejected(Reject.BAD_DIGEST, "the payload does not match its signed digest")
        self._windows.setdefault(sender, _Window(self.window)).commit(env.seq)

    def open(self, frame: bytes, sender: str) -> Opened:
        """Check a whole frame held in memory (no lanes)."""
        env, message = self.check_head(frame, sender)
        start = head_length(frame)
        if env.lanes is not None:
            raise Rejected(Reject.BAD_ENVELOPE, "a frame in memory cannot have lanes")
        payload = memoryview(frame)[start:]
        self.check_payload(env, payload, sender)
        return Opened(env, message)


def signed_frame(
    run_id: str, sender: str, key: Ed25519PublicKey | None, evidence: Sequence[Any]
) -> tuple[Message, list[Any]] | None:
    """The message and values of ``evidence`` (a signed head and its payload, as two
    uint8 tensors) if it is a frame that ``sender`` signed with ``key`` for this run;
    else None. What a frame says about its sender, no one else can forge."""
    if key is None or len(evidence) != 2:
        return None
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in evidence):
        return None
    head, payload = evidence[0].numpy().tobytes(), memoryview(bytearray(evidence[1].numpy().tobytes()))
    gate = Gate(run_id)
    gate.admit(sender, key)
    try:
        env, message = gate.check_head(head, sender)
        gate.check_payload(env, payload, sender)
        return message, Frame({"values": env.values}, payload).values()
    except (Rejected, WireError, ValueError, TypeError):
        return None


def poisoned_frame(run_id: str, sender: str, key: Ed25519PublicKey | None, evidence: list[Any]) -> bool:
    """Whether ``evidence`` is a frame ``sender`` signed (``signed_frame``) whose tensors
    hold NaN or infinity: proof of poison, which a reporter cannot forge about an
    honest peer."""
    found = signed_frame(run_id, sender, key, evidence)
    return found is not None and not all(all_finite(v) for v in found[1])
