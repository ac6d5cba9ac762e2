"""Receive buffers used again once nothing holds them.

A large payload is received straight into a buffer of its size
(``encoding.read_growing``), and its tensors are views of that buffer. A new buffer's
pages are made resident as the bytes land, one fault per page: for 64 MiB that cost
16-21 ms here, half of the frame's whole transfer time over loopback TCP. ``take``
hands out a buffer of ``size`` bytes that an earlier payload used and that nothing
refers to any more (its tensors, views and memoryviews all gone), else a new one.
What is kept for later is capped at ``KEEP_BYTES`` in all, the oldest let go first,
so what a stranger sends bounds nothing beyond what its byte budget already allows.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy

POOL_MIN = 1 << 20  # smaller buffers come from the allocator's own free lists, resident already
KEEP_BYTES = 512 << 20
_ONLY_POOL = 2  # references to a free buffer: the pool's list, and getrefcount's argument


class Buffers:
    """A pool of receive buffers (``take``); thread-safe."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._sizes: OrderedDict[int, list[numpy.ndarray]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable byte view of ``size`` bytes: a free pooled buffer's, else a new one's
        (pooled where it fits under the cap). ``MemoryError`` where there is no room."""
        if size < POOL_MIN:
            return memoryview(numpy.empty(size, dtype=numpy.uint8)).cast("B")
        with self._lock:
            found = self._free(size)
            if found is None:
                found = numpy.empty(size, dtype=numpy.uint8)
                self._keep(size, found)
            return memoryview(found).cast("B")

    @property
    def held_bytes(self) -> int:
        return self._held

    def _free(self, size: int) -> numpy.ndarray | None:
        kept = self._sizes.get(size)
        if not kept:
            return None
        for i in range(len(kept)):
            if sys.getrefcount(kept[i]) == _ONLY_POOL:
                self._sizes.move_to_end(size)
                return kept[i]
        return None

    def _keep(self, size: int, array: numpy.ndarray) -> None:
        if size > self.keep_bytes:
            return
        self._sizes.setdefault(size, []).append(array)
        self._sizes.move_to_end(size)
        self._held += size
        while self._held > self.keep_bytes:
            oldest = next(iter(self._sizes))
            kept = self._sizes[oldest]
            kept.pop(0)
            self._held -= oldest
            if not kept:
                del self._sizes[oldest]


#: the process's pool (one per process: what it keeps is capped for the process)
BUFFERS = Buffers()
