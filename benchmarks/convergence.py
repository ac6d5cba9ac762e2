"""Does compressing a slow link cost accuracy? The demo's GPT is trained 300 steps
with the same seed by a 3-peer swarm on loopback three times: uncompressed; with
``--compression adatopk`` where the second stage boundary is paced to a slow link
(the first stays fast and, having enough bandwidth, stays uncompressed), the kept
fraction pinned so that link carries at least 10x fewer bytes; and with
``--compression auto`` on the same slow link, which there sends activations at
low rank and gradients as unbiased 4-bit codes, the rank pinned to 8
(``lowrank:8/int4sr``) so the link carries at least 10x fewer bytes.

Prints one JSON object: the validation losses (20 held-out batches), each
compressed run's loss over the uncompressed one, and how many times fewer bytes
crossed the slow link. ``loss_ratio`` and ``slow_link_bytes_ratio`` are the
``auto`` run's (the codec the swarm picks for slow links); ``adatopk_*`` are
AdaTopK's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from fusionllm.local import validation_loss
from protocol.job import JobSpec

ROOT = Path(__file__).resolve().parent.parent
STEPS = 300
SLOW_MBPS = 10.0
#: pinned so the slow link carries at least 10x fewer bytes (left to themselves, at
#: 10 Mbit/s AdaTopK keeps about 14% and auto picks a rank near 20: 7-9x fewer)
FRACTION = 0.12
RANK = 8


def _demo(out: Path, *flags: str) -> tuple[float, int, str, float]:
    """(validation loss, bytes on the slow link, its codec, its compression ratio) of one demo run."""
    ckpt = out / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "fusionllm", "demo", "--peers", "3", "--steps", str(STEPS), "--save", str(ckpt), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise SystemExit(f"demo {' '.join(flags)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    m = re.search(r"boundary 1 \(.*?\): (\S+), ([\d.]+) MB on the wire .*? ratio ([\d.]+)x", proc.stdout)
    assert m, proc.stdout
    return validation_loss(JobSpec(steps=STEPS), ckpt), int(float(m.group(2)) * 1e6), m.group(1), float(m.group(3))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / name for name in ("plain", "adatopk", "auto")]
        for d in dirs:
            d.mkdir()
        slow = ("--link-mbps", f"10000,{SLOW_MBPS:g}")
        plain_loss, plain_bytes, _, _ = _demo(dirs[0], "--compression", "none")
        topk_loss, topk_bytes, topk_codec, topk_ratio = _demo(
            dirs[1], "--compression", "adatopk", *slow, "--topk-fraction", str(FRACTION)
        )
        auto_loss, auto_bytes, codec, ratio = _demo(dirs[2], "--compression", "auto", *slow, "--rank", str(RANK))
    print(
        json.dumps(
            {
                "steps": STEPS,
                "uncompressed_val_loss": round(plain_loss, 4),
                "auto_val_loss": round(auto_loss, 4),
                "loss_ratio": round(auto_loss / plain_loss, 4),
                # the slow link's tensor bytes over its bytes on the wire, in the compressed run
                "slow_link_bytes_ratio": ratio,
                "slow_link_codec": codec,
                "adatopk_val_loss": round(topk_loss, 4),
                "adatopk_loss_ratio": round(topk_loss / plain_loss, 4),
                "adatopk_bytes_ratio": topk_ratio,
                "adatopk_codec": topk_codec,
                "uncompressed_run_slow_link_mb": round(plain_bytes / 1e6, 2),
                "auto_run_slow_link_mb": round(auto_bytes / 1e6, 2),
                "adatopk_run_slow_link_mb": round(topk_bytes / 1e6, 2),
                "slow_link_mbps": SLOW_MBPS,
            }
        )
    )


if __name__ == "__main__":
    main()
