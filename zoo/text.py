"""The built-in text data (``--data stdlib``): the standard library's Python source as bytes."""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


@functools.lru_cache(maxsize=2)
def _stdlib_bytes(max_bytes: int) -> tuple[bytes, bytes]:
    """The standard library's ``.py`` files, every tenth file held out for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        if len(train) + len(val) >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % 10 == 9 else train).extend(data)
    if len(val) < 4096 or len(train) < 4096:
        raise RuntimeError(f"too little Python source under {root} to build the data set")
    return bytes(train), bytes(val)


def stdlib_text(
    seed: int,
    batch_size: int = 16,
    ctx: int = 64,
    split: str = "train",
    max_bytes: int = 8_000_000,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches ``(idx, targets)`` of ``ctx`` bytes from the standard library."""
    train, val = _stdlib_bytes(max_bytes)
    data = torch.frombuffer(bytearray(train if split == "train" else val), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - ctx - 1, (batch_size,), generator=gen)
        chunk = torch.stack([data[s : s + ctx + 1] for s in starts.tolist()]).long()
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
