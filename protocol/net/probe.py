"""Bandwidth probes between admitted peers: a timed upload, acknowledged, then a timed
download of at most what was uploaded. The answering side charges each sender's
probes to a budget per minute, so a probe can neither amplify traffic nor hold
memory; ``protocol.net.transport`` runs both sides over its streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from protocol.net.streams import discard, linger
from protocol.wire.encoding import WireError, read_head, write_frame
from protocol.wire.gate import Gate
from protocol.wire.reject import Reject, Rejected

BW_PROTOCOL = "/fusionllm/bw/1"
#: a bandwidth probe moves at most MAX_PROBE_BYTES each way; one sender's probes at
#: most PROBE_BUDGET_BYTES (both ways) per PROBE_WINDOW_S
MAX_PROBE_BYTES = 64 << 20
PROBE_BUDGET_BYTES = 256 << 20
PROBE_WINDOW_S = 60.0
PROBE_LINGER_S = 5.0  # a probe's answer is kept open until the prober has read it (or this long)
PROBE_MIN_CHARGE = 1 << 20  # what the budget counts for a probe, however small: a stream held is not free
_ZEROS = bytes(1 << 20)
#: how long a probe waits for its sender's hello to be admitted
ADMISSION_WAIT_S = 10.0

logger = logging.getLogger(__name__)


class ProbeBudget:
    """What each sender's probes moved in the last ``PROBE_WINDOW_S``."""

    def __init__(self) -> None:
        self._probes: dict[str, list[tuple[float, int]]] = {}  # sender -> (when, bytes) of its recent probes

    def spend(self, sender: str, nbytes: int) -> None:
        """Charge a probe to the sender's budget for the last minute, or refuse it."""
        now = time.monotonic()
        spent = [(t, n) for t, n in self._probes.get(sender, []) if now - t < PROBE_WINDOW_S]
        if sum(n for _, n in spent) + nbytes > PROBE_BUDGET_BYTES:
            raise Rejected(Reject.PROBE_LIMIT, f"bandwidth probes over {PROBE_BUDGET_BYTES >> 20} MiB a minute")
        self._probes[sender] = [*spent, (now, nbytes)]


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: str, budget: ProbeBudget) -> None:
    """Answer one probe of ``sender`` (admitted): read its head, charge it, read (and drop)
    the upload, acknowledge, send the bytes it asked back, and keep the stream open
    until the prober has read them (or ``PROBE_LINGER_S``)."""
    header = await read_head(reader, MAX_PROBE_BYTES)
    if header is None:
        return
    up, down = header["payload_bytes"], header.get("down_bytes", 0)
    if not isinstance(down, int) or not 0 <= down <= up:
        raise Rejected(Reject.PROBE_LIMIT, f"a probe asking {down!r} bytes back for {up} sent")
    budget.spend(sender, max(up + down, PROBE_MIN_CHARGE))
    await discard(reader, up)
    writer.write(b"A")
    await writer.drain()
    for at in range(0, down, len(_ZEROS)):
        writer.write(_ZEROS[: min(len(_ZEROS), down - at)])
        await writer.drain()
    await linger(reader, PROBE_LINGER_S)


async def measure(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    nbytes: int,
    down: bool,
    pace: Callable[[], Awaitable[None]],
) -> tuple[float, float]:
    """Probe over an open stream: (upload, download) in Mbit/s (download 0.0 when not
    measured); ``pace`` waits as long as the paced link takes for the upload."""
    down_bytes = nbytes if down else 0
    blob = torch.zeros(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    await pace()
    await write_frame(writer, {"down_bytes": down_bytes}, [blob])
    await reader.readexactly(1)
    up_s = time.perf_counter() - start
    start = time.perf_counter()
    await reader.readexactly(down_bytes)
    down_s = time.perf_counter() - start
    return nbytes * 8 / up_s / 1e6, (down_bytes * 8 / down_s / 1e6 if down_bytes else 0.0)


async def serve(
    gate: Gate, budget: ProbeBudget, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """``BW_PROTOCOL``'s stream handler: answer a probe of an admitted peer (or one the
    coordinator let in: ``Gate.allow_probe``), its hello allowed a moment to arrive first."""
    sender = info.peer_id.to_base58()
    try:
        if gate.refuse_stream(sender):
            return
        await admitted_soon(gate, sender)
        gate.check_prober(sender)
        await answer(reader, writer, sender, budget)
    except Rejected as exc:
        gate.reject(sender, exc)
    except (WireError, ConnectionError, ValueError, asyncio.IncompleteReadError) as exc:
        logger.debug("bandwidth probe from %s failed: %s", sender, exc)
        gate.reject(sender, Rejected(Reject.MALFORMED, f"bandwidth probe: {exc}"))
    finally:
        writer.close()


async def admitted_soon(gate: Gate, sender: str) -> bool:
    """Whether ``sender`` may probe (``Gate.may_probe``), allowing its hello (on another
    stream) or the coordinator's word (``ProbeLink``) ``ADMISSION_WAIT_S`` to arrive first."""
    deadline = time.monotonic() + ADMISSION_WAIT_S
    while not gate.may_probe(sender):
        if time.monotonic() > deadline or sender in gate.refused:
            return False
        await asyncio.sleep(0.05)
    return True
