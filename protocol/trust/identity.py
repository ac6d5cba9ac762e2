"""Ed25519 identities: a key per peer and per coordinator, kept in a file.

The public key travels as 64 hex characters. A key file is created on first use
with mode 0600 and refused when others can read it (as ssh refuses such keys).

Keys are read and written with ``cryptography``; signing and checking go through
libsodium (``nacl``): the same Ed25519 signatures, made in 20 us and checked in 52
where OpenSSL took 31 and 103 on this machine, and every frame's head is signed
once and checked once on the data path's critical path. libsodium also refuses
non-canonical signatures and small-order keys.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import CryptoError

SIGNATURE_BYTES = 64


class IdentityError(ValueError):
    """A key file or public key that cannot be used; ``str()`` says why in one line."""


class Identity:
    """A private Ed25519 key and its public half."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        seed = key.private_bytes_raw()
        self._secret = crypto_sign_seed_keypair(seed)[1]  # libsodium's form of the same key
        self.public_key = key.public_key()
        self.public_hex = self.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_option(cls, path: str | None) -> Identity:
        """The identity in ``path``, or a fresh one for this process when None."""
        return cls.load_or_create(path) if path else cls.generate()

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """The identity in ``path``; a new one is written there (mode 0600) if it does not exist."""
        p = Path(path)
        if not p.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            p.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another process created it meanwhile
                return cls.load_or_create(p)
            except OSError as exc:
                raise IdentityError(f"cannot create identity file {p}: {exc.strerror}") from None
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            return cls(key)
        try:
            mode = p.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise IdentityError(f"identity file {p} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
            key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        except IdentityError:
            raise
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {p}: {exc.strerror}") from None
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"identity file {p} is not a PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"identity file {p} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        """The Ed25519 signature of ``data`` (64 bytes)."""
        return crypto_sign(bytes(data), self._secret)[:SIGNATURE_BYTES]


def public_key(hex_key: str) -> Ed25519PublicKey:
    """Parse a public key from its 64 hex characters."""
    try:
        raw = bytes.fromhex(hex_key)
        if len(raw) != 32:
            raise ValueError(f"{len(raw)} bytes")
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"not an Ed25519 public key: {exc}") from None


def key_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def verify(key: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is ``key``'s Ed25519 signature of ``data``."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        crypto_sign_open(bytes(signature) + bytes(data), key.public_bytes_raw())
        return True
    except CryptoError:
        return False


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a record's signature covers: its JSON with sorted keys, no spaces,
    the ``sig`` field left out."""
    body = {k: v for k, v in record.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_record(identity: Identity, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``pubkey`` set and ``sig`` over its canonical bytes."""
    out = {**record, "pubkey": identity.public_hex}
    out["sig"] = identity.sign(canonical(out)).hex()
    return out


def check_record(record: dict[str, Any]) -> Ed25519PublicKey:
    """The record's public key if its ``sig`` verifies; raises IdentityError otherwise."""
    key = public_key(str(record.get("pubkey", "")))
    sig = record.get("sig")
    try:
        raw = bytes.fromhex(sig) if isinstance(sig, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != SIGNATURE_BYTES or not verify(key, raw, canonical(record)):
        raise IdentityError("the record's signature does not verify")
    return key
