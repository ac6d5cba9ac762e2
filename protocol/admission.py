"""Private swarms: a join token (the coordinator's key, the swarm's secret, the run
and where to join, in one paste) and the proof a peer's hello carries that it
holds the secret, without sending it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from protocol.identity import IdentityError, key_hex, public_key

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
