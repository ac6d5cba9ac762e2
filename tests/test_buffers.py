"""Receive buffers used again (``protocol.wire.buffers``) and a payload written while
another thread hashes it (``protocol.net.payload_first``)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
import torch
from blake3 import blake3

from protocol.net.payload_first import _written_while_hashed, pieces
from protocol.wire.buffers import IDLE_S, PER_SIZE, POOL_MIN, Buffers

MIB = 1 << 20


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def _pool(keep_bytes: int = 64 * MIB) -> tuple[Buffers, list[float]]:
    now = [0.0]
    return Buffers(keep_bytes, clock=lambda: now[0]), now


def test_a_buffer_is_used_again_only_once_nothing_holds_it() -> None:
    pool, _ = _pool()
    pool.take(4 * MIB)  # the size's first ask: not pooled
    first = pool.take(4 * MIB)  # its second: pooled
    where = _address(first)
    tensor = torch.frombuffer(first, dtype=torch.float32)  # as a decoded payload holds it
    reshaped = tensor.view(-1, 4).t()[1:]  # and views of it
    del first, tensor
    held = pool.take(4 * MIB)  # a view still holds the first: a new buffer
    assert _address(held) != where
    del reshaped, held
    gc.collect()
    again = pool.take(4 * MIB)
    assert _address(again) == where  # the first, free again
    assert pool.held_bytes == 8 * MIB


def test_a_freed_buffer_comes_back_whole_and_writable() -> None:
    pool, _ = _pool()
    pool.take(2 * MIB)
    view = pool.take(2 * MIB)
    where = _address(view)
    view[:3] = b"abc"
    sliced = view[MIB:].cast("B")
    del view
    assert _address(pool.take(2 * MIB)) != where  # a slice of it is still held
    del sliced
    again = pool.take(2 * MIB)
    assert _address(again) == where
    assert len(again) == 2 * MIB and not again.readonly


def test_sizes_that_never_repeat_leave_nothing_kept() -> None:
    """A stranger's frames of ever new sizes: each allocated and let go, as before."""
    pool, _ = _pool()
    for i in range(40):
        pool.take(POOL_MIN + i)
    assert pool.held_bytes == 0


def test_what_the_pool_keeps_is_capped_per_size_and_in_all() -> None:
    pool, _ = _pool(keep_bytes=10 * MIB)
    for size in (4 * MIB, 3 * MIB):
        pool.take(size)
    held = [pool.take(4 * MIB), pool.take(4 * MIB), pool.take(3 * MIB)]  # 11 MiB: the oldest 4 MiB let go
    assert pool.held_bytes == 7 * MIB
    pool.take(11 * MIB)
    too_big = pool.take(11 * MIB)  # over the cap: handed out, never kept
    assert len(too_big) == 11 * MIB and pool.held_bytes == 7 * MIB
    small, _ = _pool()
    small.take(POOL_MIN)
    many = [small.take(POOL_MIN) for _ in range(PER_SIZE + 3)]
    assert small.held_bytes == PER_SIZE * POOL_MIN
    del held, too_big, many


def test_a_free_buffer_left_unused_is_let_go() -> None:
    pool, now = _pool()
    pool.take(2 * MIB)
    pool.take(2 * MIB)
    assert pool.held_bytes == 2 * MIB
    now[0] = IDLE_S + 1
    pool.take(3 * MIB)  # any later take lets go of what sat unused
    assert pool.held_bytes == 0


def test_small_buffers_are_not_pooled() -> None:
    pool, _ = _pool()
    for _ in range(3):
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


class _Broken(_Writer):
    """A stream whose peer is gone after the first piece."""

    async def drain(self) -> None:
        raise ConnectionResetError("peer gone")


class _SlowDigest:
    """A hasher that takes 20 ms a piece and counts them."""

    def __init__(self) -> None:
        self.pieces = 0

    def update(self, data: memoryview) -> None:
        time.sleep(0.02)
        self.pieces += 1


def test_a_failed_write_stops_the_hashing_and_raises_its_own_error() -> None:
    """It went on hashing the whole payload (17 pieces) before the write's error came out."""
    parts = pieces([memoryview(bytes(17 << 20))], 1 << 20)
    digest = _SlowDigest()

    async def run() -> None:
        with pytest.raises(ConnectionResetError, match="peer gone"):
            await _written_while_hashed(_Broken(), parts, digest)  # type: ignore[arg-type]

    asyncio.run(run())
    assert len(parts) >= 17 and digest.pieces <= 2
