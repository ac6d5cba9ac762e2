"""Receive buffers used again (``protocol.wire.buffers``) and a payload written while
another thread hashes it (``protocol.net.payload_first``)."""

from __future__ import annotations

import asyncio
import gc
import threading

import torch
from blake3 import blake3

from protocol.net.payload_first import _written_while_hashed, pieces
from protocol.wire.buffers import POOL_MIN, Buffers

MIB = 1 << 20


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def test_a_buffer_is_used_again_only_once_nothing_holds_it() -> None:
    pool = Buffers(keep_bytes=64 * MIB)
    first = pool.take(4 * MIB)
    where = _address(first)
    tensor = torch.frombuffer(first, dtype=torch.float32)  # as a decoded payload holds it
    del first
    held = pool.take(4 * MIB)  # the tensor still holds the first: a new buffer
    assert _address(held) != where
    del tensor, held
    gc.collect()
    again = pool.take(4 * MIB)
    assert _address(again) == where  # the first, free again
    assert pool.held_bytes == 8 * MIB


def test_a_freed_buffer_comes_back_and_its_view_is_whole_and_writable() -> None:
    pool = Buffers(keep_bytes=64 * MIB)
    view = pool.take(2 * MIB)
    where = _address(view)
    view[:3] = b"abc"
    del view
    again = pool.take(2 * MIB)
    assert _address(again) == where
    assert len(again) == 2 * MIB and not again.readonly
    assert pool.held_bytes == 2 * MIB


def test_what_the_pool_keeps_is_capped_and_the_oldest_goes_first() -> None:
    pool = Buffers(keep_bytes=10 * MIB)
    held = [pool.take(4 * MIB), pool.take(4 * MIB), pool.take(3 * MIB)]  # 11 MiB: one 4 MiB let go
    assert pool.held_bytes == 7 * MIB
    too_big = pool.take(11 * MIB)  # over the cap: handed out, never kept
    assert len(too_big) == 11 * MIB and pool.held_bytes == 7 * MIB
    del held, too_big


def test_small_buffers_are_not_pooled() -> None:
    pool = Buffers()
    view = pool.take(POOL_MIN - 1)
    assert len(view) == POOL_MIN - 1 and pool.held_bytes == 0


class _Writer:
    """A stream writer that records what it was given."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: memoryview) -> None:
        self.written.append(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)


class _HeldDigest:
    """A hasher that blocks until ``release`` is set, then hashes as BLAKE3."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inner = blake3()

    def update(self, data: memoryview) -> None:
        assert self.release.wait(10)
        self.inner.update(data)


def test_a_payload_is_written_without_waiting_for_its_hashing() -> None:
    """Piece by piece in step, each write waited for its piece's hash: 42 of a 64 MiB
    frame's 58 ms on loopback. Now every piece is written while the first is still
    being hashed, and the digest is whole once the send returns."""
    payload = bytes(range(256)) * (40 * 1024 + 3)
    parts = pieces([memoryview(payload)], 1 << 20)
    writer, digest = _Writer(), _HeldDigest()

    async def run() -> None:
        task = asyncio.ensure_future(_written_while_hashed(writer, parts, digest))  # type: ignore[arg-type]
        for _ in range(100):
            if len(writer.written) == len(parts):
                break
            await asyncio.sleep(0.01)
        assert len(writer.written) == len(parts)  # all written, no piece hashed yet
        assert not task.done()  # and the send waits for the digest
        digest.release.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    assert b"".join(writer.written) == payload
    assert digest.inner.hexdigest() == blake3(payload).hexdigest()
