"""Payload-first frames: on a direct stream, a large payload goes out while it is
hashed, and its signed head (the same head, digest and all) follows it.

A head-first frame must hash its whole payload before its first byte leaves, so a
64 MiB frame spent a tenth of its transfer time hashing before it started. On a
direct stream (``protocol.net.direct``: the sender already proved, with a ticket
its receiver gave it over libp2p, who it is) a payload of ``PAYLOAD_FIRST_MIN``
bytes or more goes instead as: a start (``streams.PAYLOAD_FIRST`` and its size), the
payload, hashed while it is on the wire (from ``THREADED_HASH_MIN``, on another
thread that the writes never wait for), then the head signed over that digest. The
receiver checks the size against its limits and the sender's byte budget before
reading a byte of it, hashes it as it arrives, then checks the head exactly as a
head-first frame's: what is delivered, and the evidence kept, are the same. Only a
direct stream's receiver accepts one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from blake3 import blake3

from protocol.net.budget import ByteBudget
from protocol.net.outgoing import Outgoing
from protocol.net.streams import PAYLOAD_FIRST, PAYLOAD_SIZE, read_frame_head, read_payload
from protocol.wire.encoding import HASH_STEP, THREADED_HASH_MIN, next_stop
from protocol.wire.envelope import HEAD, Envelope, hash_threads
from protocol.wire.gate import Gate
from protocol.wire.messages import Message
from protocol.wire.reject import Reject, Rejected

PAYLOAD_FIRST_MIN = 1 << 20
HEAD_AFTER_S = 30.0  # a payload-first payload's head must follow it within this
PIECE = 4 << 20  # written at once (``THREADED_HASH_MIN`` and up, hashed on another thread; else ``HASH_STEP``)


def pieces(chunks: list[memoryview], size: int = PIECE) -> list[memoryview]:
    """``chunks`` cut, in order, into pieces that end where ``encoding.next_stop``
    ends a hashing step of ``size`` (and where a chunk ends): at most ``size`` bytes
    each, the last ``HASH_TAIL`` bytes pieces of their own."""
    flats = [c.cast("B") if c.format != "B" or c.ndim != 1 else c for c in chunks]
    total = sum(len(f) for f in flats)
    out: list[memoryview] = []
    done, stop = 0, next_stop(0, total, size)
    for flat in flats:
        i = 0
        while i < len(flat):
            n = min(len(flat) - i, stop - done)
            out.append(flat[i : i + n])
            i, done = i + n, done + n
            if done == stop:
                stop = next_stop(done, total, size)
    return out


async def send(writer: asyncio.StreamWriter, out: Outgoing, direct: bool) -> int:
    """Write ``out`` payload first, its head sealed once the payload is hashed (on a
    stream that is not direct, or no longer: hashed, then head first). Returns the
    bytes written."""
    assert out.seal is not None
    if not direct:
        head = out.head_now()
        writer.writelines([head, *out.chunks])
        await writer.drain()
        return len(head) + out.payload_bytes
    chunks, total = out.chunks, out.payload_bytes
    writer.write(HEAD.pack(PAYLOAD_FIRST, 0) + PAYLOAD_SIZE.pack(total))
    # every core only where it is hashed in 4 MiB ``PIECE``s on a thread of its own (4.2-5.1 GB/s on
    # one core, 7.7 on both: RAD's 64 MiB from 1,830-1,974 to 1,983-2,125 MB/s); on the smaller steps
    # hashed as they go (64 KiB-1 MiB) more threads cost more
    digest = blake3(max_threads=hash_threads(total, THREADED_HASH_MIN))
    if total < THREADED_HASH_MIN:  # (a thread's hand-off costs more than hashing it here)
        for piece in pieces(chunks, HASH_STEP):
            writer.write(piece)  # on its way while the next is hashed
            digest.update(piece)
    else:
        await _written_while_hashed(writer, pieces(chunks, PIECE), digest)
    head = out.seal(digest.hexdigest())
    writer.write(head)
    await writer.drain()
    return HEAD.size + PAYLOAD_SIZE.size + total + len(head)


async def _written_while_hashed(writer: asyncio.StreamWriter, parts: list[memoryview], digest: blake3) -> None:
    """Write ``parts`` while another thread hashes them, in order, into ``digest``
    (BLAKE3 lets go of the GIL). The two run apart: the writes never wait for the
    hashing (in step, piece by piece, a 64 MiB frame waited 42 of its 58 ms for it,
    measured), and ``digest`` is complete on return. A write that fails (or is
    cancelled) stops the hashing after the piece it is on."""
    stop = threading.Event()

    def hash_all() -> None:
        for part in parts:
            if stop.is_set():
                return
            digest.update(part)

    hashing = asyncio.ensure_future(asyncio.to_thread(hash_all))
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
    except BaseException:
        stop.set()
        await asyncio.wait({hashing})  # (raises none of the hashing's own: the write's is the one to tell)
        if not hashing.cancelled():
            hashing.exception()
        raise
    await hashing


async def receive(
    reader: asyncio.StreamReader,
    size: int,
    sender: str,
    gate: Gate,
    budget: ByteBudget,
    active: Callable[[], None],
) -> tuple[Envelope, Message, memoryview, bytes]:
    """The rest of a payload-first frame of ``size`` bytes whose prefix was just read:
    (envelope, message, payload, signed head). ``Rejected`` where it fails a check;
    one that leaves the stream out of step has a code in ``faults.FATAL``."""
    if size > gate.max_payload:
        raise Rejected(Reject.OVERSIZED, f"payload-first frame of {size} bytes is over {gate.max_payload}")
    digest = blake3(max_threads=hash_threads(size, THREADED_HASH_MIN))  # as ``send``'s
    async with budget.hold(sender, size):  # held until the head is in: the payload is unproven till then
        payload = await read_payload(reader, size, active, digest)
        try:
            async with asyncio.timeout(HEAD_AFTER_S):
                head = await read_frame_head(reader)
        except TimeoutError:
            raise Rejected(Reject.TRUNCATED, f"no head within {HEAD_AFTER_S:.0f} s of its payload") from None
    if not isinstance(head, bytes):
        raise Rejected(Reject.TRUNCATED, "a payload-first frame without its head")
    env, message = gate.check_head(head, sender)
    if env.lanes is not None or env.payload_bytes != size:
        raise Rejected(Reject.BAD_ENVELOPE, f"a head naming {env.payload_bytes} bytes after a payload of {size}")
    gate.check_payload(env, payload, sender, digest.hexdigest())
    return env, message, payload, head
