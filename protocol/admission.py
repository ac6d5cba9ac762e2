"""Private swarms: a join token (the coordinator's key, the swarm's secret, the run
and where to join, in one paste) and the proof a peer's hello carries that it
holds the secret, without sending it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol.identity import Identity, IdentityError, check_record, key_hex, public_key, sign_record
from protocol.messages import dht_key

#: bytes of a swarm secret
SECRET_BYTES = 32
_PREFIX = "flt1."


class TokenError(ValueError):
    """A join token that cannot be used; ``str()`` is one line."""


@dataclass(frozen=True)
class Token:
    run: str
    coordinator_key: str  # Ed25519 public key, hex
    secret: str  # hex
    maddrs: list[str]  # where to join the DHT

    def encode(self) -> str:
        body = json.dumps({"r": self.run, "k": self.coordinator_key, "s": self.secret, "p": self.maddrs})
        return _PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def parse_token(text: str) -> Token:
    """The token a private coordinator printed; a one-line error otherwise."""
    text = text.strip()
    if not text.startswith(_PREFIX) or len(text) > 16_384:
        raise TokenError("not a FusionLLM join token (it starts with 'flt1.')")
    try:
        raw = text[len(_PREFIX) :]
        body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        token = Token(str(body["r"]), str(body["k"]), str(body["s"]), [str(m) for m in body["p"]])
        key = key_hex(public_key(token.coordinator_key))
        if len(bytes.fromhex(token.secret)) != SECRET_BYTES or not token.maddrs:
            raise ValueError("secret or addresses missing")
    except (ValueError, KeyError, TypeError, IdentityError) as exc:
        raise TokenError(f"the join token is damaged ({type(exc).__name__}); copy it again in full") from None
    return Token(token.run, key, token.secret, token.maddrs)


def hello_proof(secret: str, run: str, peer_id: str, pubkey: str) -> str:
    """What a hello carries to show its sender holds the swarm's secret: an HMAC of who
    it is, bound to the run (useless for any other peer id or key)."""
    return hmac.new(bytes.fromhex(secret), f"{run}|{peer_id}|{pubkey}".encode(), hashlib.sha256).hexdigest()


def proof_ok(secret: str, run: str, peer_id: str, pubkey: str, proof: object) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(hello_proof(secret, run, peer_id, pubkey), proof)


#: how long an admission certificate holds; the coordinator renews every sixth of it (slack for a busy
#: coordinator or a slow link), so a peer it stops renewing (banned, excluded, or cut off from it) is
#: refused everywhere within this time
CERT_TTL_S = 60.0
RENEW_EVERY_S = CERT_TTL_S / 6


class CertificateError(ValueError):
    """A certificate that does not admit its holder; ``str()`` says why in one line."""


def issue_certificate(coordinator: Identity, run: str, peer_id: str, pubkey: str, now: float) -> dict[str, Any]:
    """The coordinator's signed word that ``peer_id`` (holding ``pubkey``) is admitted
    to ``run`` until ``now + CERT_TTL_S`` (wall-clock seconds, as DHT times are)."""
    body = {"kind": "cert", "run": run, "peer_id": peer_id, "subject": pubkey, "expires_at": now + CERT_TTL_S}
    return sign_record(coordinator, body)


def check_certificate(cert: object, coordinator_key: str, run: str, now: float) -> dict[str, Any]:
    """``cert`` if the coordinator holding ``coordinator_key`` signed it for ``run`` and
    it has not expired; ``CertificateError`` (one line) otherwise."""
    if not isinstance(cert, dict) or cert.get("kind") != "cert":
        raise CertificateError("no admission certificate")
    try:
        signer = key_hex(check_record(cert))
    except IdentityError:
        raise CertificateError("a forged admission certificate (its signature does not verify)") from None
    if signer != coordinator_key:
        raise CertificateError("an admission certificate signed by someone other than the run's coordinator")
    if cert.get("run") != run or not isinstance(cert.get("peer_id"), str) or not isinstance(cert.get("subject"), str):
        raise CertificateError("an admission certificate for another run")
    expires = cert.get("expires_at")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or expires <= now:
        raise CertificateError(f"an expired admission certificate ({_ago(expires, now)})")
    return cert


def _ago(expires: object, now: float) -> str:
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        return f"it expired {now - float(expires):.0f} s ago"
    return "it names no expiry"


class RunRecords(RecordValidatorBase):
    """A private swarm's DHT rule, on every node of the swarm: the run's coordinator
    record must be signed by the coordinator's key, and each advert by a peer whose
    admission certificate (in the advert) that coordinator signed for its key. An
    outsider's records for the run are not stored, and a node's answer holding one
    is not believed. (Expiry is the coordinator's business, not the DHT's: a record
    stored while valid must stay readable.)"""

    def __init__(self, run: str, coordinator_key: str) -> None:
        super().__init__()
        self.run, self.coordinator_key = run, coordinator_key
        self._adverts = DHTID.generate(source=dht_key(run, "adverts")).to_bytes()
        self._coordinator = DHTID.generate(source=dht_key(run, "coordinator")).to_bytes()
        self.dropped = 0

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._adverts, self._coordinator):
            return True  # another run's, or not FusionLLM's
        try:
            value = MSGPackSerializer.loads(record.value)
            signer = key_hex(check_record(value))
            if record.key == self._coordinator:
                ok = signer == self.coordinator_key
            else:
                cert = check_certificate(value.get("cert"), self.coordinator_key, self.run, -math.inf)
                subkey = MSGPackSerializer.loads(record.subkey)
                ok = cert["subject"] == signer and cert["peer_id"] == value.get("peer_id") == subkey
        except Exception:  # anything unreadable is not the run's
            ok = False
        self.dropped += not ok
        return ok
