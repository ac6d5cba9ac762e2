"""How the transport runs its libp2p stream handlers: while their senders hold few
enough streams open (``StreamLimits``), and ending quietly when cancelled
(``ends_quietly``)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from protocol.wire.gate import Gate
from protocol.wire.reject import Reject, Rejected

#: a libp2p stream handler: (stream info, reader, writer)
Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class StreamLimits:
    """The streams each sender holds open to this process now (``open``), and the
    limits on them: ``per_peer`` for an admitted sender, ``outsider`` for one not
    admitted (yet), ``total`` for everyone together."""

    def __init__(self, gate: Gate, per_peer: int, outsider: int, total: int) -> None:
        self.gate = gate
        self.per_peer = per_peer
        self.outsider = outsider
        self.total = total
        self.open: dict[str, int] = defaultdict(int)  # sender -> its streams open to us now

    def counted(self, handler: Handler) -> Handler:
        """``handler``, run only while its sender holds at most its limit of open
        streams and everyone at most ``total`` (else the stream is closed unread: a
        ``streams`` rejection)."""

        async def run(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sender = info.peer_id.to_base58()
            mine, total = self.open.get(sender, 0), sum(self.open.values())
            own_limit = self.per_peer if sender in self.gate.keys else self.outsider
            if mine >= own_limit or total >= self.total:
                writer.close()
                if self.gate.refuse_stream(sender):  # a muted sender's streams are counted as such
                    return
                if mine >= own_limit:
                    self.gate.reject(sender, Rejected(Reject.STREAMS, f"{mine} of its streams are open"))
                else:  # everyone's limit: not this sender's doing, so not held against it
                    self.gate.counts[Reject.STREAMS] += 1
                return
            self.open[sender] += 1
            try:
                await handler(info, reader, writer)
            finally:
                self.open[sender] -= 1
                if not self.open[sender]:
                    del self.open[sender]

        return run


def ends_quietly(handler: Handler) -> Handler:
    """A stream handler whose cancellation (the transport closing while a stream is
    open) ends it quietly: hivemind logs a cancelled handler as an error traceback."""

    async def run(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(info, reader, writer)
        except asyncio.CancelledError:
            writer.close()

    return run
