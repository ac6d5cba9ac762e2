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
are the forwarder's to answer for (``transport.UNSIGNED``)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from collections.abc import Callable
from typing import Any

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


class Forwarding:
    """Mixed into :class:`protocol.net.transport.Transport`: sending through a forwarder,
    forwarding (where ``relay_ok`` allows), and taking forwarded frames in."""

    gate: Gate
    peer_id: str
    max_payload: int

    def _init_forwarding(self) -> None:
        self.forward_via: dict[str, str] = {}  # destination -> the peer that forwards our frames to it
        #: whether this process forwards a frame of so many bytes from an origin to a
        #: destination (None: it forwards none)
        self.relay_ok: Callable[[str, str, int], bool] | None = None
        self.forwarded: dict[tuple[str, str], int] = defaultdict(int)  # (origin, destination) -> bytes passed on
        #: peers whose forwarded frames this one takes (the coordinator): another peer could
        #: misdirect an honest origin's frames to get it refused, and blamed
        self.forwarders: set[str] = set()

    async def _send_forwarded(self, peer_id: str, head: bytes, chunks: list[memoryview]) -> int:
        via = self.forward_via[peer_id]  # a stream per destination: a slow one holds up no other
        route = route_head(peer_id, self.peer_id)
        return await self._write(f"{via}/fwd/{peer_id}", via, FWD_PROTOCOL, [route, head, *chunks])

    async def _handle_fwd(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
                    if not await self._frame(reader, origin, via):
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
        gate, env = signed_head(self.gate.run_id, origin, self.gate.keys.get(origin), head, self.max_payload)
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

    # provided by Transport
    budget: Any
    _write: Any
    _frame: Any
    _active: Any
