"""Signed envelopes: how every message between FusionLLM processes travels.

A signed frame is ``MAGIC | u32 header length | JSON header | 64-byte Ed25519
signature | payload``. The signature covers the magic, the length and the header
bytes exactly as sent; the header carries the BLAKE3 digest of the payload, so
one signature covers everything. (BLAKE3 rather than SHA-256: a 4 MiB payload
hashes in about 0.7 ms instead of 2.3 ms here, which keeps signing and checking
under a tenth of the transfer time.) The header (an :class:`Envelope`) names the
protocol version, run, sender, kind, step, micro-batch, stage, the sender's
sequence number, the link codec, the tensors' metadata, the payload's size and
digest, and the message body.

A receiver's :class:`Gate` checks, in this order, and rejects with a
:class:`Reject` code: frame shape and sizes (before reading anything large),
envelope fields, version, run, that the named sender is the authenticated libp2p
sender and is admitted, the signature, the replay window, the message body, the
tensor metadata, the plan's expectations, and last the payload digest.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import json
import logging
import math
import struct
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.trust.identity import SIGNATURE_BYTES, Identity, IdentityError, public_key, verify
from protocol.trust.text import clean
from protocol.wire.encoding import MAX_HEADER_BYTES, Frame, WireError, all_finite, check_descriptions
from protocol.wire.messages import PROTOCOL_VERSION, Hello, Message
from protocol.wire.schema import MessageError, fields_of

logger = logging.getLogger(__name__)

MAGIC = b"FLS1"
HEAD = struct.Struct(">4sI")
#: fields every message class may have that the envelope itself carries
_ROUTING = ("run_id", "step", "mb", "stage", "epoch")


class Reject(enum.Enum):
    """Why a receiver dropped a message."""

    MALFORMED = "malformed"  # not a signed frame: bad magic, unreadable or non-object header
    TRUNCATED = "truncated"  # the frame ended before its announced header, signature or payload
    OVERSIZED = "oversized"  # header or payload larger than the receiver accepts (checked before reading it)
    BAD_ENVELOPE = "bad_envelope"  # an envelope field is missing or has the wrong type or range
    VERSION = "version"  # a protocol version this process does not speak
    WRONG_RUN = "wrong_run"  # the envelope names another run
    SENDER_MISMATCH = "sender_mismatch"  # the envelope names a sender other than the authenticated stream's peer
    NOT_ADMITTED = "not_admitted"  # the sender holds no admitted key for this run
    BAD_SIGNATURE = "bad_signature"  # the Ed25519 signature does not verify with the sender's admitted key
    REPLAY = "replay"  # a sequence number already seen, or older than the replay window
    UNKNOWN_KIND = "unknown_kind"  # a message kind this process does not know
    BAD_BODY = "bad_body"  # the message's fields are missing or of the wrong type
    BAD_TENSORS = "bad_tensors"  # tensor metadata inconsistent, or not the dtypes, shapes and codec the plan expects
    UNEXPECTED = "unexpected"  # a kind, step, micro-batch or stage the plan does not expect from this sender now
    BAD_DIGEST = "bad_digest"  # the payload does not match the signed digest
    STALE_EPOCH = "stale_epoch"  # sent for a plan epoch older than the receiver's (a peer that stalled or was replaced)
    NON_FINITE = "non_finite"  # decoded activations or gradients hold NaN or infinity (the sender is excluded)
    PROBE_LIMIT = "probe_limit"  # a bandwidth probe asking back more than it sent, or over the sender's budget
    BAD_ADVERT = "bad_advert"  # a DHT advert with non-finite or out-of-range claims or unparseable addresses
    MUTED = "muted"  # a stream from a sender muted for too many rejections, closed unread (counted, never logged each)
    EXPIRED = "expired"  # its admission certificate ended (not renewed: banned, or cut off from the coordinator)
    STREAMS = "streams"  # a stream over the sender's (or the receiver's) limit of open streams, closed unread


class Rejected(Exception):
    """A message was dropped; ``code`` says why, ``str()`` says it in one line."""

    def __init__(self, code: Reject, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Envelope:
    v: int
    run: str
    sender: str
    kind: str
    step: int
    mb: int
    stage: int
    seq: int
    codec: str
    values: list[Any]
    payload_bytes: int
    digest: str
    body: dict[str, Any]
    lanes: dict[str, Any] | None = None
    epoch: int = -1  # the plan epoch the message belongs to (-1: none, e.g. a hello)

    def header(self) -> dict[str, Any]:
        out = fields_of(self)
        if self.lanes is None:
            del out["lanes"]
        return out


_FIELD_TYPES = {f.name: typing.get_type_hints(Envelope)[f.name] for f in dataclasses.fields(Envelope)}


def _parse_envelope(header: Any) -> Envelope:
    if not isinstance(header, dict):
        raise Rejected(Reject.MALFORMED, "header is not a JSON object")
    kwargs: dict[str, Any] = {}
    for name, tp in _FIELD_TYPES.items():
        if name not in header:
            if name in ("lanes", "epoch"):
                continue
            raise Rejected(Reject.BAD_ENVELOPE, f"envelope lacks '{name}'")
        value = header[name]
        base = {int: int, str: str}.get(tp)
        if base is not None:
            ok = isinstance(value, base) and not isinstance(value, bool)
        elif name == "values":
            ok = isinstance(value, list)
        else:  # body, lanes
            ok = isinstance(value, dict) or (name == "lanes" and value is None)
        if not ok:
            raise Rejected(Reject.BAD_ENVELOPE, f"envelope field '{name}' has the wrong type")
        kwargs[name] = value
    env = Envelope(**kwargs)
    if env.payload_bytes < 0 or env.seq < 0 or min(env.step, env.mb, env.stage, env.epoch) < -1:
        raise Rejected(Reject.BAD_ENVELOPE, "a negative size, sequence number or index")
    if len(env.digest) != 64:
        raise Rejected(Reject.BAD_ENVELOPE, "digest is not 64 hex characters")
    return env


def routing(message: Message) -> tuple[str, int, int, int, int]:
    """(run, step, micro-batch, stage, epoch) of a message; -1 where it has no such field."""
    return (
        str(getattr(message, "run_id", "")),
        int(getattr(message, "step", -1)),
        int(getattr(message, "mb", -1)),
        int(getattr(message, "stage", -1)),
        int(getattr(message, "epoch", -1)),
    )


class Sealer:
    """Builds signed frames for one sender; sequence numbers start at the wall-clock
    microsecond, so a restarted sender never reuses one."""

    def __init__(self, identity: Identity, sender: str) -> None:
        self.identity = identity
        self.sender = sender
        self._seq = itertools.count(time.time_ns() // 1000)

    def seal(
        self,
        message: Message,
        descriptions: list[Any],
        chunks: list[memoryview],
        codec: str = "none",
        lanes: dict[str, Any] | None = None,
    ) -> tuple[bytes, int]:
        """The head of a signed frame (magic, length, header, signature) for ``message``
        with ``chunks`` as payload; returns (head, payload bytes)."""
        total = sum(len(c) for c in chunks)
        digest = blake3(max_threads=_threads(total))
        for c in chunks:
            digest.update(c)
        run, step, mb, stage, epoch = routing(message)
        body = {k: v for k, v in fields_of(message).items() if k not in _ROUTING}
        env = Envelope(
            PROTOCOL_VERSION,
            run,
            self.sender,
            message.KIND,
            step,
            mb,
            stage,
            next(self._seq),
            codec,
            descriptions,
            total,
            digest.hexdigest(),
            body,
            lanes,
            epoch,
        )
        data = json.dumps(env.header(), separators=(",", ":")).encode()
        if len(data) > MAX_HEADER_BYTES:
            raise WireError(f"header of {len(data)} bytes is over {MAX_HEADER_BYTES}")
        head = HEAD.pack(MAGIC, len(data)) + data
        return head + self.identity.sign(head), total


def _threads(nbytes: int) -> int:
    """BLAKE3 hashes big payloads on every core; small ones are not worth a thread."""
    return blake3.AUTO if nbytes >= 1 << 20 else 1


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
        if logged < LOG_BURST:
            more = f" ({quiet} more from this sender were not logged)" if quiet else ""
            logger.warning("rejected a message from %s: %s%s", clean(sender)[:80], clean(exc)[:300], more)
            logged, quiet = logged + 1, 0
        else:
            quiet += 1
        self._log_window[sender] = (start, logged, quiet)
        for listener in self.listeners:
            listener(sender, exc.code.value, exc.detail)

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
        if len(head) < HEAD.size:
            raise Rejected(Reject.TRUNCATED, "frame shorter than its head")
        magic, hlen = HEAD.unpack_from(head)
        if magic != MAGIC:
            raise Rejected(Reject.MALFORMED, f"bad magic {magic!r}: not a signed FusionLLM frame")
        if hlen > MAX_HEADER_BYTES:
            raise Rejected(Reject.OVERSIZED, f"header of {hlen} bytes is over {MAX_HEADER_BYTES}")
        if len(head) < HEAD.size + hlen + SIGNATURE_BYTES:
            raise Rejected(Reject.TRUNCATED, "frame ended inside its header or signature")
        signed = head[: HEAD.size + hlen]
        sig = head[HEAD.size + hlen : HEAD.size + hlen + SIGNATURE_BYTES]
        try:
            header = json.loads(signed[HEAD.size :])
        except (ValueError, UnicodeDecodeError) as exc:
            raise Rejected(Reject.MALFORMED, f"unreadable header: {exc}") from None
        env = _parse_envelope(header)
        if env.payload_bytes > self.max_payload:
            raise Rejected(Reject.OVERSIZED, f"payload of {env.payload_bytes} bytes is over {self.max_payload}")
        if env.v != PROTOCOL_VERSION:
            raise Rejected(Reject.VERSION, f"protocol version {env.v}, this process speaks {PROTOCOL_VERSION}")
        if env.run != self.run_id:
            raise Rejected(Reject.WRONG_RUN, f"run '{env.run[:64]}', expected '{self.run_id}'")
        if env.sender != sender:
            raise Rejected(Reject.SENDER_MISMATCH, f"envelope names {env.sender[:64]} but the stream is {sender}")
        key = self.keys.get(sender)
        hello = (key is None or self.expired(sender) is not None) and self.accept_hello and env.kind == Hello.KIND
        if key is not None and not hello:
            self.check_admitted(sender, env.kind)
        if hello:
            try:
                key = public_key(str(env.body.get("pubkey", "")))
            except IdentityError as exc:
                raise Rejected(Reject.BAD_BODY, f"hello: {exc}") from None
        if key is None:
            raise Rejected(Reject.NOT_ADMITTED, f"sender {sender} is not admitted to run '{self.run_id}'")
        if not verify(key, bytes(sig), bytes(signed)):
            raise Rejected(Reject.BAD_SIGNATURE, "the signature does not verify")
        if hello:  # the key signed it and libp2p authenticated the stream: bind the two
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
        self._windows.setdefault(sender, _Window(self.window)).check(env.seq)
        if 0 <= env.epoch < self.epoch:
            detail = f"{env.kind} of plan epoch {env.epoch}; this run is at epoch {self.epoch}"
            raise Rejected(Reject.STALE_EPOCH, detail)
        message = _message(env)
        try:
            check_descriptions(env.values, env.payload_bytes)
        except WireError as exc:
            raise Rejected(Reject.BAD_TENSORS, str(exc)) from None
        if env.lanes is not None:
            _check_lanes(env)
        if self.expect is not None:
            self.expect(env, message, sender)
        return env, message

    def check_payload(self, env: Envelope, payload: bytes | memoryview, sender: str) -> None:
        """Check the payload against the signed digest, then record the sequence number."""
        if len(payload) != env.payload_bytes:
            raise Rejected(Reject.TRUNCATED, f"payload of {len(payload)} bytes, announced {env.payload_bytes}")
        if blake3(payload, max_threads=_threads(len(payload))).hexdigest() != env.digest:
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


def lane_id(head: bytes) -> int | None:
    """The lane frame id a (rejected) frame's header announces, if readable."""
    try:
        header = json.loads(head[HEAD.size : len(head) - SIGNATURE_BYTES])
        value = header["lanes"]["id"]
    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def inline_payload(head: bytes) -> int | None:
    """How many payload bytes follow a rejected frame's head on its stream, if its
    header says so readably (0 when the payload travels on lanes)."""
    try:
        header = json.loads(head[HEAD.size : len(head) - SIGNATURE_BYTES])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    size = header.get("payload_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return None
    return 0 if header.get("lanes") is not None else size


def head_length(frame: bytes) -> int:
    """Bytes of a frame before its payload (needs the first 8 bytes)."""
    return HEAD.size + HEAD.unpack_from(frame)[1] + SIGNATURE_BYTES


def _message(env: Envelope) -> Message:
    header: dict[str, Any] = {**env.body, "kind": env.kind, "v": env.v}
    for name, value in zip(_ROUTING, (env.run, env.step, env.mb, env.stage, env.epoch), strict=True):
        header[name] = value
    try:
        return Message.from_header(header)
    except MessageError as exc:
        code = Reject.UNKNOWN_KIND if str(exc).startswith("unknown message kind") else Reject.BAD_BODY
        raise Rejected(code, str(exc)) from None


def _check_lanes(env: Envelope) -> None:
    lanes = env.lanes or {}
    sizes = lanes.get("bytes")
    if (
        not isinstance(lanes.get("id"), int)
        or not isinstance(sizes, list)
        or not 1 <= len(sizes) <= 16
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes)
        or sum(sizes) != env.payload_bytes
    ):
        raise Rejected(Reject.BAD_ENVELOPE, "malformed 'lanes'")


def match_values(descs: list[Any], expected: list[Any], codec: dict[str, Any] | None, gradients: bool = False) -> None:
    """Check received value descriptions against the plan's: the same structure,
    dtypes and shapes (dim 0 may be smaller: micro-batches of an uneven split), and
    floating tensors in the link's codec. In ``gradients`` a tensor may be absent
    (None) and only floating tensors are expected."""
    if len(descs) != len(expected):
        raise Rejected(Reject.BAD_TENSORS, f"{len(descs)} values, the plan expects {len(expected)}")
    for i, (got, want) in enumerate(zip(descs, expected, strict=True)):
        _match(got, want, codec, gradients, f"value {i}")


def _match(got: Any, want: Any, codec: dict[str, Any] | None, gradients: bool, where: str) -> None:
    if not isinstance(got, dict) or not isinstance(want, dict):
        raise Rejected(Reject.BAD_TENSORS, f"{where}: not a value description")
    kind = want.get("t")
    if gradients and got == {"t": "py", "v": None}:  # no gradient for this value
        return
    if gradients and kind != "tensor" and kind not in ("tuple", "list"):
        if got != {"t": "py", "v": None}:
            raise Rejected(Reject.BAD_TENSORS, f"{where}: a gradient for a non-tensor value")
        return
    if got.get("t") != kind:
        raise Rejected(Reject.BAD_TENSORS, f"{where}: a {str(got.get('t'))[:16]}, the plan expects a {kind}")
    if kind == "tensor":
        shape, plan_shape = got.get("shape"), want.get("shape")
        if got.get("dtype") != want.get("dtype") or not isinstance(shape, list) or len(shape) != len(plan_shape):
            raise Rejected(
                Reject.BAD_TENSORS,
                f"{where}: {str(got.get('dtype'))[:16]} {str(shape)[:64]}, the plan expects "
                f"{want.get('dtype')} {plan_shape}",
            )
        if shape[1:] != plan_shape[1:] or (shape and not 0 < shape[0] <= plan_shape[0]):
            raise Rejected(Reject.BAD_TENSORS, f"{where}: shape {str(shape)[:64]}, the plan expects {plan_shape}")
        floating = want.get("dtype") in ("float32", "float64", "float16", "bfloat16")
        wanted_codec = codec if floating and codec is not None and codec.get("name") != "none" else None
        if got.get("codec") != wanted_codec and math.prod(shape) > 0:
            raise Rejected(Reject.BAD_TENSORS, f"{where}: codec {got.get('codec')}, the plan says {wanted_codec}")
        return
    if kind in ("tuple", "list"):
        items, plan_items = got.get("items"), want.get("items")
        if not isinstance(items, list) or len(items) != len(plan_items):
            raise Rejected(Reject.BAD_TENSORS, f"{where}: a {kind} of another length than the plan's")
        for j, (g, w) in enumerate(zip(items, plan_items, strict=True)):
            _match(g, w, codec, gradients, f"{where}.{j}")
        return
    if got != want and kind != "size":
        raise Rejected(Reject.BAD_TENSORS, f"{where}: {str(got)[:64]}, the plan expects {str(want)[:64]}")


def describe(descs: list[Any]) -> list[Any]:
    """A plan's spec of values from their descriptions: sizes and codecs left out."""
    return [_strip(d) for d in descs]


def _strip(d: Any) -> Any:
    if isinstance(d, dict):
        if d.get("t") == "tensor":
            return {"t": "tensor", "dtype": d["dtype"], "shape": d["shape"]}
        if d.get("t") in ("tuple", "list"):
            return {"t": d["t"], "items": [_strip(x) for x in d["items"]]}
    return d


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
