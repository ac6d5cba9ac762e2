"""Messages between processes over hivemind's libp2p streams.

Each process registers one binary stream handler; a sender keeps one persistent
stream per destination and writes frames on it (no size cap, no protobuf
chunking). Received frames land in an inbox queue with the sender's libp2p peer
id, which the libp2p handshake authenticated. A sender that the gate mutes (too
many rejections: ``protocol.wire.gate.MUTE_REJECTS``) is disconnected once, and
every stream it opens until the mute ends is closed before a byte is read. Its
parts: ``lanes`` (large payloads), ``probe`` (bandwidth), ``pacing``, ``handlers``
(stream limits), and ``forward``'s ``Forwarder``, a component it owns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from blake3 import blake3
from hivemind.p2p import P2P, PeerID

from protocol.net import payload_first, probe
from protocol.net.budget import ByteBudget
from protocol.net.delay import DelayTable
from protocol.net.dialing import DIAL_OUT_S, PeerUnreachable, connect, dial_out, open_p2p
from protocol.net.direct import OFFER, OFFER_PROTOCOL, Direct, Streams, ip_hosts
from protocol.net.faults import FATAL, charge
from protocol.net.forward import FWD_PROTOCOL, Forwarder
from protocol.net.handlers import StreamLimits, ends_quietly
from protocol.net.lanes import LaneParts
from protocol.net.outgoing import Outgoing, seal_outgoing
from protocol.net.pacing import Pacer
from protocol.net.payload_first import PAYLOAD_FIRST_MIN
from protocol.net.probe import BW_PROTOCOL, ProbeBudget
from protocol.net.streams import discard, read_frame_head, read_payload
from protocol.net.upgrade import InOrder, Upgrades
from protocol.trust.identity import Identity
from protocol.wire.encoding import Frame, Link
from protocol.wire.envelope import Envelope, Sealer, inline_payload, lane_id
from protocol.wire.gate import Gate
from protocol.wire.messages import Message
from protocol.wire.reject import Reject, Rejected

logger = logging.getLogger(__name__)

MSG_PROTOCOL = "/fusionllm/msg/1"
#: lane parts that arrived before (or without) their frame's head: kept this long, and
#: at most this many per sender
LANE_PART_TTL_S = 120.0
MAX_WAITING_PARTS = 16
#: streams one sender may hold open to this process at once, and all senders together
#: (an honest peer holds one message stream, LANES lane streams and a probe); a stream
#: over either is closed unread and counted as a ``streams`` rejection
MAX_STREAMS_PER_PEER = 16
MAX_STREAMS = 1024
#: a sender not admitted (yet) may hold this many, and must send a frame head on each
#: within ``FIRST_HEAD_S`` (its hello): idle streams of fresh identities hold no slots
MAX_STREAMS_OUTSIDER = 2
FIRST_HEAD_S = 10.0
LANE_PROTOCOL = "/fusionllm/lane/1"
#: payloads above this travel over several parallel streams ("lanes"): one libp2p
#: stream through the p2p daemon is bound by one core, several are not
LANE_THRESHOLD = 8 << 20
LANES = 4
_LANE_HEAD = struct.Struct(">QIQ")  # frame id, lane index, byte count


@dataclass(frozen=True)
class Inbound:
    sender: str
    message: Message
    frame: Frame
    envelope: Envelope | None = None
    head: bytes = b""  # the signed head as received: with the payload, evidence of what the sender sent
    wire_s: float = 0.0  # seconds from its head's arrival to its delivery (payload and checks)

    def values(self) -> list[Any]:
        return self.frame.values()


class Transport:
    """Send and receive signed FusionLLM frames over a hivemind ``P2P`` instance.

    Every message is sealed with this process's identity; every incoming one goes
    through ``gate`` and only what passes reaches the inbox. ``set_rate`` paces the
    sends to one peer (application-level shaping, e.g. to mimic a slow link)."""

    def __init__(self, p2p: P2P, identity: Identity, gate: Gate, direct: bool = True) -> None:
        self.p2p = p2p
        self.identity = identity
        self.gate = gate
        self.sealer = Sealer(identity, p2p.peer_id.to_base58())
        self.inbox: asyncio.Queue[Inbound] = asyncio.Queue()
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.raw_sent: dict[str, int] = defaultdict(int)  # what those bytes were before compression
        self._streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._known: dict[str, list[str]] = {}
        self._frame_ids = itertools.count()
        self._lane_parts = LaneParts(LANE_PART_TTL_S, MAX_WAITING_PARTS)
        #: whether a sender may send a lane part of this many bytes (checked before reading it); None: any admitted
        self.lane_ok: Callable[[str, int], bool] | None = None
        #: takes some checked messages aside instead of the inbox (True: taken)
        self.divert: Callable[[Inbound], bool] | None = None
        self.probes = ProbeBudget()  # what each sender's bandwidth probes moved lately
        self.pacer = Pacer()
        self.delays = DelayTable.from_env()  # added latency per destination: the emulated testbed's
        #: when bytes last arrived from each sender (time.monotonic()): a peer busy sending a
        #: large frame is not silent, though no whole message of it has arrived yet
        self.last_activity: dict[str, float] = {}
        self._laned: set[asyncio.Task[None]] = set()  # frames whose payload is still on the lanes
        self._cutting: set[asyncio.Task[None]] = set()  # disconnects of muted senders
        self.limits = StreamLimits(gate, MAX_STREAMS_PER_PEER, MAX_STREAMS_OUTSIDER, MAX_STREAMS)
        self.open_streams = self.limits.open  # sender -> its streams open to us now
        self.budget = ByteBudget()  # payload bytes read at once, per sender and in all
        self.dials_in: set[str] = set()  # peers behind a NAT: they dial us (protocol.net.reach)
        self.forward_via: dict[str, str] = {}  # destination -> the peer that forwards our frames to it
        self.forwarder = Forwarder(self.peer_id, gate, self.budget, self._write, self._frame, self._active)
        #: the direct data path (``protocol.net.direct``; off: everything over libp2p), and
        #: the peers our message stream reaches over it (their large frames need no lanes)
        self.direct = Direct([MSG_PROTOCOL, LANE_PROTOCOL, BW_PROTOCOL], self._may_go_direct)
        self.direct.allowed = direct
        self.direct_to: set[str] = set()
        self.in_order = InOrder(lambda peer: self.last_activity.get(peer, 0.0))  # a sender's streams in turn
        self.upgrades = Upgrades(
            self.direct, MSG_PROTOCOL, self._streams, self._locks, self._stays, self._addrs_of,
            self._ask_ticket, self.direct_to.add,
        )  # fmt: skip
        gate.on_mute.append(self._cut_off)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    @property
    def max_payload(self) -> int:
        return self.gate.max_payload

    async def start(self) -> None:
        handlers: dict[str, Any] = {}
        for protocol, handler in (
            (MSG_PROTOCOL, self._handle),
            (BW_PROTOCOL, lambda *a: probe.serve(self.gate, self.probes, *a)),
            (LANE_PROTOCOL, self._handle_lane),
            (FWD_PROTOCOL, self.forwarder.handle),
            (OFFER_PROTOCOL, self.direct.grant),
        ):
            wrapped = ends_quietly(self.limits.counted(handler))
            handlers[protocol] = wrapped
            await self.p2p.add_binary_stream_handler(protocol, wrapped)
        if self.direct.allowed:
            hosts = ip_hosts(str(m) for m in await self.p2p.get_visible_maddrs(latest=True))
            await self.direct.listen(hosts, handlers)

    def _may_go_direct(self, peer_id: str) -> bool:
        return peer_id in self.gate.keys and not self.gate.muted(peer_id)

    def learn(self, peer_id: str, maddrs: list[str]) -> None:
        """Remember where a peer listens (from its advert or assignment)."""
        self._known[peer_id] = maddrs

    def set_rate(self, peer_id: str, mbps: float | None) -> None:
        """Pace sends to ``peer_id`` to ``mbps`` Mbit/s (None: as fast as possible)."""
        self.pacer.set_rate(peer_id, mbps)

    async def connect(self, peer_id: str, timeout: float = DIAL_OUT_S) -> None:
        """Dial ``peer_id`` at its known addresses (raises when the daemon cannot)."""
        await connect(self.p2p, peer_id, self._known.get(peer_id, []), timeout)

    async def _open(self, peer_id: str, protocol: str) -> Streams:
        """A new stream to ``peer_id``: direct where it can be (``protocol.net.direct``),
        else over libp2p (``_open_p2p``)."""
        if peer_id not in self.dials_in and self.direct.worth_trying(peer_id, protocol):
            streams = await self.direct.open(peer_id, protocol, await self._addrs_of(peer_id), self._ask_ticket)
            if streams is not None:
                if protocol == MSG_PROTOCOL:
                    self.direct_to.add(peer_id)
                return streams
        if protocol == MSG_PROTOCOL:
            self.direct_to.discard(peer_id)
        return await self._open_p2p(peer_id, protocol)

    def _stays(self, peer_id: str) -> bool:
        """Whether the message stream to ``peer_id`` stays where it is (``Upgrades``)."""
        return peer_id in self.direct_to or peer_id in self.dials_in or peer_id in self.forward_via

    async def _addrs_of(self, peer_id: str) -> list[str]:
        """Where to dial ``peer_id`` directly: its advert's addresses, else its connection's."""
        return self._known.get(peer_id) or await self._connected_addrs(peer_id)

    async def _connected_addrs(self, peer_id: str) -> list[str]:
        """Where the p2p daemon's connections to ``peer_id`` lead (none known from an advert)."""
        try:
            infos = await self.p2p.list_peers()
        except Exception:  # noqa: BLE001 - no addresses: libp2p it is
            return []
        return [str(a) for i in infos if i.peer_id.to_base58() == peer_id for a in i.addrs]

    async def _ask_ticket(self, peer_id: str) -> bytes:
        reader, writer = await self._open_p2p(peer_id, OFFER_PROTOCOL)
        try:
            return await reader.readexactly(OFFER.size)
        finally:
            writer.close()

    async def _open_p2p(self, peer_id: str, protocol: str) -> Streams:
        return await open_p2p(self.p2p, peer_id, protocol, self._known.get(peer_id, []), peer_id in self.dials_in)

    async def dial_out(self, peers: list[str]) -> list[str]:
        """``protocol.net.dialing.dial_out``: the peers (not us) not reached."""
        return await dial_out(self.p2p, self._known, [p for p in peers if p != self.peer_id])

    async def _write(self, key: str, peer_id: str, protocol: str, buffers: list[bytes | memoryview]) -> int:
        """Write buffers on the persistent stream ``key`` to ``peer_id`` (opened on first use)."""

        async def emit(writer: asyncio.StreamWriter) -> int:
            writer.writelines(buffers)
            await writer.drain()
            return sum(len(b) for b in buffers)

        return await self._write_with(key, peer_id, protocol, emit)

    async def _write_with(
        self, key: str, peer_id: str, protocol: str, emit: Callable[[asyncio.StreamWriter], Awaitable[int]]
    ) -> int:
        """``emit`` on the persistent stream ``key`` to ``peer_id`` (opened on first use)."""
        async with self._locks[key]:
            if key not in self._streams:
                self._streams[key] = await self._open(peer_id, protocol)
            elif key == peer_id and protocol == MSG_PROTOCOL:
                self.upgrades.maybe(peer_id)  # over libp2p though it may go direct now: moved on the side
            _, writer = self._streams[key]
            try:
                return await emit(writer)
            except (ConnectionError, OSError, RuntimeError) as exc:
                # uvloop raises RuntimeError ("the handler is closed") for a stream the daemon closed
                if isinstance(exc, RuntimeError) and not writer.transport.is_closing():
                    raise
                self._streams.pop(key, None)
                writer.close()  # the receiver's reader ends too: the next stream is not held at its fence
                raise PeerUnreachable(f"stream to peer {peer_id} broke: {exc}", peer_id) from None
            except asyncio.CancelledError:  # a frame cut in half: the stream cannot carry another
                self._streams.pop(key, None)
                writer.close()
                raise

    async def send(
        self, peer_id: str, message: Message, values: list[Any] | None = None, link: Link | None = None
    ) -> int:
        """Seal and send one message (with values, encoded by ``link``'s codec) to
        ``peer_id``; returns bytes written. Large payloads go over ``LANES``
        parallel streams, the signed head over the main one."""
        return await self.transmit(self.prepare(peer_id, message, values, link))

    def prepare(
        self, peer_id: str, message: Message, values: list[Any] | None = None, link: Link | None = None
    ) -> Outgoing:
        """The first half of ``send``: encode, hash and sign (no I/O)."""

        def lanes(total: int) -> tuple[int, int] | None:
            if peer_id in self.forward_via or peer_id in self.direct_to or total <= LANE_THRESHOLD:
                return None  # a forwarded frame carries its payload inline
            return next(self._frame_ids), LANES

        def later(total: int) -> bool:  # payload first, hashed on its way (a direct stream)
            return peer_id in self.direct_to and peer_id not in self.forward_via and total >= PAYLOAD_FIRST_MIN

        return seal_outgoing(self.sealer, peer_id, message, values, link, lanes, later)

    async def transmit(self, out: Outgoing) -> int:
        """The second half of ``send``: write a prepared frame; returns bytes written."""
        peer_id, head, total = out.peer_id, out.head, out.payload_bytes
        await self.pacer.wait(peer_id, len(head) + total)
        await self.delays.wait_addrs(self._known.get(peer_id, ()))
        if peer_id in self.forward_via:  # both behind NATs: through a peer both reach, payload inline
            n = await self.forwarder.send(self.forward_via[peer_id], peer_id, out.head_now(), out.chunks)
        elif out.seal is not None:
            n = await self._write_with(
                peer_id, peer_id, MSG_PROTOCOL, lambda w: payload_first.send(w, out, out.peer_id in self.direct_to)
            )
        elif out.lane_parts is None:
            n = await self._write(peer_id, peer_id, MSG_PROTOCOL, [head, *out.chunks])
        else:
            assert out.lane_sizes is not None
            writes = [self._write(peer_id, peer_id, MSG_PROTOCOL, [head])]
            for lane, part in enumerate(out.lane_parts):
                lane_head = _LANE_HEAD.pack(out.frame_id, lane, out.lane_sizes[lane])
                writes.append(self._write(f"{peer_id}/lane{lane}", peer_id, LANE_PROTOCOL, [lane_head, *part]))
            n = sum(await asyncio.gather(*writes))
        self.bytes_sent[peer_id] += n
        self.raw_sent[peer_id] += n - total + out.raw
        return n

    async def _handle_lane(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        try:
            if self.gate.refuse_stream(sender):
                return
            self.gate.check_admitted(sender, "a lane stream")
            while True:
                try:
                    head = await reader.readexactly(_LANE_HEAD.size)
                except asyncio.IncompleteReadError:
                    break
                frame_id, lane, size = _LANE_HEAD.unpack(head)
                allowed = self.lane_ok is None or self.lane_ok(sender, size)
                if size > self.max_payload or lane >= LANES or not allowed:
                    raise Rejected(Reject.OVERSIZED, f"lane part of {size} bytes (lane {lane}) is over the limits")
                async with self.budget.hold(sender, size):
                    data = await read_payload(reader, size, lambda: self._active(sender))
                if self._lane_parts.dropped(sender, frame_id):
                    continue  # the frame's signed head was rejected
                self._lane_parts.store((sender, frame_id, lane), data)
        except Rejected as exc:
            self.gate.reject(sender, exc)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            logger.debug("lane stream from %s ended: %s", sender, exc)
        finally:
            writer.close()

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        try:
            if self.gate.refuse_stream(sender):
                return
            direct = getattr(info, "direct", False)
            async with self.in_order.turn(sender):
                while await self._frame(reader, sender, direct=direct):
                    pass
        except Rejected as exc:
            self._charge(exc, sender, None, direct)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _frame(
        self, reader: asyncio.StreamReader, sender: str, via: str | None = None, direct: bool = False
    ) -> bool:
        """Read one frame of ``sender`` (forwarded by ``via``, if given; ``direct``: on a
        direct stream, where payload-first frames may come), check it and deliver it;
        False at the stream's end, or once the one to blame is muted. A failure that
        leaves the stream out of step raises ``Rejected``."""
        head = await self._next_head(reader, sender, via is not None, direct)
        if head is None:
            return False
        if isinstance(head, int):
            return await self._payload_first_frame(reader, sender, head)
        arrived = time.perf_counter()
        self._active(sender)
        if via is not None and self.gate.muted(sender):  # a muted origin's forwarded frames: dropped unread
            skip = inline_payload(head)
            if skip is None or skip > self.max_payload:
                raise Rejected(Reject.MALFORMED, "a forwarded frame whose size cannot be read")
            self.gate.refuse_stream(sender)
            await discard(reader, skip)
            return True
        try:
            env, message = self.gate.check_head(head, sender)
        except Rejected as exc:
            skip = inline_payload(head)
            if exc.code in FATAL or skip is None or skip > self.max_payload:
                raise
            blame = self._charge(exc, sender, via, direct)
            if self.gate.muted(via or blame):  # a forwarded stream carries others' frames too
                return False
            dropped = lane_id(head)
            if dropped is not None and via is None:  # its parts on the lane streams are dropped too
                self._lane_parts.drop(sender, dropped, LANES)
            await discard(reader, skip)  # the sender's later frames still count
            return True
        if env.lanes is not None:  # joined on the side: later frames need not wait for it
            if via is not None:
                raise Rejected(Reject.UNEXPECTED, "a forwarded frame whose payload is on lanes")
            task = asyncio.create_task(self._laned_frame(sender, env, message, head, arrived))
            self._laned.add(task)
            task.add_done_callback(self._laned.discard)
            return True
        try:
            digest = blake3()  # verified as it arrives: one pass
            async with self.budget.hold(sender, env.payload_bytes):
                payload = await read_payload(reader, env.payload_bytes, lambda: self._active(sender), digest)
            self.gate.check_payload(env, payload, sender, digest.hexdigest())
        except Rejected as exc:
            if exc.code is Reject.TRUNCATED:
                raise
            # the signed digest does not match: altered on its way, by the forwarder
            blame = self._charge(exc, sender, via, direct)
            return not self.gate.muted(via or blame)
        wire_s = time.perf_counter() - arrived
        await self._deliver(Inbound(sender, message, Frame({"values": env.values}, payload), env, head, wire_s))
        return True

    def _charge(self, exc: Rejected, sender: str, via: str | None, direct: bool) -> str:
        """``protocol.net.faults.charge`` on this transport's gate and direct path."""
        return charge(self.gate, self.direct, exc, sender, via, direct)

    async def _next_head(
        self, reader: asyncio.StreamReader, sender: str, forwarded: bool, direct: bool
    ) -> bytes | int | None:
        """``read_frame_head``, within ``FIRST_HEAD_S`` for a sender not admitted (yet)."""
        if sender in self.gate.keys or forwarded:
            return await read_frame_head(reader, direct)
        try:
            return await asyncio.wait_for(read_frame_head(reader, direct), FIRST_HEAD_S)
        except asyncio.TimeoutError:
            raise Rejected(Reject.TRUNCATED, f"no frame head within {FIRST_HEAD_S:.0f} s") from None

    async def _payload_first_frame(self, reader: asyncio.StreamReader, sender: str, size: int) -> bool:
        arrived = time.perf_counter()
        try:
            env, message, payload, head = await payload_first.receive(
                reader, size, sender, self.gate, self.budget, lambda: self._active(sender)
            )
        except Rejected as exc:
            if exc.code in FATAL:
                raise
            return not self.gate.muted(self._charge(exc, sender, None, True))
        wire_s = time.perf_counter() - arrived
        await self._deliver(Inbound(sender, message, Frame({"values": env.values}, payload), env, head, wire_s))
        return True

    def _cut_off(self, sender: str) -> None:
        """A sender just muted: close our streams to it and drop its libp2p connection
        (it may dial again; its streams are then closed unread until the mute ends)."""
        self.forget(sender)
        self.direct.cut(sender)
        try:
            task = asyncio.get_running_loop().create_task(self._disconnect(sender))
        except RuntimeError:  # no loop running (a gate used on its own)
            return
        self._cutting.add(task)
        task.add_done_callback(self._cutting.discard)

    async def _disconnect(self, sender: str) -> None:
        try:
            await self.p2p._client.disconnect(PeerID.from_base58(sender))
        except Exception as exc:
            logger.debug("could not disconnect %s: %s", sender, exc)

    def _active(self, sender: str) -> None:
        self.last_activity[sender] = time.monotonic()

    async def _laned_frame(self, sender: str, env: Envelope, message: Message, head: bytes, arrived: float) -> None:
        """Wait for a frame's payload on the lane streams, check it, deliver it."""
        try:
            payload = await self._lane_parts.join(sender, env)
            self.gate.check_payload(env, payload, sender)
        except Rejected as exc:
            self.gate.reject(sender, exc)
            return
        wire_s = time.perf_counter() - arrived
        await self._deliver(Inbound(sender, message, Frame({"values": env.values}, payload), env, head, wire_s))

    async def _deliver(self, inbound: Inbound) -> None:
        """Into the inbox, unless ``divert`` takes it."""
        if self.divert is None or not self.divert(inbound):
            await self.inbox.put(inbound)

    async def measure_bandwidth(self, peer_id: str, nbytes: int = 8 << 20, down: bool = True) -> tuple[float, float]:
        """Timed transfer with ``peer_id``: (upload, download) in Mbit/s (download 0.0
        when not measured). The upload is paced like any other send to that peer."""
        reader, writer = await self._open(peer_id, BW_PROTOCOL)
        try:
            return await probe.measure(reader, writer, nbytes, down, lambda: self.pacer.wait(peer_id, nbytes))
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            raise PeerUnreachable(
                f"bandwidth probe with peer {peer_id} broke: {exc or type(exc).__name__}", peer_id
            ) from None
        finally:
            writer.close()

    def forget(self, peer_id: str) -> None:
        """Close the streams to a peer that left (the next send opens new ones)."""
        for key in [k for k in self._streams if k == peer_id or k.startswith(peer_id + "/")]:
            self._streams.pop(key)[1].close()
        self.direct_to.discard(peer_id)
        self.upgrades.drop(peer_id)

    async def connected(self) -> set[str]:
        """Peer ids the p2p daemon holds a connection to now."""
        return {info.peer_id.to_base58() for info in await self.p2p.list_peers()}

    async def aclose(self) -> None:
        self.upgrades.cancel()
        for task in [*self._laned, *self._cutting]:
            task.cancel()
        for _, writer in self._streams.values():  # main and lane streams
            writer.close()
        self._streams.clear()
        await self.direct.aclose()
