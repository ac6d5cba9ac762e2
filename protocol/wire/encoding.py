"""Framework-neutral framing of values and messages on a byte stream.

A frame is ``MAGIC | u32 header length | JSON header | payload``. The header is
a JSON object holding the message fields and, under ``"values"``, a description
of every value (tensors as dtype, shape and byte count; tuples; small Python
scalars). Tensor bytes follow in the payload, in order. Nothing is pickled: a
receiver only ever parses JSON and copies raw bytes into tensors.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from protocol.wire.buffers import BUFFERS
from protocol.wire.codecs import Codec, CodecError, ErrorFeedback, encode_parts, finite
from protocol.wire.codecs import decode as decode_tensor

MAGIC = b"FLM1"
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 4 << 30
#: payloads are read in chunks of at most this many bytes
READ_CHUNK = 1 << 22
#: payloads at least this big are hashed on another thread while the rest lands (a
#: thread's hand-off costs more than hashing a smaller one where it is)
THREADED_HASH_MIN = 8 << 20
HASH_STEP = 1 << 18  # below it, each step is hashed once it has landed, while the next lands
#: a payload's last bytes are hashed after the last of them lands (or is written), on
#: each side, before its head can be checked (or sealed): the step before them ends
#: this far from the end (``next_stop``), so what stands on the critical path is a
#: hash of at most this many bytes, not a whole step's (10 us here, not 40)
HASH_TAIL = 1 << 16
_HEAD = struct.Struct(">4sI")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ITEMSIZE = {v: torch.empty((), dtype=v).element_size() for v in DTYPES.values()}
#: integer types a wider integer tensor may travel as, narrowest first, with their ranges
_NARROW = (
    (torch.uint8, 0, 255),
    (torch.int8, -128, 127),
    (torch.int16, -(1 << 15), (1 << 15) - 1),
    (torch.int32, -(1 << 31), (1 << 31) - 1),
)


_WIDE_INTS = (torch.int16, torch.int32, torch.int64)


def _narrowest(t: torch.Tensor) -> torch.dtype | None:
    """The narrowest integer type holding every value of the integer tensor ``t``
    (None: none narrower than its own)."""
    lo, hi = int(t.min()), int(t.max())
    for dtype, low, high in _NARROW:
        if _ITEMSIZE[dtype] >= t.element_size():
            return None
        if low <= lo and hi <= high:
            return dtype
    return None


class WireError(ValueError):
    """A frame or value that does not follow the wire format."""


def encode_value(value: Any, chunks: list[memoryview], link: Link | None = None) -> Any:
    """Describe ``value`` as JSON, appending tensor bytes to ``chunks``. Floating
    tensors are compressed with ``link``'s codec (and its error feedback); on a
    compressing link, integer tensors travel losslessly in the narrowest integer
    type that holds their values (``narrow``: token ids as uint8 or int16, not int64)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in DTYPE_NAMES:
            raise WireError(f"dtype {t.dtype} cannot travel on the wire")
        desc: dict[str, Any] = {"t": "tensor", "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
        if link is not None and link.codec.applies_to(t):
            parts = link.encode(t)
            chunks.extend(parts)
            desc["codec"] = link.codec.to_json()
            desc["parts"] = [len(p) for p in parts]
            desc["nbytes"] = sum(desc["parts"])
            return desc
        if link is not None and not link.codec.lossless and t.numel() > 0 and t.dtype in _WIDE_INTS:
            narrow = _narrowest(t)
            if narrow is not None:
                t = t.to(narrow)
                desc["narrow"] = DTYPE_NAMES[narrow]
        t = t.contiguous()
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() > 0 else memoryview(b"")
        chunks.append(buf)
        desc["nbytes"] = len(buf)
        return desc
    if isinstance(value, torch.Size):
        return {"t": "size", "v": list(value)}
    if isinstance(value, (tuple, list)):
        return {"t": type(value).__name__, "items": [encode_value(v, chunks, link) for v in value]}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": DTYPE_NAMES.get(value, "")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"t": "py", "v": value}
    raise WireError(f"values of type {type(value).__name__} cannot travel on the wire")


class Link:
    """How tensors are encoded on one link: its codec and, for gradients, the
    error-feedback residuals of that link (one per value slot)."""

    def __init__(
        self,
        codec: Codec,
        feedback: ErrorFeedback | None = None,
        key: Any = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.codec = codec
        self.feedback = feedback
        self.key = key
        self.generator = generator  # stochastic rounding's random numbers on this link
        self._slot = 0

    def encode(self, t: torch.Tensor) -> list[memoryview]:
        slot, self._slot = self._slot, self._slot + 1
        if self.feedback is not None and not self.codec.stochastic:
            return self.feedback.encode((self.key, slot), t, self.codec)
        return encode_parts(t, self.codec, self.generator)


def _shape_numel(shape: Any) -> int:
    if (
        not isinstance(shape, list)
        or len(shape) > 16
        or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)  # JSON's true is a bool, not an int
    ):
        raise WireError(f"bad tensor shape {str(shape)[:64]}")
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor_desc(desc: dict[str, Any]) -> tuple[torch.dtype, list[int], int, Codec | None, torch.dtype]:
    """(dtype, shape, bytes, codec, the dtype its bytes are in) of a tensor
    description, checked for consistency."""
    dtype = DTYPES.get(desc.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise WireError(f"unknown dtype {str(desc.get('dtype'))[:32]!r}")
    shape = desc.get("shape")
    numel = _shape_numel(shape)
    nbytes = desc.get("nbytes")
    codec = None
    if "codec" in desc:
        try:
            codec = Codec.from_json(desc["codec"])
        except (CodecError, TypeError) as exc:
            raise WireError(f"bad codec: {exc}") from None
        expected = codec.part_sizes(numel, dtype, shape)
        if desc.get("parts") != expected or nbytes != sum(expected):
            raise WireError(f"{codec} tensor of shape {shape} must have parts of {expected} bytes")
        return dtype, shape, nbytes, codec, dtype
    stored = dtype
    if "narrow" in desc:
        stored = DTYPES.get(desc["narrow"]) if isinstance(desc["narrow"], str) else None  # type: ignore[assignment]
        if dtype not in _WIDE_INTS or stored not in [n[0] for n in _NARROW] or _ITEMSIZE[stored] >= _ITEMSIZE[dtype]:
            raise WireError(f"a {desc['dtype']} tensor cannot travel as {str(desc['narrow'])[:16]!r}")
    if nbytes != numel * _ITEMSIZE[stored]:
        raise WireError(f"tensor of shape {shape} and dtype {DTYPE_NAMES[stored]} cannot be {nbytes} bytes")
    return dtype, shape, nbytes, codec, stored


def check_descriptions(descs: Any, payload_bytes: int) -> None:
    """Check value descriptions without a payload: structure, sizes, and that they
    account for exactly ``payload_bytes``."""
    if not isinstance(descs, list):
        raise WireError("'values' is not a list")
    total = sum(_described_bytes(d, 0) for d in descs)
    if total != payload_bytes:
        raise WireError(f"values describe {total} bytes, the payload has {payload_bytes}")


def _described_bytes(desc: Any, depth: int) -> int:
    if depth > 32:
        raise WireError("values nested too deeply")
    if not isinstance(desc, dict):
        raise WireError("value description is not an object")
    kind = desc.get("t")
    if kind == "tensor":
        return _tensor_desc(desc)[2]
    if kind in ("tuple", "list"):
        items = desc.get("items")
        if not isinstance(items, list):
            raise WireError("tuple without items")
        return sum(_described_bytes(d, depth + 1) for d in items)
    if kind in ("size", "device", "dtype", "py"):
        decode_value(desc, memoryview(b""), 0)
        return 0
    raise WireError(f"unknown value kind {str(kind)[:32]!r}")


def raw_bytes(descs: list[Any]) -> int:
    """What the described values take uncompressed."""
    total = 0
    for d in descs:
        if not isinstance(d, dict):
            continue
        if d.get("t") == "tensor":
            total += math.prod(d["shape"]) * _ITEMSIZE[DTYPES[d["dtype"]]]
        elif d.get("t") in ("tuple", "list"):
            total += raw_bytes(d.get("items", []))
    return total


def decode_value(desc: Any, payload: memoryview, offset: int, device: torch.device | None = None) -> tuple[Any, int]:
    """Rebuild a value from its description; returns (value, next payload offset)."""
    if not isinstance(desc, dict):
        raise WireError("value description is not an object")
    kind = desc.get("t")
    if kind == "tensor":
        dtype, shape, nbytes, codec, stored = _tensor_desc(desc)
        if offset + nbytes > len(payload):
            raise WireError("payload shorter than its tensors")
        if codec is not None:
            parts, at = [], offset
            for size in desc["parts"]:
                parts.append(payload[at : at + size])
                at += size
            try:
                t = decode_tensor(parts, codec, dtype, shape)
            except CodecError as exc:
                raise WireError(str(exc)) from None
        else:
            numel = math.prod(shape)
            itemsize = _ITEMSIZE[stored]
            raw = payload[offset : offset + nbytes]
            if numel == 0:
                t = torch.empty(shape, dtype=stored)
            elif offset % itemsize == 0:  # zero-copy: the tensor shares the frame's own buffer
                t = torch.frombuffer(payload, dtype=stored, count=numel, offset=offset).reshape(shape)
            else:
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(stored).reshape(shape)
            if stored != dtype:
                t = t.to(dtype)
        if device is not None and device.type != "cpu":
            t = t.to(device)
        return t, offset + nbytes
    if kind in ("tuple", "list"):
        items = desc.get("items")
        if not isinstance(items, list):
            raise WireError("tuple without items")
        out = []
        for item in items:
            v, offset = decode_value(item, payload, offset, device)
            out.append(v)
        return (tuple(out) if kind == "tuple" else out), offset
    if kind == "size":
        v = desc.get("v")
        if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
            raise WireError("bad size value")
        return torch.Size(v), offset
    if kind == "device":
        return (device or torch.device("cpu")), offset
    if kind == "dtype":
        dtype = DTYPES.get(desc.get("v"))  # type: ignore[arg-type]
        if dtype is None:
            raise WireError(f"unknown dtype {desc.get('v')!r}")
        return dtype, offset
    if kind == "py":
        v = desc.get("v")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise WireError("python value is not a scalar")
        return v, offset
    raise WireError(f"unknown value kind {kind!r}")


@dataclass(frozen=True)
class Frame:
    """A decoded frame: the JSON header and the raw payload."""

    header: dict[str, Any]
    payload: memoryview

    def values(self, device: torch.device | None = None) -> list[Any]:
        descs = self.header.get("values", [])
        if not isinstance(descs, list):
            raise WireError("'values' is not a list")
        out, offset = [], 0
        for d in descs:
            v, offset = decode_value(d, self.payload, offset, device)
            out.append(v)
        if offset != len(self.payload):
            raise WireError(f"payload has {len(self.payload) - offset} bytes no value describes")
        return out


def encode_values(values: list[Any], link: Link | None = None) -> tuple[list[Any], list[memoryview]]:
    """Descriptions of ``values`` and the payload buffers they refer to, in order."""
    chunks: list[memoryview] = []
    return [encode_value(v, chunks, link) for v in values], chunks


def pack_header(header: dict[str, Any], payload_bytes: int) -> bytes:
    """The frame's head: magic, length and JSON header announcing ``payload_bytes``."""
    body = json.dumps({**header, "payload_bytes": payload_bytes}, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(body)} bytes is over {MAX_HEADER_BYTES}")
    return _HEAD.pack(MAGIC, len(body)) + body


def pack(header: dict[str, Any], values: list[Any] | None = None) -> list[bytes | memoryview]:
    """Frame ``header`` (and ``values``) into buffers to write in order."""
    head = dict(header)
    chunks: list[memoryview] = []
    if values is not None:
        head["values"], chunks = encode_values(values)
    return [pack_header(head, sum(len(c) for c in chunks)), *chunks]


def split_buffers(chunks: list[memoryview], parts: int) -> list[list[memoryview]]:
    """Split a sequence of buffers into ``parts`` runs of nearly equal byte counts."""
    total = sum(len(c) for c in chunks)
    size = -(-total // parts)
    out: list[list[memoryview]] = [[] for _ in range(parts)]
    lane, room = 0, size
    for c in chunks:
        while len(c):
            take = min(room, len(c))
            out[lane].append(c[:take])
            c, room = c[take:], room - take
            if room == 0 and lane < parts - 1:
                lane, room = lane + 1, size
    return out


def pack_bytes(header: dict[str, Any], values: list[Any] | None = None) -> bytes:
    return b"".join(bytes(c) for c in pack(header, values))


async def read_frame(reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Frame | None:
    """Read one frame, or None at a clean end of stream. Sizes are checked before
    anything large is read."""
    header = await read_head(reader, max_payload)
    if header is None:
        return None
    try:
        payload = await read_growing(reader, header["payload_bytes"])
    except ConnectionError as exc:
        raise WireError(f"connection lost inside a payload: {exc}") from None
    if payload is None:
        raise WireError("stream ended inside a payload")
    return Frame(header, payload)


async def read_head(reader: asyncio.StreamReader, max_payload: int) -> dict[str, Any] | None:
    """A frame's header (its ``payload_bytes`` checked against ``max_payload``), or None
    at a clean end of stream; the payload is left on the stream."""
    try:
        head = await reader.readexactly(_HEAD.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise WireError("stream ended inside a frame header") from None
    magic, hlen = _HEAD.unpack(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a FusionLLM frame")
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f"header of {hlen} bytes is over {MAX_HEADER_BYTES}")
    try:
        header = json.loads(await reader.readexactly(hlen))
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise WireError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    size = header.get("payload_bytes", 0)
    if not isinstance(size, int) or size < 0:
        raise WireError(f"bad payload size {size!r}")
    if size > max_payload:
        raise WireError(f"payload of {size} bytes is over the limit of {max_payload}")
    header["payload_bytes"] = size
    return header


async def read_growing(
    reader: asyncio.StreamReader, size: int, on_chunk: Callable[[], None] | None = None, digest: Any = None
) -> memoryview | None:
    """Read ``size`` bytes into a buffer that grows as they arrive (a claimed size
    allocates nothing by itself); None if the stream ends first. ``digest`` (a hasher,
    e.g. BLAKE3's) is updated with each chunk as it arrives: the payload is hashed
    while the rest of it is still on its way, not in a second pass after the last byte."""
    if hasattr(reader, "fill"):  # protocol.net.direct_io: straight into the buffer
        return await _read_lazily(reader, size, on_chunk, digest)
    return await _read_chunks(reader, size, on_chunk, digest)


async def _read_chunks(
    reader: asyncio.StreamReader, size: int, on_chunk: Callable[[], None] | None, digest: Any
) -> memoryview | None:
    payload = bytearray()
    while len(payload) < size:
        chunk = await reader.read(min(size - len(payload), READ_CHUNK))
        if not chunk:
            return None
        payload += chunk
        if digest is not None:
            digest.update(chunk)
        if on_chunk is not None:
            on_chunk()
    return memoryview(payload)


def next_stop(done: int, size: int, step: int) -> int:
    """Where the hashing step after ``done`` of ``size`` bytes ends: the next multiple
    of ``step``, or ``HASH_TAIL`` before the end where that comes first, then the end."""
    tail = size - HASH_TAIL
    return size if done >= tail else min(tail, (done // step + 1) * step)


async def _read_lazily(reader: Any, size: int, on_chunk: Callable[[], None] | None, digest: Any) -> memoryview | None:
    """``read_growing`` for a reader with ``fill``: one buffer of ``size`` bytes
    whose pages the kernel makes resident only as the bytes land in them (what is
    held grows with what arrived, as above, without copying it twice); each
    ``READ_CHUNK`` is hashed once it is full."""
    try:
        payload = BUFFERS.take(size)
    except MemoryError:  # no room to reserve it at once: grown as it arrives, as on other streams
        return await _read_chunks(reader, size, on_chunk, digest)
    hashed, hashing = 0, None
    filling = reader.fill(payload, READ_CHUNK if size >= THREADED_HASH_MIN else HASH_STEP)
    try:
        async for filled in filling:
            if hashing is not None:
                await hashing
            if digest is not None and (size < THREADED_HASH_MIN or filled - hashed <= HASH_TAIL):
                digest.update(payload[hashed:filled])
            elif digest is not None:  # on another core (BLAKE3 lets go of the GIL) while more lands
                hashing = asyncio.ensure_future(asyncio.to_thread(digest.update, payload[hashed:filled]))
            hashed = filled
            if on_chunk is not None:
                on_chunk()
    except asyncio.IncompleteReadError:
        return None
    finally:
        await filling.aclose()  # at once, also when cancelled: no more bytes land in this buffer
        if hashing is not None:
            await hashing
    return payload


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], values: list[Any] | None = None) -> int:
    """Write one frame; returns the bytes written."""
    buffers = pack(header, values)
    writer.writelines(buffers)
    await writer.drain()
    return sum(len(b) for b in buffers)


def all_finite(value: Any) -> bool:
    """Whether every floating tensor in a decoded value holds only finite numbers."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or finite(value)
    if isinstance(value, (tuple, list)):
        return all(all_finite(v) for v in value)
    return True
