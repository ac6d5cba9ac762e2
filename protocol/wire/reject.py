"""Why a receiver drops a message: one code per reason, and the exception that
carries it with a one-line detail."""

from __future__ import annotations

import enum


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
