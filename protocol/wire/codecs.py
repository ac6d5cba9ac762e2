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
- ``int4``: blocks of ``block`` elements (128 unless said), each with a bf16 step
  (its absolute maximum / 7.5, rounded up) and 4-bit codes (two per byte) for the
  16 levels (code - 7.5) x step, which span [-max, max]. Rounding to the nearest
  level errs by at most half a step; with ``stochastic`` a value rounds up or down
  with the probabilities that make the level's expectation the value itself
  (unbiased, error below one step): gradients use that, so compression adds noise,
  not bias.
- ``lowrank``: the tensor as a matrix (rows = all but its last dimension) cut to
  its ``rank`` largest singular triplets: U as fp16 (entries within [-1, 1]), the
  singular values as fp32, V^T as fp16. Activations between transformer blocks
  are close to low-rank (rank 8 of 128 keeps all but ~1% of their norm in the demo
  GPT), which top-k in the channel basis cannot exploit.

A link may use one codec forward and another for the gradients coming back
(``grad``): the pair ``lowrank:8/int4sr`` sends activations at rank 8 and their
gradients as unbiased 4-bit codes.

A codec's description is part of the value's JSON description, so a receiver
knows, from the shape and the codec alone, the exact byte count of every part;
anything else is rejected.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

CODECS = ("none", "fp16", "bf16", "int8", "adatopk", "int4", "lowrank")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the largest finite fp16 value: fp16 codecs saturate there, so a finite value never arrives as inf
FP16_MAX = 65504.0


def _narrow(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` in a codec's 16-bit dtype; fp16 saturates instead of overflowing (NaN stays NaN)."""
    if name == "fp16":
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(_CAST[name])


#: rows of blocks processed at once: a chunk stays in cache through abs/topk/gather
_CHUNK_ELEMENTS = 1 << 20


class CodecError(ValueError):
    """A codec spec or encoded tensor that does not follow the codec's rules."""


@dataclass(frozen=True)
class Codec:
    """Which codec a link uses, and its parameters."""

    name: str = "none"
    fraction: float = 1.0  # adatopk: the kept fraction of each tensor's elements
    block: int = 0  # int8, int4 and adatopk: elements per block (0: 128 for int4, else 256)
    rank: int = 8  # lowrank: singular triplets kept
    stochastic: bool = False  # int4: unbiased stochastic rounding
    grad: Codec | None = None  # the codec of the gradients coming back (None: this one)

    def __post_init__(self) -> None:
        if self.block == 0:  # the codec's default
            object.__setattr__(self, "block", 128 if self.name == "int4" else 256)
        if self.name not in CODECS:
            raise CodecError(f"unknown codec {self.name!r} (known: {', '.join(CODECS)})")
        if not (isinstance(self.fraction, float) and 0.0 < self.fraction <= 1.0):
            raise CodecError(f"kept fraction {self.fraction!r} is not in (0, 1]")
        if not (isinstance(self.block, int) and not isinstance(self.block, bool) and 2 <= self.block <= 65536):
            raise CodecError(f"block size {self.block!r} is not in [2, 65536]")
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and 1 <= self.rank <= 65536):
            raise CodecError(f"rank {self.rank!r} is not in [1, 65536]")
        if not isinstance(self.stochastic, bool):
            raise CodecError(f"'stochastic' {self.stochastic!r} is not a boolean")
        if self.stochastic and self.name != "int4":
            raise CodecError(f"stochastic rounding is int4's, not {self.name}'s")
        if self.name != "lowrank" and self.rank != 8:  # the JSON of other codecs carries no rank
            object.__setattr__(self, "rank", 8)
        if self.grad is not None and (not isinstance(self.grad, Codec) or self.grad.grad is not None):
            raise CodecError("a gradient codec must be a plain codec")

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    @functools.cached_property
    def forward(self) -> Codec:
        """The codec of the values sent forward (activations)."""
        return self if self.grad is None else Codec(self.name, self.fraction, self.block, self.rank, self.stochastic)

    @functools.cached_property
    def backward(self) -> Codec:
        """The codec of the gradients sent back."""
        return self.forward if self.grad is None else self.grad

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "fraction": self.fraction, "block": self.block}
        if self.name == "lowrank":
            d["rank"] = self.rank
        if self.stochastic:
            d["stochastic"] = True
        if self.grad is not None:
            d["grad"] = self.grad.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any, nested: bool = False) -> Codec:
        if not isinstance(d, dict):
            raise CodecError("codec spec is not an object")
        fraction = d.get("fraction", 1.0)
        if isinstance(fraction, int) and not isinstance(fraction, bool):
            fraction = float(fraction)
        grad = d.get("grad")
        if grad is not None and nested:
            raise CodecError("a gradient codec must be a plain codec")
        return cls(
            str(d.get("name", "none")),
            fraction,
            d.get("block", 0),
            d.get("rank", 8),
            d.get("stochastic", False),
            None if grad is None else cls.from_json(grad, nested=True),
        )

    @classmethod
    def parse(cls, text: str) -> Codec:
        """``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int4sr`` (stochastic
        rounding), ``adatopk[:FRACTION]``, ``lowrank[:RANK]``, or ``FORWARD/GRAD``: one
        codec for the activations and another for their gradients."""
        if "/" in text:
            fwd, _, back = text.partition("/")
            if "/" in back:
                raise CodecError(f"{text!r}: at most one codec forward and one for the gradients")
            f, b = cls.parse(fwd), cls.parse(back)
            return cls(f.name, f.fraction, f.block, f.rank, f.stochastic, b)
        name, _, arg = text.partition(":")
        if name == "int4sr" and not arg:
            return cls("int4", stochastic=True)
        if arg:
            try:
                if name == "adatopk":
                    return cls(name, float(arg))
                if name == "lowrank":
                    return cls(name, rank=int(arg))
            except ValueError:
                raise CodecError(f"{name} parameter {arg!r} is not a number") from None
            raise CodecError(f"codec {name!r} takes no parameter")
        return cls(name)

    def __str__(self) -> str:
        if self.grad is not None:
            return f"{self.forward}/{self.grad}"
        if self.name == "adatopk":
            return f"adatopk:{self.fraction:g}"
        if self.name == "lowrank":
            return f"lowrank:{self.rank}"
        return "int4sr" if self.name == "int4" and self.stochastic else self.name

    # ------------------------------------------------------------ sizes
    def kept(self, numel: int) -> int:
        """adatopk: how many values a tensor of ``numel`` elements keeps."""
        return min(numel, max(1, round(self.fraction * numel))) if numel else 0

    def index_dtype(self) -> torch.dtype:
        return torch.uint8 if self.block <= 256 else torch.int16

    def part_sizes(self, numel: int, dtype: torch.dtype, shape: list[int] | None = None) -> list[int]:
        """The byte count of each encoded part of a tensor of ``numel`` elements
        (``lowrank`` also needs its ``shape``; without one it is a single row)."""
        if self.name == "none":
            return [numel * _itemsize(dtype)]
        if self.name in _CAST:
            return [numel * 2]
        blocks = math.ceil(numel / self.block)
        if self.name == "int8":
            return [blocks * 4, numel]
        if self.name == "int4":
            return [blocks * 2, (numel + 1) // 2]
        if self.name == "lowrank":
            rows, cols = matrix_shape(numel, shape)
            r = self.rank_for(rows, cols)
            return [rows * r * 2, r * 4, r * cols * 2]
        k = self.kept(numel)
        return [k * 2, k * (1 if self.block <= 256 else 2)]

    def wire_bytes(self, numel: int, dtype: torch.dtype, shape: list[int] | None = None) -> int:
        return sum(self.part_sizes(numel, dtype, shape))

    def rank_for(self, rows: int, cols: int) -> int:
        """lowrank: the triplets a ``rows`` x ``cols`` matrix keeps."""
        return min(self.rank, rows, cols)

    def applies_to(self, t: torch.Tensor) -> bool:
        """Only floating tensors are compressed; integer ones travel raw."""
        return self.name != "none" and t.is_floating_point() and t.numel() > 0


def finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds only finite numbers. First its sum: NaN and
    infinity carry through any sum, so a finite sum proves every element finite (one
    pass and one number read, 3.6 us for a 128 KiB activation here). A sum that is not
    finite may be an overflow of finite numbers, so then its least and greatest
    decide (``torch.aminmax`` carries NaN on; 33 us, and 3-6x faster than
    ``torch.isfinite(t).all()``, which builds a mask as large as the tensor)."""
    if t.numel() == 0:
        return True
    t = t.detach()
    try:
        if math.isfinite(float(t.sum())):
            return True
        low, high = torch.aminmax(t)
    except (NotImplementedError, RuntimeError):  # a dtype without them here (float8 on a CPU)
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def matrix_shape(numel: int, shape: list[int] | None) -> tuple[int, int]:
    """(rows, columns) of a tensor seen as a matrix: its last dimension is the columns."""
    if shape and len(shape) >= 2 and shape[-1] > 0:
        return numel // shape[-1], shape[-1]
    return (1, numel) if numel else (0, 0)


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
    if codec.name in ("int4", "lowrank"):
        parts = encode_parts(x, codec)
        return parts, decode(parts, codec, x.dtype, list(x.shape))
    parts, residual = encode_with_residual(x, codec)
    return parts, (x.detach().float() - residual).to(x.dtype).view(x.shape)


def encode_parts(x: torch.Tensor, codec: Codec, generator: torch.Generator | None = None) -> list[memoryview]:
    """Just the parts to send (no residual: the fast path for activations).
    ``generator`` drives stochastic rounding (int4 with ``stochastic``)."""
    if codec.name == "adatopk":
        return encode_topk(x, codec)[0]
    if codec.name == "none":
        return [_bytes(x)]
    if codec.name in _CAST:
        return [_bytes(_narrow(x.detach(), codec.name))]
    if codec.name == "int4":
        return encode_int4(x, codec, generator)
    if codec.name == "lowrank":
        return encode_lowrank(x, codec)
    return encode_with_residual(x, codec)[0]


def encode_int4(x: torch.Tensor, codec: Codec, generator: torch.Generator | None = None) -> list[memoryview]:
    """int4's parts: the bf16 step of each block, then the 4-bit codes two per byte,
    the first in the low nibble."""
    flat = x.detach().reshape(-1).float()
    rows = _padded_blocks(flat, codec.block)
    # max / 7.5, nudged up so that rounding to bf16 never makes the step smaller
    step = rows.abs().amax(dim=1).clamp_min_(1e-30).mul_((1 + 2**-7) / 7.5).to(torch.bfloat16)
    v = (rows / step.float()[:, None]).add_(7.5)  # in [0, 15]; rounded in place from here on
    if codec.stochastic:
        v.add_(torch.rand(v.shape, generator=generator)).floor_()
    else:
        v.round_()
    codes = v.clamp_(0, 15).to(torch.uint8).reshape(-1)[: flat.numel()]
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return [_bytes(step), _bytes(packed)]


def encode_lowrank(x: torch.Tensor, codec: Codec) -> list[memoryview]:
    """lowrank's parts: U (rows x r, fp16), the singular values (fp32), V^T (r x
    columns, fp16). Small matrices get an exact SVD, large ones a randomized one."""
    rows, cols = matrix_shape(x.numel(), list(x.shape))
    r = codec.rank_for(rows, cols)
    m = x.detach().reshape(rows, cols).float()
    if not finite(m):  # what raw bytes would carry on: NaN everywhere
        nan = torch.full((r,), math.nan)
        return [_bytes(torch.zeros(rows, r).half()), _bytes(nan), _bytes(torch.zeros(r, cols).half())]
    try:
        if min(rows, cols) > 1024:
            raise torch.linalg.LinAlgError("large: randomized")
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        u, s, vh = u[:, :r], s[:r], vh[:r]
    except torch.linalg.LinAlgError:  # too large, or the exact SVD did not converge
        u, s, v = torch.svd_lowrank(m, q=min(r + 8, rows, cols), niter=4)
        u, s, vh = u[:, :r], s[:r], v[:, :r].T
    return [_bytes(u.half()), _bytes(s.contiguous()), _bytes(vh.half())]


def encode_with_residual(x: torch.Tensor, codec: Codec) -> tuple[list[memoryview], torch.Tensor]:
    """Encode ``x``; returns the parts and what they lose (``x`` minus what the
    receiver decodes, in fp32), which error feedback adds to the next message."""
    if codec.name in ("int4", "lowrank"):
        parts = encode_parts(x, codec)
        back = decode(parts, codec, torch.float32, list(x.shape))
        return parts, x.detach().float() - back
    if codec.name == "none":
        return [_bytes(x)], torch.zeros(x.shape)
    if codec.name in _CAST:
        small = _narrow(x.detach(), codec.name)
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
    vals16 = _narrow(vals, "fp16")
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
    sizes = codec.part_sizes(numel, dtype, shape)
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
    if codec.name == "int4":
        step = _from(parts[0], torch.bfloat16).float()
        packed = _from(parts[1], torch.uint8)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
        blocks = step.numel()
        padded = torch.zeros(blocks * codec.block, dtype=torch.float32)
        padded[:numel] = codes.float() - 7.5
        return (padded.view(blocks, codec.block) * step[:, None]).reshape(-1)[:numel].to(dtype).view(shape)
    if codec.name == "lowrank":
        rows, cols = matrix_shape(numel, shape)
        r = codec.rank_for(rows, cols)
        u = _from(parts[0], torch.float16).float().view(rows, r)
        s = _from(parts[1], torch.float32)
        vh = _from(parts[2], torch.float16).float().view(r, cols)
        return ((u * s) @ vh).to(dtype).view(shape)
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
        if codec.lossless or codec.stochastic:  # unbiased codes need no feedback
            return encode_parts(x, codec)
        r = self.residuals.get(key)
        target = x.detach().float() if r is None or r.shape != x.shape else x.detach().float() + r
        parts, self.residuals[key] = encode_with_residual(target, codec)
        return parts
