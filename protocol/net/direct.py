"""The direct data path: frames between two peers that can dial each other travel
over a plain TCP connection instead of through both p2p daemons.

libp2p keeps discovery, NAT traversal and the control plane; through it, a frame
crosses two Unix sockets and two daemons' copies each way, and carried a sixth of
what one TCP socket does on loopback. A direct stream opens so:

1. The sender asks the receiver for a ticket over libp2p (``OFFER_PROTOCOL``: both
   ends authenticated by libp2p's handshake). An admitted, unmuted sender gets the
   receiver's direct port, a ticket id and a 32-byte secret, valid once within
   ``TICKET_TTL_S``; anyone else gets a refusal.
2. The sender dials that port at the addresses it knows for the receiver. The
   receiver speaks first: a fresh challenge. The sender answers with the ticket id
   and BLAKE3 keyed with the secret over the challenge; the receiver, with the same
   keyed hash over the challenge and that answer. Neither end sends the secret, so
   an address that leads somewhere else learns nothing it could use.
3. The stream then goes to the protocol's handler as if it had come over libp2p,
   from the ticket's peer: every frame is still signed and checked by the gate.

What it gives up is libp2p's encryption: an observer on the path sees the frames
(not able to alter them unseen). ``--data-path libp2p`` keeps everything in libp2p.
A dial that fails leaves the peer on libp2p for ``RETRY_S``. A refused ticket (the
receiver has not admitted us yet: a greeting, a probe before the plan) for
``REFUSED_RETRY_S``, doubled at each refusal in a row up to ``REFUSED_RETRY_MAX_S``: an
admission comes soon after a hello, and a stream that opened over libp2p meanwhile moves
onto the direct path at its next write once a ticket is granted (``protocol.net.upgrade``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from types import SimpleNamespace

from blake3 import blake3
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from protocol.net.direct_io import Streams, connect, serve
from protocol.net.handlers import Handler

logger = logging.getLogger(__name__)

OFFER_PROTOCOL = "/fusionllm/direct/1"
MAGIC = b"FLD1"
TICKET_ID_BYTES = 16
SECRET_BYTES = 32
CHALLENGE_BYTES = 16
MAC_BYTES = 32
OFFER = struct.Struct(f">BH{TICKET_ID_BYTES}s{SECRET_BYTES}s")  # granted, port, ticket id, secret
ANSWER = struct.Struct(f">4s{TICKET_ID_BYTES}sB{MAC_BYTES}s")  # magic, ticket id, protocol index, mac
TICKET_TTL_S = 30.0
MAX_TICKETS_PER_PEER = 16
MAX_UNPROVEN = 64  # connections that have not yet answered their challenge
HANDSHAKE_S = 5.0  # each step of a direct stream's opening
RETRY_S = 300.0
REFUSED_RETRY_S = 0.5
REFUSED_RETRY_MAX_S = 60.0

#: asks the receiver for a ticket over libp2p: the raw ``OFFER`` bytes
AskTicket = Callable[[str], Awaitable[bytes]]


def mac(secret: bytes, *parts: bytes) -> bytes:
    """BLAKE3 keyed with a ticket's secret over ``parts``."""
    h = blake3(key=secret)
    for p in parts:
        h.update(p)
    return h.digest(MAC_BYTES)


def answer_mac(secret: bytes, challenge: bytes, ticket: bytes, index: int) -> bytes:
    """The dialler's answer: over the challenge, the ticket id and the protocol it asks
    for (a relay cannot turn a message stream into a lane stream)."""
    return mac(secret, b"answer", challenge, ticket, bytes([index]))


def ip_hosts(maddrs: Iterable[str]) -> list[str]:
    """The IP addresses in ``maddrs`` (``/ip4|ip6/ADDR/tcp/...``), in order, once each."""
    out: list[str] = []
    for text in maddrs:
        try:
            m = Multiaddr(str(text))
        except Exception:
            continue
        for proto in ("ip4", "ip6"):
            try:
                ip = m.value_for_protocol(proto)
            except Exception:
                continue
            if ip and ip not in out and ip not in ("0.0.0.0", "::"):
                out.append(ip)
    return out


class Direct:
    """This process's direct listener (tickets, challenges, handing streams to the
    handlers) and its dialler. ``protocols``: those that may travel direct, in the
    order their index goes on the wire; ``admitted(peer)``: whether a peer may have
    a ticket now."""

    def __init__(
        self, protocols: list[str], admitted: Callable[[str], bool], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.protocols = protocols
        self.admitted = admitted
        self.allowed = True  # False: ``--data-path libp2p`` (no ticket granted or asked for)
        self.listening = True  # False: no one can dial this process (behind a NAT): no ticket granted
        #: whether a peer is worth dialling (the coordinator: only those its dial-back reached)
        self.dialable: Callable[[str], bool] = lambda peer: True
        self.clock = clock
        self.port = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._handlers: dict[str, Handler] = {}
        self._tickets: dict[bytes, tuple[str, bytes, float]] = {}  # id -> (peer, secret, expires)
        self._incoming: dict[str, set[asyncio.StreamWriter]] = {}
        self._unproven = 0
        self._retry: dict[str, float] = {}  # peer -> when a direct stream may be tried again
        self._refusals: dict[str, int] = {}  # peer -> tickets it refused in a row
        self._denied: dict[str, float] = {}  # peer -> until when it gets no ticket (``demote``)

    # the receiver's side

    async def listen(self, hosts: list[str], handlers: dict[str, Handler]) -> None:
        """Listen on one port at each of ``hosts`` that this machine has (others are skipped)."""
        self._handlers = handlers
        for host in hosts:
            try:
                server = await serve(host, self.port, self._accept)
            except OSError as exc:
                logger.debug("no direct listener at %s:%d: %s", host, self.port, exc)
                continue
            self.port = self.port or server.sockets[0].getsockname()[1]
            self._servers.append(server)

    async def grant(self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``OFFER_PROTOCOL``'s libp2p handler: a ticket for an admitted sender, a refusal otherwise."""
        sender = info.peer_id.to_base58()  # type: ignore[attr-defined]
        try:
            denied = self._denied.get(sender, 0.0) > self.clock()
            if denied or not (self.allowed and self.listening and self._servers and self.admitted(sender)):
                writer.write(OFFER.pack(0, 0, bytes(TICKET_ID_BYTES), bytes(SECRET_BYTES)))
            else:
                ticket, secret = self._issue(sender)
                writer.write(OFFER.pack(1, self.port, ticket, secret))
            await writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            pass
        finally:
            writer.close()

    def _issue(self, peer: str) -> tuple[bytes, bytes]:
        now = self.clock()
        for tid in [t for t, (_, _, until) in self._tickets.items() if until < now]:
            del self._tickets[tid]
        mine = [t for t, (p, _, _) in self._tickets.items() if p == peer]
        for tid in mine[: max(0, len(mine) - MAX_TICKETS_PER_PEER + 1)]:
            del self._tickets[tid]
        ticket, secret = secrets.token_bytes(TICKET_ID_BYTES), secrets.token_bytes(SECRET_BYTES)
        self._tickets[ticket] = (peer, secret, now + TICKET_TTL_S)
        return ticket, secret

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unproven >= MAX_UNPROVEN:
            writer.close()
            return
        self._unproven += 1
        try:
            proven = await self._challenge(reader, writer)
        finally:
            self._unproven -= 1
        if proven is None:
            writer.close()
            return
        sender, protocol = proven
        self._incoming.setdefault(sender, set()).add(writer)
        try:
            await self._handlers[protocol](
                SimpleNamespace(peer_id=PeerID.from_base58(sender), direct=True), reader, writer
            )
        finally:
            mine = self._incoming.get(sender, set())
            mine.discard(writer)
            if not mine:
                self._incoming.pop(sender, None)
            writer.close()

    async def _challenge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, str] | None:
        """(sender, protocol) once the dialler answers its challenge with a live ticket; else None."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            writer.write(challenge)
            raw = await asyncio.wait_for(reader.readexactly(ANSWER.size), HANDSHAKE_S)
            magic, ticket, index, answer = ANSWER.unpack(raw)
            entry = self._tickets.pop(ticket, None)  # used once, whatever the answer
            if magic != MAGIC or entry is None or index >= len(self.protocols):
                return None
            peer, secret, until = entry
            if until < self.clock() or not hmac.compare_digest(answer, answer_mac(secret, challenge, ticket, index)):
                return None
            if self.protocols[index] not in self._handlers:
                return None
            writer.write(mac(secret, challenge, answer))
            return peer, self.protocols[index]
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, RuntimeError):
            return None  # uvloop raises RuntimeError writing to a connection the other end reset

    def demote(self, peer: str) -> None:
        """``peer``'s direct streams carried bytes that no signature proves came from it:
        closed, and no ticket for ``RETRY_S`` (libp2p, encrypted, meanwhile)."""
        self._denied[peer] = self.clock() + RETRY_S
        self.cut(peer)

    def cut(self, peer: str) -> None:
        """Close every direct stream ``peer`` holds to us (it was just muted)."""
        for writer in self._incoming.pop(peer, set()):
            writer.close()

    # the sender's side

    def worth_trying(self, peer: str, protocol: str) -> bool:
        return (
            self.allowed
            and protocol in self.protocols
            and self._retry.get(peer, 0.0) <= self.clock()
            and self.dialable(peer)
        )

    async def open(self, peer: str, protocol: str, maddrs: Iterable[str], ask: AskTicket) -> Streams | None:
        """A direct stream to ``peer`` for ``protocol``, or None (use libp2p) where it has
        no ticket for us or none of its addresses answers as it."""
        hosts = ip_hosts(maddrs)
        if not hosts or not self.worth_trying(peer, protocol):
            return None
        try:
            granted, port, ticket, secret = OFFER.unpack(await asyncio.wait_for(ask(peer), HANDSHAKE_S))
        except Exception as exc:  # noqa: BLE001 - any failure to get a ticket means libp2p
            logger.debug("no direct ticket from %s: %s", peer, exc)
            granted = 0
        if not granted:
            refusals = self._refusals[peer] = self._refusals.get(peer, 0) + 1
            self._retry[peer] = self.clock() + min(REFUSED_RETRY_S * 2 ** (refusals - 1), REFUSED_RETRY_MAX_S)
            return None
        self._refusals.pop(peer, None)
        streams = await self._dial(hosts, port, ticket, secret, self.protocols.index(protocol))
        if streams is None:
            logger.debug("no direct stream to %s at %s port %d: libp2p for %.0f s", peer, hosts, port, RETRY_S)
            self._retry[peer] = self.clock() + RETRY_S
        return streams

    async def _dial(self, hosts: list[str], port: int, ticket: bytes, secret: bytes, index: int) -> Streams | None:
        """Dial every one of ``hosts`` at once (a firewall that drops the dial, or an address
        that leads somewhere silent, costs ``HANDSHAKE_S`` once, not once per address); the
        first to prove it gave the ticket wins, the rest are closed."""
        tasks = [asyncio.ensure_future(self._attempt(h, port, ticket, secret, index)) for h in hosts]
        won: Streams | None = None
        try:
            for arrived in asyncio.as_completed(tasks):
                won = await arrived
                if won is not None:
                    break
        finally:
            for task in tasks:
                task.cancel()
            for late in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(late, tuple) and late is not won:
                    late[1].close()
        return won

    async def _attempt(self, host: str, port: int, ticket: bytes, secret: bytes, index: int) -> Streams | None:
        try:
            reader, writer = await asyncio.wait_for(connect(host, port), HANDSHAKE_S)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            logger.debug("direct dial to %s:%d failed: %s", host, port, exc)
            return None
        proven = False
        try:
            proven = await self._prove(reader, writer, ticket, secret, index)
        finally:  # also when a faster address won and this attempt was cancelled
            if not proven:
                writer.close()
        return (reader, writer) if proven else None

    async def _prove(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ticket: bytes, secret: bytes, index: int
    ) -> bool:
        """Whether the other end, given our answer to its challenge, proves it gave the ticket."""
        try:
            challenge = await asyncio.wait_for(reader.readexactly(CHALLENGE_BYTES), HANDSHAKE_S)
            answer = answer_mac(secret, challenge, ticket, index)
            writer.write(ANSWER.pack(MAGIC, ticket, index, answer))
            proof = await asyncio.wait_for(reader.readexactly(MAC_BYTES), HANDSHAKE_S)
            return hmac.compare_digest(proof, mac(secret, challenge, answer))
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, RuntimeError) as exc:
            logger.debug("direct stream's challenge failed: %s", exc)
            return False

    async def aclose(self) -> None:
        for peer in list(self._incoming):
            self.cut(peer)
        for server in self._servers:
            server.close()
        self._servers.clear()
