"""Forwarded frames: two peers behind NATs cannot connect to each other, so a peer
that both can reach (the coordinator) passes their signed frames on.

On ``/fusionllm/fwd/1`` each frame follows a route head: the destination's and the
origin's peer ids. A stream from the origin asks the forwarder to pass the frame to
the destination: the forwarder checks that the origin signed it for this run (so it
never passes on what it cannot vouch for), reads it within its byte budget and
writes it, unchanged, on its own forwarding stream to the destination. There the
frame goes through the full checks of the destination's gate with the origin as
its sender: the forwarder cannot read-modify it without the signature failing, nor
make it count as anyone else's. Failures before the signature proves the origin
are the forwarder's to answer for (``faults.UNSIGNED``)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from protocol.net.budget import ByteBudget
from protocol.net.streams import read_frame_head, read_or_end, read_payload
from protocol.wire.envelope import Envelope
from protocol.wire.gate import Gate
from protocol.wire.reject import Reject, Rejected

logger = logging.getLogger(__name__)

FWD_PROTOCOL = "/fusionllm/fwd/1"
#: how long a forwarded frame may take to be written on to its destination
RELAY_WRITE_S = 60.0
_ROUTE = struct.Struct(">BB")  # byte lengths of the destination's and the origin's peer ids


def route_head(dest: str, origin: str) -> bytes:
    a, b = dest.encode(), origin.encode()
    return _ROUTE.pack(len(a), len(b)) + a + b


async def read_route(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """(destination, origin) of the next forwarded frame; None at the stream's clean end."""
    lengths = await read_or_end(reader, _ROUTE.size, "a route head")
    if lengths is None:
        return None
    a, b = _ROUTE.unpack(lengths)
    ids = await reader.readexactly(a + b)
    try:
        return ids[:a].decode("ascii"), ids[a:].decode("ascii")
    except UnicodeDecodeError:
        raise Rejected(Reject.MALFORMED, "a route head whose peer ids are not ASCII") from None


def signed_head(run_id: str, origin: str, key: Any, head: bytes, max_payload: int) -> tuple[Gate, Envelope]:
    """A gate holding only ``origin``'s key, and the envelope of ``head`` if ``origin``
    signed it for this run (``Rejected`` if not); the gate then checks the payload."""
    if key is None:
        raise Rejected(Reject.NOT_ADMITTED, f"{origin[:64]} is not admitted: its frames are not forwarded")
    gate = Gate(run_id, max_payload)
    gate.admit(origin, key)
    env, _ = gate.check_head(head, origin)
    if env.lanes is not None:
        raise Rejected(Reject.UNEXPECTED, "a frame to forward whose payload is on lanes")
    return gate, env


#: writes buffers on the persistent stream ``key`` to a peer: (key, peer, protocol, buffers) -> bytes written
Write = Callable[[str, str, str, list[bytes | memoryview]], Awaitable[int]]
#: reads, checks and delivers one frame of an origin forwarded by a peer: (reader, origin, forwarder) -> False
#: at the stream's end or once the one to blame is muted
TakeFrame = Callable[[asyncio.StreamReader, str, str], Awaitable[bool]]


class Forwarder:
    """This process's part in forwarding, a component of its transport: sending through
    a forwarder (the transport says which), forwarding where ``relay_ok`` allows, and
    taking in the frames that a peer of ``forwarders`` forwards. What it needs of the
    transport comes in explicitly: its peer id, the gate, the byte budget, the stream
    writer, the frame reader, and the mark of a sender's activity."""

    def __init__(
        self,
        peer_id: str,
        gate: Gate,
        budget: ByteBudget,
        write: Write,
        take: TakeFrame,
        active: Callable[[str], None],
    ) -> None:
        self.peer_id = peer_id
        self.gate = gate
        self.budget = budget
        self._write = write
        self._take = take
        self._active = active
        #: whether this process forwards a frame of so many bytes from an origin to a
        #: destination (None: it forwards none)
        self.relay_ok: Callable[[str, str, int], bool] | None = None
        self.forwarded: dict[tuple[str, str], int] = defaultdict(int)  # (origin, destination) -> bytes passed on
        #: peers whose forwarded frames this one takes (the coordinator): another peer could
        #: misdirect an honest origin's frames to get it refused, and blamed
        self.forwarders: set[str] = set()

    async def send(self, via: str, peer_id: str, head: bytes, chunks: list[memoryview]) -> int:
        """Write a sealed frame (payload inline) to ``peer_id`` through the peer ``via``."""
        route = route_head(peer_id, self.peer_id)
        # a stream per destination: a slow one holds up no other
        return await self._write(f"{via}/fwd/{peer_id}", via, FWD_PROTOCOL, [route, head, *chunks])

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The ``FWD_PROTOCOL`` stream handler: frames to forward, or forwarded to us."""
        via = info.peer_id.to_base58()
        try:
            if self.gate.refuse_stream(via):
                return
            self.gate.check_admitted(via, "a forwarding stream")
            while True:
                route = await read_route(reader)
                if route is None:
                    break
                dest, origin = route
                if dest == self.peer_id:
                    if via not in self.forwarders:
                        raise Rejected(Reject.UNEXPECTED, f"frames forwarded by {via[:64]}, which forwards none here")
                    if not await self._take(reader, origin, via):
                        break
                elif origin == via and self.relay_ok is not None:
                    await self._relay(reader, origin, dest)
                else:
                    raise Rejected(Reject.UNEXPECTED, f"a frame from {origin[:64]} to forward to {dest[:64]}")
        except Rejected as exc:
            self.gate.reject(via, exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, origin: str, dest: str) -> None:
        """Pass one frame of ``origin`` on to ``dest``, once it is checked whole: signed
        by the origin for this run, admitted now, the payload its signed digest, of a
        size ``relay_ok`` allows. Its bytes stay budgeted until written; a destination
        that does not take them within ``RELAY_WRITE_S`` (or is gone) loses the frame
        (the run's failure handling sees the gap)."""
        assert self.relay_ok is not None
        head = await read_frame_head(reader)
        if head is None:
            raise Rejected(Reject.TRUNCATED, "stream ended after a route head")
        self.gate.check_admitted(origin, "a frame to forward")
        gate, env = signed_head(self.gate.run_id, origin, self.gate.keys.get(origin), head, self.gate.max_payload)
        if not self.relay_ok(origin, dest, env.payload_bytes):
            raise Rejected(Reject.UNEXPECTED, f"a frame of {env.payload_bytes} bytes to forward to {dest[:64]}")
        async with self.budget.hold(origin, env.payload_bytes):
            payload = await read_payload(reader, env.payload_bytes, lambda: self._active(origin))
            gate.check_payload(env, payload, origin)
            parts = [route_head(dest, origin), head, payload]
            try:
                await asyncio.wait_for(self._write(f"{dest}/fwd", dest, FWD_PROTOCOL, parts), RELAY_WRITE_S)
            except (ConnectionError, asyncio.TimeoutError) as exc:  # ConnectionError: PeerUnreachable
                logger.warning("could not forward a frame of %s to %s: %s", origin, dest, exc or "timed out")
                return
        self.forwarded[(origin, dest)] += len(head) + len(payload)
