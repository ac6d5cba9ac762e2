"""Swarm throughput against one process, and the RAD data path (hivemind libp2p
streams carrying FusionLLM frames) against a plain TCP socket, measured in one
run. Prints one JSON object."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import torch

from fusionllm.local import train_reference
from protocol.job import JobSpec
from protocol.messages import Activations
from protocol.transport import Transport

ROOT = Path(__file__).resolve().parent.parent
SIZE = 64 << 20
STEPS = 60


def swarm_tokens_per_s(peers: int = 4) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "fusionllm", "demo", "--peers", str(peers), "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=True,
    ).stdout
    m = re.search(r"([\d,]+) tokens/s", out)
    assert m, out
    return float(m.group(1).replace(",", ""))


def reference_tokens_per_s() -> float:
    res = train_reference(JobSpec(steps=STEPS))
    return res.tokens / res.seconds


async def _rad(repeats: int = 3) -> float:
    d1 = hivemind.DHT(start=True)
    d2 = hivemind.DHT(initial_peers=[str(m) for m in d1.get_visible_maddrs()], start=True)
    a, b = Transport(await d1.replicate_p2p()), Transport(await d2.replicate_p2p())
    await a.start()
    await b.start()
    blob = torch.ones(SIZE // 4, dtype=torch.float32)
    best = 0.0
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            await a.send(b.peer_id, Activations("bench", i, 0, 1), [blob])
            got = await b.inbox.get()
            got.values()
            rate = SIZE / (time.perf_counter() - start) / 1e6
            if i > 0:  # the first opens the stream
                best = max(best, rate)
    finally:
        await a.aclose()
        await b.aclose()
        d1.shutdown()
        d2.shutdown()
    return best


async def _tcp(repeats: int = 3) -> float:
    done: asyncio.Queue[int] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            got = 0
            while got < SIZE:
                chunk = await reader.read(1 << 22)
                if not chunk:
                    return
                got += len(chunk)
            await done.put(got)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = bytes(SIZE)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        writer.write(data)
        await writer.drain()
        await done.get()
        best = max(best, SIZE / (time.perf_counter() - start) / 1e6)
    writer.close()
    server.close()
    return best


def main() -> None:
    rad = asyncio.run(_rad())
    tcp = asyncio.run(_tcp())
    ref = reference_tokens_per_s()
    swarm = swarm_tokens_per_s()
    print(
        json.dumps(
            {
                "swarm_tokens_per_s": round(swarm, 1),
                "reference_tokens_per_s": round(ref, 1),
                "swarm_vs_reference": round(swarm / ref, 3),
                "rad_64mib_mb_per_s": round(rad, 1),
                "tcp_64mib_mb_per_s": round(tcp, 1),
                "rad_vs_tcp": round(rad / tcp, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
