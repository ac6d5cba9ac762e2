"""The loader of token shards (``--data tokens:DIR``; the format is ``zoo.shards``).

It maps a shard for each batch and reads only that batch's windows, so its memory
stays flat whatever the corpus size; batch ``n`` depends on ``(seed, split, n)``
alone, so a resumed or rolled-back run starts at any step without replaying the
ones before (``start``)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from protocol.model.job import SpecError
from zoo.shards import SPLITS, ShardError, ShardMeta

#: tells batch streams apart in the seed of a batch's windows
_SPLIT_KEYS = {name: i for i, name in enumerate(SPLITS)}


def vocab_size(path: str) -> int:
    """The vocabulary of the shards in ``path`` (their tokenizer's)."""
    return ShardMeta.read(Path(path)).vocab_size


class Shard:
    """One split's token array, mapped afresh for each read: unmapping drops its
    pages from this process's memory (nanoGPT's loader maps afresh for each batch
    for the same reason)."""

    def __init__(self, directory: Path, split: str) -> None:
        meta = ShardMeta.read(directory)
        if split not in meta.splits:
            held = ", ".join(meta.splits) or "none"
            raise ShardError(f"{directory} has no '{split}' split (it holds: {held}; see --val-fraction)")
        info = meta.splits[split]
        self.path = directory / info.file
        self.dtype = np.dtype(meta.dtype).newbyteorder("<")
        self.tokens = info.tokens
        self.vocab_size = meta.vocab_size
        try:
            size = os.stat(self.path).st_size
        except OSError as exc:
            raise ShardError(f"cannot read {self.path}: {exc.strerror}") from None
        if size != self.tokens * self.dtype.itemsize:
            raise ShardError(f"{self.path} holds {size} bytes, not {self.tokens} tokens of {meta.dtype} as meta says")

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``length`` tokens from each of ``starts``, as int64 rows: the file is mapped
        for this read only, and only the pages of these windows are touched."""
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                    mm.madvise(mmap.MADV_RANDOM)  # no read-ahead around scattered windows
                data = np.frombuffer(mm, dtype=self.dtype, count=self.tokens)
                rows = data[starts[:, None] + np.arange(length)].astype(np.int64)
                del data  # the buffer's last export: the map can close
        except (OSError, ValueError) as exc:  # the file went away, or shrank, since the run began
            raise ShardError(f"cannot read {self.path}: {exc}") from None
        if rows.size and int(rows.max()) >= self.vocab_size:
            raise ShardError(f"{self.path} holds token {int(rows.max())}, outside its vocabulary of {self.vocab_size}")
        return rows


def batch_starts(seed: int, split: str, step: int, batch_size: int, high: int) -> np.ndarray:
    """The window starts of batch ``step``: uniform in ``[0, high)``, drawn from a
    generator seeded by ``(seed, split, step)`` alone."""
    rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, _SPLIT_KEYS[split], step])
    return rng.integers(0, high, size=batch_size, dtype=np.int64)


def token_batches(
    seed: int,
    batch_size: int = 16,
    ctx: int = 64,
    split: str = "train",
    path: str = "",
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches ``(idx, targets)`` of ``ctx`` tokens from the shards in ``path``,
    beginning with batch ``start``; the shards are checked before the first is asked for."""
    try:
        if split not in SPLITS:
            raise ShardError(f"split '{split}' is not one of {', '.join(SPLITS)}")
        if batch_size < 1 or ctx < 1 or start < 0:
            raise ShardError(f"batch_size {batch_size} and ctx {ctx} must be at least 1, start {start} at least 0")
        shard = Shard(Path(path), split)
        if shard.tokens - ctx < 1:  # a window of ctx + 1 tokens starts before tokens - ctx
            raise ShardError(f"its '{split}' split holds {shard.tokens} tokens, fewer than ctx + 2 = {ctx + 2}")
    except ShardError as exc:
        raise SpecError(f"data 'tokens:{path}': {exc}") from None
    return _batches(shard, seed, batch_size, ctx, split, start)


def _batches(
    shard: Shard, seed: int, batch_size: int, ctx: int, split: str, step: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        starts = batch_starts(seed, split, step, batch_size, shard.tokens - ctx)
        try:
            rows = torch.from_numpy(shard.windows(starts, ctx + 1))
        except ShardError as exc:
            raise SpecError(f"data 'tokens:{shard.path.parent}': {exc}") from None
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        step += 1
