"""Messages a peer waits for, keyed by what they are for."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Hashable
from typing import Any


class Mailbox:
    """``put(key, item)`` and ``await get(key)`` in either order; one item per key."""

    def __init__(self) -> None:
        self._items: dict[Hashable, asyncio.Future[Any]] = defaultdict(
            lambda: asyncio.get_running_loop().create_future()
        )
        self._failure: BaseException | None = None

    def put(self, key: Hashable, item: Any) -> None:
        fut = self._items[key]
        if not fut.done():
            fut.set_result(item)

    async def get(self, key: Hashable, timeout: float | None = None) -> Any:
        if self._failure is not None:
            raise self._failure
        fut = self._items[key]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            if fut.done():
                self._items.pop(key, None)

    def fail(self, exc: BaseException) -> None:
        """Wake every waiter with ``exc`` (e.g. the run was aborted)."""
        self._failure = exc
        for fut in self._items.values():
            if not fut.done():
                fut.set_exception(exc)
