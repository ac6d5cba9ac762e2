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

from protocol.trust.identity import Identity, IdentityError, check_record, key_hex, public_key, sign_record

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


#: how long an admission certificate holds (``coordinator --cert-ttl``); the coordinator renews every
#: ``RENEWALS_PER_TTL``-th of it (slack for a busy coordinator or a slow link), so a peer it stops renewing
#: (banned or excluded) is refused everywhere within this time, and leaves when it sees it
CERT_TTL_S = 60.0
MIN_CERT_TTL_S = 15.0
MAX_CERT_TTL_S = 24 * 3600.0
RENEWALS_PER_TTL = 6
#: the longest one renewal may take to reach its peer (its share of the period, within these bounds)
RENEWAL_SEND_S = (2.0, 15.0)


class CertificateError(ValueError):
    """A certificate that does not admit its holder; ``str()`` says why in one line."""


def issue_certificate(
    coordinator: Identity, run: str, peer_id: str, pubkey: str, now: float, ttl: float = CERT_TTL_S
) -> dict[str, Any]:
    """The coordinator's signed word that ``peer_id`` (holding ``pubkey``) is admitted
    to ``run`` until ``now + ttl`` (wall-clock seconds, as DHT times are)."""
    body = {"kind": "cert", "run": run, "peer_id": peer_id, "subject": pubkey, "issued_at": now}
    return sign_record(coordinator, {**body, "expires_at": now + bounded_ttl(ttl)})


def bounded_ttl(seconds: float) -> float:
    """A certificate's lifetime as issuers give it and holders take it."""
    return min(max(seconds, MIN_CERT_TTL_S), MAX_CERT_TTL_S)


def renewal_period(ttl: float) -> float:
    """How often the coordinator renews certificates of lifetime ``ttl``."""
    return bounded_ttl(ttl) / RENEWALS_PER_TTL


def renewal_send_s(ttl: float) -> float:
    """How long one renewal may take to reach its peer: half a renewal period, bounded."""
    low, high = RENEWAL_SEND_S
    return min(max(renewal_period(ttl) / 2, low), high)


def lifetime(cert: dict[str, Any]) -> float:
    """How long a (checked) certificate holds from its issue: measured on the issuer's
    clock, so it is the same on a holder whose clock is off."""
    issued, expires = _seconds(cert.get("issued_at")), _seconds(cert.get("expires_at"))
    if issued is None or expires is None:
        return CERT_TTL_S
    return bounded_ttl(expires - issued)


def issued_at(cert: dict[str, Any]) -> float:
    """When (on the issuer's clock) ``cert`` was issued; -inf if it does not say."""
    issued = _seconds(cert.get("issued_at"))
    return -math.inf if issued is None else issued


def _seconds(value: object) -> float | None:
    """``value`` as a finite number of seconds, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


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
    expires = _seconds(cert.get("expires_at"))
    if expires is None or expires <= now:
        why = "it names no expiry" if expires is None else f"it expired {now - expires:.0f} s ago"
        raise CertificateError(f"an expired admission certificate ({why})")
    return cert
