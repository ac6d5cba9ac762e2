"""Compression codecs for tensors on the wire.

- ``none``: the raw bytes (exact).
- ``fp16`` / ``bf16``: a cast; relative error at most 2**-11 (fp16, normal range)
  or 2**-8 (bf16).
- ``int8``: blocks of ``block`` elements, each with an fp32 scale (its absolute
  maximum / 127) and int8 codes; error at most the block's max / 254 per element.
- ``adatopk``: block-wise top-k. A tensor is cut into blocks of ``block`` elements
  (the tail padded with zeros); the tensor keeps ``K = round(fraction * numel)``
  values in total, spread evenly over blocks (the first ``K % blocks`` blocks keep
  one more), each block exactly its own largest-magnitude ones. Indices travel
  within the block (uint8 for blocks of up to 256, else uint16), values as fp16.

A codec's description is part of the value's JSON description, so a receiver
knows, from the shape and the codec alone, the exact byte count of every part;
anything else is rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CODECS = ("none", "fp16", "bf16", "int8", "adatopk")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: rows of blocks processed at once: a chunk stays in cache through abs/topk/gather
_CHUNK_ELEMENTS = 1 << 20


class CodecError(ValueError):
    """A codec spec or encoded tensor that does not follow the codec's rules."""


@dataclass(frozen=True)
class Codec:
    """Which codec a link uses, and its parameters."""

    name: str = "none"
    fraction: float = 1.0  # adatopk: the kept fraction of each tensor's elements
    block: int = 256  # int8 and adatopk: elements per block

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise CodecError(f"unknown codec {self.name!r} (known: {', '.join(CODECS)})")
        if not (isinstance(self.fraction, float) and 0.0 < self.fraction <= 1.0):
            raise CodecError(f"kept fraction {self.fraction!r} is not in (0, 1]")
        if not (isinstance(self.block, int) and 2 <= self.block <= 65536):
            raise CodecError(f"block size {self.block!r} is not in [2, 65536]")

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "fraction": self.fraction, "block": self.block}

    @classmethod
    def from_json(cls, d: Any) -> Codec:
        if not isinstance(d, dict):
            raise CodecError("codec spec is not an object")
        fraction = d.get("fraction", 1.0)
        if isinstance(fraction, int) and not isinstance(fraction, bool):
            fraction = float(fraction)
        return cls(str(d.get("name", "none")), fraction, d.get("block", 256))

    @classmethod
    def parse(cls, text: str) -> Codec:
        """``none``, ``fp16``, ``bf16``, ``int8``, ``adatopk`` or ``adatopk:FRACTION``."""
        name, _, arg = text.partition(":")
        if arg:
            if name != "adatopk":
                raise CodecError(f"codec {name!r} takes no parameter")
            try:
                return cls(name, float(arg))
            except ValueError:
                raise CodecError(f"kept fraction {arg!r} is not a number") from None
        return cls(name)

    def __str__(self) -> str:
        return f"adatopk:{self.fraction:g}" if self.name == "adatopk" else self.name

    # ------------------------------------------------------------ sizes
    def kept(self, numel: int) -> int:
        """adatopk: how many values a tensor of ``numel`` elements keeps."""
        return min(numel, max(1, round(self.fraction * numel))) if numel else 0

    def index_dtype(self) -> torch.dtype:
        return torch.uint8 if self.block <= 256 else torch.int16

    def part_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        """The byte count of each encoded part of a tensor of ``numel`` elements."""
        if self.name == "none":
            return [numel * _itemsize(dtype)]
        if self.name in _CAST:
            return [numel * 2]
        blocks = math.ceil(numel / self.block)
        if self.name == "int8":
            return [blocks * 4, numel]
        k = self.kept(numel)
        return [k * 2, k * (1 if self.block <= 256 else 2)]

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return sum(self.part_sizes(numel, dtype))

    def applies_to(self, t: torch.Tensor) -> bool:
        """Only floating tensors are compressed; integer ones travel raw."""
        return self.name != "none" and t.is_floating_point() and t.numel() > 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _per_block_counts(k: int, blocks: int) -> tuple[int, int]:
    """(base, extra): the first ``extra`` blocks keep ``base + 1`` values, the rest ``base``."""
    return k // blocks, k % blocks


def _padded_blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    blocks = math.ceil(flat.numel() / block)
    pad = blocks * block - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(blocks, block)


def _topk_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest-magnitude values and their indices, row by row in
    order, processed in cache-sized chunks (abs, top-k and gather while hot)."""
    step = max(1, _CHUNK_ELEMENTS // rows.shape[1])
    vals, idx = [], []
    for i in range(0, rows.shape[0], step):
        chunk = rows[i : i + step]
        top = chunk.abs().topk(k, dim=1, sorted=False).indices
        idx.append(top.reshape(-1))
        vals.append(chunk.gather(1, top).reshape(-1))
    return torch.cat(vals) if len(vals) > 1 else vals[0], torch.cat(idx) if len(idx) > 1 else idx[0]


def topk_select(x: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaTopK's choice for ``x``: (values fp32, indices within blocks), block by block."""
    flat = x.detach().reshape(-1).float()
    rows = _padded_blocks(flat, codec.block)
    base, extra = _per_block_counts(codec.kept(flat.numel()), rows.shape[0])
    idx, vals = [], []
    for lo, hi, k in ((0, extra, base + 1), (extra, rows.shape[0], base)):
        if hi > lo and k > 0:
            v, i = _topk_rows(rows[lo:hi], k)
            idx.append(i)
            vals.append(v)
    if not idx:
        return flat.new_zeros(0), torch.zeros(0, dtype=torch.int64)
    return torch.cat(vals) if len(vals) > 1 else vals[0], torch.cat(idx) if len(idx) > 1 else idx[0]


def encode(x: torch.Tensor, codec: Codec) -> tuple[list[memoryview], torch.Tensor]:
    """Encode ``x``; returns the parts to send and what the receiver will decode
    (as ``x``'s dtype and shape)."""
    parts, residual = encode_with_residual(x, codec)
    return parts, (x.detach().float() - residual).to(x.dtype).view(x.shape)


def encode_parts(x: torch.Tensor, codec: Codec) -> list[memoryview]:
    """Just the parts to send (no residual: the fast path for activations)."""
    if codec.name == "adatopk":
        return encode_topk(x, codec)[0]
    if codec.name == "none":
        return [_bytes(x)]
    if codec.name in _CAST:
        return [_bytes(x.detach().to(_CAST[codec.name]))]
    return encode_with_residual(x, codec)[0]


def encode_with_residual(x: torch.Tensor, codec: Codec) -> tuple[list[memoryview], torch.Tensor]:
    """Encode ``x``; returns the parts and what they lose (``x`` minus what the
    receiver decodes, in fp32), which error feedback adds to the next message."""
    if codec.name == "none":
        return [_bytes(x)], torch.zeros(x.shape)
    if codec.name in _CAST:
        small = x.detach().to(_CAST[codec.name])
        return [_bytes(small)], x.detach().float() - small.float()
    if codec.name == "int8":
        flat = x.detach().reshape(-1).float()
        rows = _padded_blocks(flat, codec.block)
        scale = rows.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        approx = (q.float() * scale[:, None]).reshape(-1)[: flat.numel()]
        return [_bytes(scale), _bytes(q.reshape(-1)[: flat.numel()])], (flat - approx).view(x.shape)
    return encode_topk(x, codec, residual=True)  # type: ignore[return-value]


def encode_topk(x: torch.Tensor, codec: Codec, residual: bool = False) -> tuple[list[memoryview], torch.Tensor | None]:
    """AdaTopK's parts for ``x``; with ``residual``, also what they leave out."""
    vals, idx = topk_select(x, codec)
    vals16 = vals.half()
    parts = [_bytes(vals16), _bytes(idx.to(codec.index_dtype()))]
    if not residual:
        return parts, None
    rest = _padded_blocks(x.detach().reshape(-1).float().clone(), codec.block)
    base, extra = _per_block_counts(len(vals), rest.shape[0])
    split = extra * (base + 1)
    for lo, hi, k, sl in ((0, extra, base + 1, slice(0, split)), (extra, rest.shape[0], base, slice(split, None))):
        if hi > lo and k > 0:
            kept = (vals[sl] - vals16[sl].float()).view(hi - lo, k)  # only fp16 rounding stays behind
            rest[lo:hi].scatter_(1, idx[sl].view(hi - lo, k), kept)
    return parts, rest.reshape(-1)[: x.numel()].view(x.shape)


def _scatter(numel: int, codec: Codec, vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    blocks = math.ceil(numel / codec.block)
    base, extra = _per_block_counts(len(vals), blocks)
    out = torch.zeros(blocks, codec.block, dtype=vals.dtype)
    split = extra * (base + 1)
    for lo, hi, k, sl in ((0, extra, base + 1, slice(0, split)), (extra, blocks, base, slice(split, None))):
        if hi > lo and k > 0:
            out[lo:hi].scatter_(1, idx[sl].view(hi - lo, k), vals[sl].view(hi - lo, k))
    return out.reshape(-1)[:numel]


def decode(parts: list[memoryview], codec: Codec, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Rebuild a tensor from its parts; sizes must already match ``part_sizes``."""
    numel = math.prod(shape)
    sizes = codec.part_sizes(numel, dtype)
    if [len(p) for p in parts] != sizes:
        raise CodecError(f"{codec} parts of {[len(p) for p in parts]} bytes, expected {sizes}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if codec.name == "none":
        return _from(parts[0], dtype).view(shape)
    if codec.name in _CAST:
        return _from(parts[0], _CAST[codec.name]).to(dtype).view(shape)
    if codec.name == "int8":
        scale = _from(parts[0], torch.float32)
        q = _from(parts[1], torch.int8)
        blocks = scale.numel()
        padded = torch.zeros(blocks * codec.block, dtype=torch.float32)
        padded[:numel] = q.float()
        return (padded.view(blocks, codec.block) * scale[:, None]).reshape(-1)[:numel].to(dtype).view(shape)
    vals = _from(parts[0], torch.float16).float()
    idx = _from(parts[1], codec.index_dtype()).long()
    if codec.block > 256:
        idx = idx & 0xFFFF  # uint16 stored as int16
    if len(idx) and int(idx.max()) >= codec.block:
        raise CodecError(f"an index {int(idx.max())} is outside its block of {codec.block}")
    return _scatter(numel, codec, vals, idx).to(dtype).view(shape)


def _from(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    if isinstance(buf.obj, (bytes,)) or buf.readonly:
        buf = memoryview(bytearray(buf))
    try:
        return torch.frombuffer(buf, dtype=dtype)
    except ValueError:  # unaligned offset
        return torch.frombuffer(bytearray(buf), dtype=dtype)


class ErrorFeedback:
    """Residuals per (edge, value slot): what compression dropped is added to the
    next tensor sent in that slot, so over many messages nothing is lost."""

    def __init__(self) -> None:
        self.residuals: dict[Any, torch.Tensor] = {}

    def encode(self, key: Any, x: torch.Tensor, codec: Codec) -> list[memoryview]:
        if codec.lossless:
            return encode(x, codec)[0]
        r = self.residuals.get(key)
        target = x.detach().float() if r is None or r.shape != x.shape else x.detach().float() + r
        parts, self.residuals[key] = encode_with_residual(target, codec)
        return parts
