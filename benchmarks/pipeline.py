"""Swarm throughput against one process, the RAD data path (hivemind libp2p
streams carrying signed FusionLLM frames) against a plain TCP socket, and the
step-time cost of the recipe's global gradient-norm clip and of bf16 against
fp32 (the same swarm, median step times), and the swarm whose stages travel as
programs of ATen operators (the default) against the same swarm rebuilding its
stages from the model's code (``code_*``, ``programs_vs_code``), measured in one
run. Prints one JSON object.

The anchor: the swarm with spot checks off against ``torch.distributed.pipelining``
(``Schedule1F1B``, gloo on loopback, a process of one thread per stage;
``benchmarks/_pipelining.py``) training the same job split at the swarm's own cut,
in the same run (``pipelining_tokens_per_s``, ``swarm_vs_pipelining``); what spot
checks at their default rate cost in tokens/s (``spot_check_cost``: 1 - the
default swarm's over the unchecked one's); and where the unchecked swarm's step
time goes, per stage (``step_breakdown_ms``: each part's mean ms per step, from the
run's summary).

``--short`` runs the same paths smaller, for the test suite: 2 peers instead of
4, 12 training steps instead of 60 (the anchor's pipelining too, on the 2
peers' cut) and 16 MiB messages instead of 64 MiB (still
above the lane threshold, so they travel over parallel streams); the
``*_64mib_*`` keys then hold the 16 MiB figures."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from p2p import transport_pair  # noqa: E402

from benchmarks._pipelining import pipelining_run  # noqa: E402
from fusionllm.local import train_reference, train_staged  # noqa: E402
from protocol.model.job import JobSpec  # noqa: E402
from protocol.wire.messages import Activations  # noqa: E402
from tests.conftest import demo_output  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    steps: int
    message: int  # bytes per RAD / TCP transfer
    repeats: int  # timed transfers (after one that opens the stream)
    peers: int = 4


FULL = Sizes(steps=60, message=64 << 20, repeats=3)
SHORT = Sizes(steps=12, message=16 << 20, repeats=2, peers=2)


#: the recipes whose step time is set against plain fp32
RECIPES = {"fp32": [], "clip": ["--clip-grad-norm", "1.0"], "bf16": ["--precision", "bf16"]}
#: the same fp32 swarm with its stages rebuilt from the model's code, as before stages travelled as programs
CODE = ["--stages-as", "code"]
#: the fp32 swarm with spot checks off: what the anchor compares with pipelining
UNCHECKED = ["--spot-check", "0"]


@dataclass(frozen=True)
class SwarmRun:
    tokens_per_s: float
    median_step_ms: float
    cut: list[int]
    breakdown_ms: dict[str, dict[str, float]]  # stage -> part -> mean ms per step, as the summary prints them


def swarm_run(sizes: Sizes, flags: list[str]) -> SwarmRun:
    """What a demo swarm's summary says."""
    out = demo_output("--peers", str(sizes.peers), "--steps", str(sizes.steps), *flags)
    tokens = re.search(r"([\d,]+) tokens/s", out)
    median = re.search(r"measured ([\d.]+) ms \(median\)", out)
    cut = re.search(r"^cut \[([\d, ]*)\]$", out, re.MULTILINE)
    assert tokens and median and cut, out
    return SwarmRun(
        float(tokens.group(1).replace(",", "")),
        float(median.group(1)),
        [int(x) for x in cut.group(1).split(",") if x.strip()],
        step_breakdown(out),
    )


def step_breakdown(summary: str) -> dict[str, dict[str, float]]:
    """The summary's step breakdown lines (``coordinator.breakdown.breakdown_lines``):
    per stage, each part's mean ms per step and the whole step's (``step``)."""
    out = {}
    for stage, step, parts in re.findall(r"^  stage (\d+) step ([\d.]+) ms[^:]*: (.*) ms$", summary, re.MULTILINE):
        row = {part: float(ms) for part, ms in re.findall(r"(\w+) ([\d.]+)(?: \([^)]*\))?(?:, |$)", parts)}
        out[stage] = {"step": float(step), **row}
    return out


def reference_tokens_per_s(sizes: Sizes) -> float:
    res = train_reference(JobSpec(steps=sizes.steps))
    return res.tokens / res.seconds


def staged_step_ms(sizes: Sizes) -> dict[str, float]:
    """Median step ms of the demo's model through 4 stages in one process, fp32 and
    bf16 (autocast on this CPU, without the network)."""
    out = {}
    for precision in ("fp32", "bf16"):
        ends: list[float] = []

        def progress(step: int, loss: float, ends: list[float] = ends) -> None:
            ends.append(time.perf_counter())

        train_staged(JobSpec(steps=sizes.steps, precision=precision), sizes.peers, progress)
        steps = sorted(b - a for a, b in itertools.pairwise(ends))
        out[precision] = 1000 * steps[len(steps) // 2]
    return out


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them autocast
    emulates bf16 and a step is many times slower than in fp32 (CI's machine: 17.6x)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


async def _rad(sizes: Sizes) -> float:
    """Best MB/s of one signed message from one transport's ``send`` to the other's inbox."""
    async with transport_pair("bench") as (a, b):
        blob = torch.ones(sizes.message // 4, dtype=torch.float32)
        best = 0.0
        for i in range(sizes.repeats + 1):
            start = time.perf_counter()
            await a.send(b.peer_id, Activations("bench", i, 0, 1), [blob])
            got = await b.inbox.get()
            got.values()
            rate = sizes.message / (time.perf_counter() - start) / 1e6
            if i > 0:  # the first opens the stream
                best = max(best, rate)
    return best


async def _tcp(sizes: Sizes) -> float:
    size = sizes.message
    done: asyncio.Queue[int] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            got = 0
            while got < size:
                chunk = await reader.read(1 << 22)
                if not chunk:
                    return
                got += len(chunk)
            await done.put(got)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = bytes(size)
    best = 0.0
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        writer.write(data)
        await writer.drain()
        await done.get()
        best = max(best, size / (time.perf_counter() - start) / 1e6)
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()  # the handler has read the end of the stream and returned
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    rad = asyncio.run(_rad(sizes))
    tcp = asyncio.run(_tcp(sizes))
    ref = reference_tokens_per_s(sizes)
    # the anchor's two sides and the default swarm back to back, then the other recipes
    unchecked = swarm_run(sizes, UNCHECKED)
    anchor = pipelining_run(unchecked.cut, sizes.steps)
    others = {**RECIPES, "code": CODE}
    runs = {"unchecked": unchecked} | {name: swarm_run(sizes, flags) for name, flags in others.items()}
    swarm = runs["fp32"].tokens_per_s
    ms = {name: run.median_step_ms for name, run in runs.items()}
    staged = staged_step_ms(sizes)
    out: dict[str, object] = {
        "pipelining_tokens_per_s": round(anchor.tokens_per_s, 1),
        "swarm_unchecked_tokens_per_s": round(unchecked.tokens_per_s, 1),
        "swarm_vs_pipelining": round(unchecked.tokens_per_s / anchor.tokens_per_s, 3),
        "spot_check_cost": round(1 - swarm / unchecked.tokens_per_s, 3),
        "step_ms_pipelining": round(anchor.median_step_ms, 1),
        "step_ms_unchecked": ms["unchecked"],
        "cut": unchecked.cut,
        "step_breakdown_ms": unchecked.breakdown_ms,
        "swarm_tokens_per_s": round(swarm, 1),
        "reference_tokens_per_s": round(ref, 1),
        "swarm_vs_reference": round(swarm / ref, 3),
        "code_swarm_vs_reference": round(runs["code"].tokens_per_s / ref, 3),
        "programs_vs_code": round(swarm / runs["code"].tokens_per_s, 3),
        "step_ms_code": ms["code"],
        "rad_64mib_mb_per_s": round(rad, 1),
        "tcp_64mib_mb_per_s": round(tcp, 1),
        "rad_vs_tcp": round(rad / tcp, 3),
        "step_ms_fp32": ms["fp32"],
        "step_ms_clip": ms["clip"],
        "step_ms_bf16": ms["bf16"],
        "clip_vs_fp32": round(ms["clip"] / ms["fp32"], 3),
        "bf16_vs_fp32": round(ms["bf16"] / ms["fp32"], 3),
        "in_process_bf16_vs_fp32": round(staged["bf16"] / staged["fp32"], 3),
        "cpu_has_bf16": cpu_has_bf16(),
    }
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
