"""Does AdaTopK on a slow link cost accuracy? The demo's GPT is trained 300 steps
with the same seed by a 3-peer swarm on loopback, once uncompressed and once with
``--compression adatopk`` where the second stage boundary is paced to a slow link
(the first stays fast and, having enough bandwidth, stays uncompressed), with
the kept fraction pinned so that link carries at least 10x fewer bytes. Prints
one JSON object: both validation losses (20 held-out batches), their ratio, and
how many times fewer bytes crossed the slow link."""

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
#: pinned so the slow link carries at least 10x fewer bytes (AdaTopK's own choice
#: at 10 Mbit/s keeps about 14%, which gives 8.8x)
FRACTION = 0.12


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
        a, b = Path(tmp) / "plain", Path(tmp) / "adatopk"
        a.mkdir()
        b.mkdir()
        plain_loss, plain_bytes, _, _ = _demo(a, "--compression", "none")
        topk_loss, topk_bytes, codec, ratio = _demo(
            b, "--compression", "adatopk", "--link-mbps", f"10000,{SLOW_MBPS:g}", "--topk-fraction", str(FRACTION)
        )
    print(
        json.dumps(
            {
                "steps": STEPS,
                "uncompressed_val_loss": round(plain_loss, 4),
                "adatopk_val_loss": round(topk_loss, 4),
                "loss_ratio": round(topk_loss / plain_loss, 4),
                # the slow link's tensor bytes over its bytes on the wire, in the compressed run
                "slow_link_bytes_ratio": ratio,
                "uncompressed_run_slow_link_mb": round(plain_bytes / 1e6, 2),
                "adatopk_run_slow_link_mb": round(topk_bytes / 1e6, 2),
                "slow_link_codec": codec,
                "slow_link_mbps": SLOW_MBPS,
            }
        )
    )


if __name__ == "__main__":
    main()
