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
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"FLM1"
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 4 << 30
_HEAD = struct.Struct(">4sI")

_DTYPES: dict[str, torch.dtype] = {
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
_NAMES = {v: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A frame or value that does not follow the wire format."""


def encode_value(value: Any, chunks: list[memoryview]) -> Any:
    """Describe ``value`` as JSON, appending tensor bytes to ``chunks``."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _NAMES:
            raise WireError(f"dtype {t.dtype} cannot travel on the wire")
        t = t.contiguous()
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() > 0 else memoryview(b"")
        chunks.append(buf)
        return {"t": "tensor", "dtype": _NAMES[t.dtype], "shape": list(t.shape), "nbytes": len(buf)}
    if isinstance(value, torch.Size):
        return {"t": "size", "v": list(value)}
    if isinstance(value, (tuple, list)):
        return {"t": type(value).__name__, "items": [encode_value(v, chunks) for v in value]}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": _NAMES.get(value, "")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"t": "py", "v": value}
    raise WireError(f"values of type {type(value).__name__} cannot travel on the wire")


def _shape_numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError(f"bad tensor shape {shape!r}")
    n = 1
    for d in shape:
        n *= d
    return n


def decode_value(desc: Any, payload: memoryview, offset: int, device: torch.device | None = None) -> tuple[Any, int]:
    """Rebuild a value from its description; returns (value, next payload offset)."""
    if not isinstance(desc, dict):
        raise WireError("value description is not an object")
    kind = desc.get("t")
    if kind == "tensor":
        dtype = _DTYPES.get(desc.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise WireError(f"unknown dtype {desc.get('dtype')!r}")
        shape = desc.get("shape")
        numel = _shape_numel(shape)
        nbytes = desc.get("nbytes")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes != numel * itemsize:
            raise WireError(f"tensor of shape {shape} and dtype {desc['dtype']} cannot be {nbytes} bytes")
        if offset + nbytes > len(payload):
            raise WireError("payload shorter than its tensors")
        raw = payload[offset : offset + nbytes]
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        elif offset % itemsize == 0:  # zero-copy: the tensor shares the frame's own buffer
            t = torch.frombuffer(payload, dtype=dtype, count=numel, offset=offset).reshape(shape)
        else:
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
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
        return torch.Size(desc.get("v", [])), offset
    if kind == "device":
        return (device or torch.device("cpu")), offset
    if kind == "dtype":
        dtype = _DTYPES.get(desc.get("v"))  # type: ignore[arg-type]
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


def encode_values(values: list[Any]) -> tuple[list[Any], list[memoryview]]:
    """Descriptions of ``values`` and the payload buffers they refer to, in order."""
    chunks: list[memoryview] = []
    return [encode_value(v, chunks) for v in values], chunks


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
    payload = bytearray(size)
    view = memoryview(payload)
    got = 0
    try:
        while got < size:
            chunk = await reader.read(min(size - got, 1 << 22))
            if not chunk:
                raise WireError("stream ended inside a payload")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
    except ConnectionError as exc:
        raise WireError(f"connection lost inside a payload: {exc}") from None
    return Frame(header, view)


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], values: list[Any] | None = None) -> int:
    """Write one frame; returns the bytes written."""
    buffers = pack(header, values)
    writer.writelines(buffers)
    await writer.drain()
    return sum(len(b) for b in buffers)
