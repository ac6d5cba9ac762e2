"""The coordinator's side of admission: who may join (a private swarm's secret, the ban
list), the admission certificates it issues and renews, bans enforced while the run
goes on, and telling a refused peer why.

The rule lives in the run directory (:class:`AccessRules`), so the host changes it
with the CLI while the coordinator runs (``fusionllm token --rotate``, ``fusionllm
ban``), and a resumed coordinator keeps it. In a private swarm only peers whose hello
proves the swarm's secret (``protocol.trust.admission``) are admitted; in any swarm,
nobody on the ban list. :class:`Admission` applies it to the coordinator's gate."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.roster import Endpoint, Roster
from coordinator.runstate import BANNED, EXCLUDED
from coordinator.status import StatusBoard
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.tasks import cancel_all, every
from protocol.net.transport import PeerUnreachable
from protocol.trust.admission import (
    SECRET_BYTES,
    Token,
    issue_certificate,
    new_secret,
    proof_ok,
    renewal_period,
    renewal_send_s,
)
from protocol.trust.identity import key_hex
from protocol.wire.gate import Gate
from protocol.wire.messages import NOT_ADMITTED, Abort, Certificate

SECRET_FILE = "swarm.secret"
BAN_FILE = "banned.txt"
TELL_EVERY_S = 60.0  # a refused sender is told why at most this often
logger = logging.getLogger(__name__)


class AccessRules:
    """The admission rule of one run directory (files re-read when they change)."""

    def __init__(self, run_dir: Path, run_id: str, private: bool) -> None:
        self.run_dir, self.run_id, self.private = run_dir, run_id, private
        self._cache: dict[str, tuple[float, Any]] = {}

    @classmethod
    def open(cls, run_dir: Path, run_id: str, private: bool) -> AccessRules:
        """The rule of ``run_dir``; a private swarm's secret is made there if it has none."""
        if private and not (run_dir / SECRET_FILE).exists():
            write_secret(run_dir)
        return cls(run_dir, run_id, private)

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

    def proven(self, sender: str, hello: dict[str, Any]) -> bool:
        """Whether ``hello`` proves the private swarm's current secret (one HMAC, before
        the hello's signature is checked; a public swarm's: all). The gate draws unproven
        hellos from a bucket of their own (``protocol.wire.hello_limits``)."""
        if not self.private:
            return True
        return proof_ok(self.secret(), self.run_id, sender, str(hello.get("pubkey")), hello.get("proof"))

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


def is_private(run_dir: Path, private: bool) -> bool:
    """Whether the swarm of ``run_dir`` is private: asked to be, or resumed from a
    private one (its secret is in the run directory)."""
    return private or (run_dir / SECRET_FILE).exists()


def _secret(text: str) -> str:
    text = text.strip()
    try:
        return text if len(bytes.fromhex(text)) == SECRET_BYTES else ""
    except ValueError:
        return ""


def _peer_ids(text: str) -> frozenset[str]:
    return frozenset(line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip())


class Admission:
    """Admits hellos by the run directory's rule, certifies the admitted (renewing their
    certificates while they stay), enforces bans, and tells the refused why."""

    def __init__(
        self,
        config: CoordinatorConfig,
        gate: Gate,
        board: StatusBoard,
        endpoint: Endpoint,
        roster: Roster,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config, self.gate, self.board = config, gate, board
        self.endpoint, self.roster, self.clock = endpoint, roster, clock
        self.rules: AccessRules | None = None
        self.banned: set[str] = set()  # peers the host banned during this run (each lost for that reason)
        self._told: dict[str, float] = {}  # refused senders -> when they were told why
        self._tasks: set[asyncio.Task[Any]] = set()  # certifying, telling, renewing

    @property
    def private(self) -> bool:
        return self.rules is not None and self.rules.private

    def open(self, run_dir: Path) -> None:
        """Read the rule of ``run_dir`` (a resumed private swarm stays private)."""
        self.rules = AccessRules.open(run_dir, self.config.run_id, is_private(run_dir, self.config.private))

    def start(self) -> None:
        """Certify each peer the gate admits, and renew certificates every renewal period."""
        self.gate.on_admit.append(lambda peer: self._spawn(self.certify([peer])))
        period = renewal_period(self.config.cert_ttl)
        self._spawn(every(period, self._renew, what="renewing certificates", clock=self.clock, level=logging.WARNING))

    async def aclose(self, timeout: float) -> None:
        await cancel_all(self._tasks, timeout)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def check(self, sender: str, hello: dict[str, Any]) -> str:
        """Why a hello's sender is not admitted ('' : it is): excluded from this run (for
        what it sent), banned, or no proof of a private swarm's secret. The refused are told."""
        lost = self.roster.lost().get(sender, "")
        if lost.startswith(EXCLUDED):
            why = f"{sender} was {lost[:200]}"
        else:
            assert self.rules is not None
            why = self.rules.check(sender, hello)
        if why:
            self.tell_refused(sender, why)
        return why

    def token(self, maddrs: list[str]) -> str:
        """A private swarm's join token: where to join, the coordinator's key and the secret."""
        assert self.rules is not None and self.endpoint.identity is not None
        return self.rules.token(self.endpoint.identity.public_hex, maddrs)

    async def certify(self, peers: list[str]) -> None:
        """Issue ``peers`` fresh admission certificates (their senders are refused past
        the end of the last one), and send each its own with when the planned peers of its
        neighbourhood's end (for its gate)."""
        assert self.endpoint.identity is not None
        now, run_id, ttl = time.time(), self.config.run_id, self.config.cert_ttl
        certs = {}
        for p in peers:
            key = self.gate.keys.get(p)
            if key is not None:
                certs[p] = issue_certificate(self.endpoint.identity, run_id, p, key_hex(key), now, ttl)
                self.gate.until[p] = certs[p]["expires_at"]
        # each planned peer's gate admits its neighbourhood only: when those end, not the whole plan's
        # (a message that grew with the plan, over a frame's cap from ~15,000 planned peers)
        near = self.roster.neighbourhoods()
        ends = {p: {q: self.gate.until[q] for q in near.get(p, []) if q in self.gate.until} for p in certs}
        await asyncio.gather(*(self._send_certificate(p, Certificate(run_id, c, ends[p])) for p, c in certs.items()))

    async def _send_certificate(self, peer: str, msg: Certificate) -> None:
        assert self.endpoint.transport is not None
        try:
            await asyncio.wait_for(self.endpoint.transport.send(peer, msg), renewal_send_s(self.config.cert_ttl))
        except (PeerUnreachable, asyncio.TimeoutError) as exc:  # it may be gone; its certificate runs out
            logger.debug("could not send %s its certificate: %s", peer, exc)

    async def _renew(self) -> None:
        """Renew the certificates of the peers still admitted (not banned, not excluded):
        one that is not renewed is refused everywhere once its certificate ends."""
        assert self.endpoint.transport is not None
        me, excluded = self.endpoint.transport.peer_id, self.roster.excluded()
        await self.certify([p for p in self.gate.keys if p != me and p not in excluded])

    async def enforce_bans(self) -> None:
        """Banned peers (by id or key) lose their admission at once; a planned one is
        dropped from the run for good (its stage is recovered like a failed peer's) once
        it has been told why: the recovery forgets its streams, which would cut the word."""
        assert self.rules is not None
        transport = self.endpoint.transport
        me = transport.peer_id if transport is not None else ""
        known = {p: key_hex(k) for p, k in self.gate.keys.items() if p != me}
        hit = self.rules.banned_among(known)
        telling = []
        self.banned |= hit
        for p in hit:
            self.gate.revoke(p)
            self.board.event("failure", f"peer {p} is banned by the swarm's host")
            telling.append(self.tell_refused(p, f"{p} is banned from run '{self.config.run_id}' by the swarm's host"))
        await asyncio.gather(*(t for t in telling if t is not None))  # each bounded by _abort_quietly
        dropped = (hit | self.rules.banned()) & self.roster.planned()  # the plan may have changed meanwhile
        self.banned |= dropped
        for p in dropped:
            self.roster.fail(p, BANNED)

    def tell_refused(self, sender: str, why: str) -> asyncio.Task[None] | None:
        """Say why a hello was refused (at most once a minute per sender): a peer coming
        back after a token rotation or a ban leaves with the reason instead of waiting.
        Returns the sending task (None when not told again)."""
        now = self.clock.now()
        if sender in self._told and now - self._told[sender] < TELL_EVERY_S or self.endpoint.transport is None:
            return None
        if len(self._told) > 10_000:
            self._told.clear()
        self._told[sender] = now
        return self._spawn(self._abort_quietly(sender, why))

    async def _abort_quietly(self, sender: str, why: str) -> None:
        assert self.endpoint.transport is not None
        abort = Abort(self.config.run_id, NOT_ADMITTED + why)
        try:
            await asyncio.wait_for(self.endpoint.transport.send(sender, abort), 10)
        except Exception as exc:  # it may be gone already
            logger.debug("could not tell %s why it was refused: %s", sender, exc)
