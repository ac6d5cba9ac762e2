"""Receive buffers used again once nothing holds them.

A large payload is received straight into a buffer of its size
(``encoding.read_growing``), and its tensors are views of that buffer. A new buffer's
pages are made resident as the bytes land, one fault per page: for 64 MiB that cost
16-21 ms here, half of the frame's whole transfer time over loopback TCP. ``take``
hands out a buffer of ``size`` bytes that an earlier payload used and that nothing
refers to any more (its tensors, views and memoryviews all gone), else a new one.

What a stranger sends must not make the process keep memory once its frames are
gone: a size is pooled only once it has been asked for ``REPEATS`` times (an honest
run's activations come in a few sizes, every step), at most ``PER_SIZE`` buffers of
it, ``KEEP_BYTES`` in all (the least recently used size let go first), and a free
buffer left unused ``IDLE_S`` is let go at the next ``take``.

Whether a buffer is free is read from its reference count: a view of it that gives
its export back while still used (``memoryview.release()`` under a tensor made by
``torch.frombuffer``) would hide a use; no payload path does that. The count an
unreferenced pooled buffer has is measured at import, and pooling is off where a view
does not show in it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy

POOL_MIN = 1 << 20  # smaller buffers come from the allocator's own free lists, resident already
KEEP_BYTES = 256 << 20
PER_SIZE = 4  # an activation's payloads in flight at once (1F1B keeps a few per stage)
REPEATS = 2
IDLE_S = 60.0
_SIZES_SEEN = 64  # sizes whose asks are counted, the least recently asked forgotten first


class _Kept:
    __slots__ = ("array", "used")

    def __init__(self, array: numpy.ndarray, used: float) -> None:
        self.array, self.used = array, used


def _count(kept: list[_Kept], i: int) -> int:
    """References to ``kept[i]``'s array, as ``Buffers`` reads them."""
    return sys.getrefcount(kept[i].array)


def _unreferenced_count() -> int | None:
    """What ``_count`` reads for a buffer only the pool holds; None where a view of it
    does not raise the count (this interpreter does not count as CPython 3.11 does)."""
    kept = [_Kept(numpy.empty(8, dtype=numpy.uint8), 0.0)]
    alone = _count(kept, 0)
    view = memoryview(kept[0].array)
    held = _count(kept, 0)
    del view
    return alone if held > alone else None


_ALONE = _unreferenced_count()


class Buffers:
    """A pool of receive buffers (``take``); thread-safe."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_bytes = keep_bytes
        self.clock = clock
        self._sizes: OrderedDict[int, list[_Kept]] = OrderedDict()
        self._asked: OrderedDict[int, int] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def take(self, size: int) -> memoryview:
        """A writable byte view of ``size`` bytes: a free pooled buffer's, else a new one's
        (pooled where its size came often enough and it fits). ``MemoryError`` where there
        is no room."""
        if size < POOL_MIN or _ALONE is None:
            return memoryview(numpy.empty(size, dtype=numpy.uint8)).cast("B")
        with self._lock:
            now = self.clock()
            self._let_go_idle(now)
            found = self._free(size, now)
            if found is None:
                found = numpy.empty(size, dtype=numpy.uint8)
                if self._often(size):
                    self._keep(size, _Kept(found, now))
            return memoryview(found).cast("B")

    def _often(self, size: int) -> bool:
        asked = self._asked.pop(size, 0) + 1
        self._asked[size] = asked
        while len(self._asked) > _SIZES_SEEN:
            self._asked.popitem(last=False)
        return asked >= REPEATS

    def _free(self, size: int, now: float) -> numpy.ndarray | None:
        kept = self._sizes.get(size, [])
        for i in range(len(kept)):
            if _count(kept, i) == _ALONE:
                kept[i].used = now
                self._sizes.move_to_end(size)
                return kept[i].array
        return None

    def _keep(self, size: int, entry: _Kept) -> None:
        if size > self.keep_bytes or len(self._sizes.get(size, ())) >= PER_SIZE:
            return
        self._sizes.setdefault(size, []).append(entry)
        self._sizes.move_to_end(size)
        self._held += size
        while self._held > self.keep_bytes:
            oldest = next(iter(self._sizes))
            self._drop(oldest, 0)

    def _let_go_idle(self, now: float) -> None:
        for size in list(self._sizes):
            kept = self._sizes[size]
            for i in reversed(range(len(kept))):
                if now - kept[i].used > IDLE_S and _count(kept, i) == _ALONE:
                    self._drop(size, i)

    def _drop(self, size: int, i: int) -> None:
        kept = self._sizes[size]
        kept.pop(i)
        self._held -= size
        if not kept:
            del self._sizes[size]


#: the process's pool (one per process: what it keeps is capped for the process)
BUFFERS = Buffers()
