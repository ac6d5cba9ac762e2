"""Messages between processes over hivemind's libp2p streams.

Each process registers one binary stream handler; a sender keeps one persistent
stream per destination and writes frames on it (no size cap, no protobuf
chunking). Received frames land in an inbox queue with the sender's libp2p peer
id, which the libp2p handshake authenticated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr
from multiaddr import Multiaddr

from protocol.messages import Message, MessageError
from protocol.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Frame,
    WireError,
    encode_values,
    pack_header,
    read_frame,
    split_buffers,
    write_frame,
)

logger = logging.getLogger(__name__)

MSG_PROTOCOL = "/fusionllm/msg/1"
BW_PROTOCOL = "/fusionllm/bw/1"
LANE_PROTOCOL = "/fusionllm/lane/1"
#: payloads above this travel over several parallel streams ("lanes"): one libp2p
#: stream through the p2p daemon is bound by one core, several are not
LANE_THRESHOLD = 8 << 20
LANES = 4
_LANE_HEAD = struct.Struct(">QIQ")  # frame id, lane index, byte count


class PeerUnreachable(ConnectionError):
    """A destination peer could not be reached or dropped the stream."""


@dataclass(frozen=True)
class Inbound:
    sender: str
    message: Message
    frame: Frame

    def values(self) -> list[Any]:
        return self.frame.values()


def strip_p2p(maddr: str) -> str:
    """The transport part of a multiaddr without ``/p2p/<id>``: the p2p daemon
    client cannot take hivemind's CID encoding of peer ids."""
    m = Multiaddr(maddr)
    try:
        return str(m.decapsulate_code(0x01A5))  # P_P2P
    except Exception:
        return maddr


def peer_id_of(maddr: str) -> str | None:
    try:
        return Multiaddr(maddr).value_for_protocol(0x01A5)
    except Exception:
        return None


class Transport:
    """Send and receive FusionLLM frames over a hivemind ``P2P`` instance."""

    def __init__(self, p2p: P2P, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.p2p = p2p
        self.max_payload = max_payload
        self.inbox: asyncio.Queue[Inbound] = asyncio.Queue()
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self._streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._known: dict[str, list[str]] = {}
        self._frame_ids = itertools.count()
        self._lane_parts: dict[tuple[str, int, int], asyncio.Future[bytes]] = {}

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(MSG_PROTOCOL, self._handle)
        await self.p2p.add_binary_stream_handler(BW_PROTOCOL, self._handle_bandwidth)
        await self.p2p.add_binary_stream_handler(LANE_PROTOCOL, self._handle_lane)

    def learn(self, peer_id: str, maddrs: list[str]) -> None:
        """Remember where a peer listens (from its advert or assignment)."""
        self._known[peer_id] = maddrs

    async def _open(self, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        pid = PeerID.from_base58(peer_id)
        addrs = [HivemindMultiaddr(strip_p2p(a)) for a in self._known.get(peer_id, [])]
        if addrs:
            try:
                await asyncio.wait_for(self.p2p._client.connect(pid, addrs), timeout=15)
            except Exception as exc:
                logger.debug("direct connect to %s failed: %s", peer_id, exc)
        try:
            _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(pid, protocol), 20)
        except Exception as exc:
            raise PeerUnreachable(f"cannot open a stream to peer {peer_id}: {exc or type(exc).__name__}") from None
        return reader, writer

    async def _write(self, key: str, peer_id: str, protocol: str, buffers: list[bytes | memoryview]) -> int:
        """Write buffers on the persistent stream ``key`` to ``peer_id`` (opened on first use)."""
        async with self._locks[key]:
            if key not in self._streams:
                self._streams[key] = await self._open(peer_id, protocol)
            _, writer = self._streams[key]
            try:
                writer.writelines(buffers)
                await writer.drain()
            except (ConnectionError, OSError) as exc:
                self._streams.pop(key, None)
                raise PeerUnreachable(f"stream to peer {peer_id} broke: {exc}") from None
        return sum(len(b) for b in buffers)

    async def send(self, peer_id: str, message: Message, values: list[Any] | None = None) -> int:
        """Send one message (with tensor values) to ``peer_id``; returns bytes written.
        Large payloads go over ``LANES`` parallel streams, the header over the main one."""
        header = message.header()
        chunks: list[memoryview] = []
        if values is not None:
            header["values"], chunks = encode_values(values)
        total = sum(len(c) for c in chunks)
        if total <= LANE_THRESHOLD:
            n = await self._write(peer_id, peer_id, MSG_PROTOCOL, [pack_header(header, total), *chunks])
        else:
            frame_id = next(self._frame_ids)
            parts = split_buffers(chunks, LANES)
            sizes = [sum(len(c) for c in part) for part in parts]
            header["lanes"] = {"id": frame_id, "bytes": sizes}
            writes = [self._write(peer_id, peer_id, MSG_PROTOCOL, [pack_header(header, 0)])]
            for lane, part in enumerate(parts):
                head = _LANE_HEAD.pack(frame_id, lane, sizes[lane])
                writes.append(self._write(f"{peer_id}/lane{lane}", peer_id, LANE_PROTOCOL, [head, *part]))
            n = sum(await asyncio.gather(*writes))
        self.bytes_sent[peer_id] += n
        return n

    def _lane_future(self, key: tuple[str, int, int]) -> asyncio.Future[bytes]:
        if key not in self._lane_parts:
            self._lane_parts[key] = asyncio.get_running_loop().create_future()
        return self._lane_parts[key]

    async def _handle_lane(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        try:
            while True:
                try:
                    head = await reader.readexactly(_LANE_HEAD.size)
                except asyncio.IncompleteReadError:
                    break
                frame_id, lane, size = _LANE_HEAD.unpack(head)
                if size > self.max_payload or lane >= LANES:
                    raise WireError(f"lane part of {size} bytes (lane {lane}) is over the limits")
                fut = self._lane_future((sender, frame_id, lane))
                data = await reader.readexactly(size)
                if not fut.done():
                    fut.set_result(data)
        except (WireError, ConnectionError, asyncio.IncompleteReadError) as exc:
            self.rejected[str(exc)] += 1
            logger.warning("dropped a lane stream from %s: %s", sender, exc)
        finally:
            writer.close()

    async def _join_lanes(self, sender: str, frame: Frame) -> Frame:
        lanes = frame.header.get("lanes")
        if not isinstance(lanes, dict) or not isinstance(lanes.get("id"), int):
            raise WireError("malformed 'lanes' in a header")
        sizes = lanes.get("bytes")
        if not isinstance(sizes, list) or len(sizes) > LANES or not all(isinstance(x, int) for x in sizes):
            raise WireError("malformed lane sizes")
        if sum(sizes) > self.max_payload:
            raise WireError(f"payload of {sum(sizes)} bytes is over the limit of {self.max_payload}")
        keys = [(sender, lanes["id"], i) for i in range(len(sizes))]
        try:
            parts = await asyncio.wait_for(asyncio.gather(*(self._lane_future(k) for k in keys)), 120)
        finally:
            for k in keys:
                self._lane_parts.pop(k, None)
        if [len(p) for p in parts] != sizes:
            raise WireError("lane parts do not match their announced sizes")
        return Frame(frame.header, memoryview(bytearray().join(parts)))

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        try:
            while True:
                frame = await read_frame(reader, self.max_payload)
                if frame is None:
                    break
                if "lanes" in frame.header:
                    frame = await self._join_lanes(sender, frame)
                try:
                    msg = Message.from_header(frame.header)
                except MessageError as exc:
                    self.rejected[str(exc)] += 1
                    logger.warning("rejected a message from %s: %s", sender, exc)
                    continue
                await self.inbox.put(Inbound(sender, msg, frame))
        except WireError as exc:
            self.rejected[str(exc)] += 1
            logger.warning("dropped the stream from %s: %s", sender, exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _handle_bandwidth(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bandwidth probe: read the upload, acknowledge, then send the requested bytes."""
        try:
            frame = await read_frame(reader, 256 << 20)
            if frame is None:
                return
            down = int(frame.header.get("down_bytes", 0))
            if not 0 <= down <= 256 << 20:
                return
            writer.write(b"A")
            await writer.drain()
            writer.write(bytes(down))
            await writer.drain()
        except (WireError, ConnectionError, ValueError, asyncio.IncompleteReadError) as exc:
            logger.debug("bandwidth probe from %s failed: %s", info.peer_id, exc)
        finally:
            writer.close()

    async def measure_bandwidth(self, peer_id: str, nbytes: int = 8 << 20) -> tuple[float, float]:
        """Timed transfer with ``peer_id``: (upload, download) in Mbit/s."""
        reader, writer = await self._open(peer_id, BW_PROTOCOL)
        try:
            import torch

            blob = torch.zeros(nbytes, dtype=torch.uint8)
            start = time.perf_counter()
            await write_frame(writer, {"down_bytes": nbytes}, [blob])
            await reader.readexactly(1)
            up_s = time.perf_counter() - start
            start = time.perf_counter()
            await reader.readexactly(nbytes)
            down_s = time.perf_counter() - start
        finally:
            writer.close()
        return nbytes * 8 / up_s / 1e6, nbytes * 8 / down_s / 1e6

    async def aclose(self) -> None:
        for _, writer in self._streams.values():  # main and lane streams
            writer.close()
        self._streams.clear()
