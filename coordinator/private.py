"""Who the coordinator admits: in a private swarm, only peers whose hello proves they
hold the swarm's secret (``protocol.trust.admission``); in any swarm, nobody on the ban
list. Both live in the run directory, so the host changes them with the CLI while
the coordinator runs (``fusionllm token --rotate``, ``fusionllm ban``), and a
resumed coordinator keeps them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from protocol.trust.admission import SECRET_BYTES, Token, new_secret, proof_ok

SECRET_FILE = "swarm.secret"
BAN_FILE = "banned.txt"


class Admission:
    """The admission rule of one run directory (files re-read when they change)."""

    def __init__(self, run_dir: Path, run_id: str, private: bool) -> None:
        self.run_dir, self.run_id, self.private = run_dir, run_id, private
        self._cache: dict[str, tuple[float, Any]] = {}
        if private and not (run_dir / SECRET_FILE).exists():
            write_secret(run_dir)

    def check(self, sender: str, hello: dict[str, Any]) -> str:
        """Why the sender of ``hello`` may not be admitted ('' when it may): banned by
        peer id or key, or (private) no proof of the current secret."""
        key = str(hello.get("pubkey"))
        banned = self.banned()
        if sender in banned or key in banned:
            return f"{sender} is banned from run '{self.run_id}'"
        if not self.private:
            return ""
        secret = self.secret()
        if not secret:
            return (
                f"the swarm's secret in {self.run_dir / SECRET_FILE} is damaged: nobody is admitted until it is fixed"
            )
        if not proof_ok(secret, self.run_id, sender, key, hello.get("proof")):
            return "a private swarm: the hello does not prove the swarm's secret (join with its current --token)"
        return ""

    def secret(self) -> str:
        """The swarm's secret ('' when the file is missing or damaged: admits nobody)."""
        return self._read(SECRET_FILE, _secret) or ""

    def banned(self) -> frozenset[str]:
        """The ban list's entries: peer ids and public keys (hex)."""
        return self._read(BAN_FILE, _peer_ids) or frozenset()

    def banned_among(self, keys: dict[str, str]) -> set[str]:
        """Which of ``keys`` (peer id -> public key, hex) the ban list names, by id or key."""
        banned = self.banned()
        return {p for p, key in keys.items() if p in banned or key in banned}

    def token(self, key_hex: str, maddrs: list[str]) -> str:
        return Token(self.run_id, key_hex, self.secret(), maddrs).encode()

    def _read(self, name: str, parse: Any) -> Any:
        path = self.run_dir / name
        try:
            mtime = path.stat().st_mtime_ns
            cached = self._cache.get(name)
            if cached is None or cached[0] != mtime:
                cached = (mtime, parse(path.read_text(errors="replace")))
                self._cache[name] = cached
        except OSError:
            return None
        return cached[1]


def write_secret(run_dir: Path) -> None:
    """A new swarm secret (tokens made before stop admitting new peers)."""
    path = run_dir / SECRET_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    os.replace(tmp, path)


def ban(run_dir: Path, peer_ids: list[str]) -> None:
    with open(run_dir / BAN_FILE, "a") as f:
        f.writelines(f"{p}\n" for p in peer_ids)


def _secret(text: str) -> str:
    text = text.strip()
    try:
        return text if len(bytes.fromhex(text)) == SECRET_BYTES else ""
    except ValueError:
        return ""


def _peer_ids(text: str) -> frozenset[str]:
    return frozenset(line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip())
