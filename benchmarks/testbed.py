"""The emulated geo-distributed testbed (issue 32): the real swarm trained under each
scheduler's plan on links shaped to a topology (network namespaces, an ``htb`` class
per destination, latency in the send path; ``fusionllm testbed``), measured beside the
estimator's and the simulator's iteration time for the same plan.

Full mode: the ``far-lab`` preset (8 peers on two sites 1 Mbit/s apart: a lab of two
peers twice as fast as the six of a second site, 1 Gbit/s inside each): mixed
bandwidth where placement matters (a bandwidth-blind plan mixes the sites in each
stage, a data-parallel one sends every gradient over the slow link) and where no
plan can avoid a boundary between the sites, so ``auto`` has a link to compress
(on ``homes-7`` OP-Fence's plan has none slow enough, and ``auto`` picks no codec);
as many peers as this 2-core machine runs, each throttled to its share. Every
scheduler (opfence, bw-blind, petals, dtfm) uncompressed, then OP-Fence's plan with
``--compression auto``. ``--topology`` runs another preset or file (either mode). ``--short``: the
``two-clusters`` preset, OP-Fence and dtfm only (usually one plan, run once), a few
steps, no compressed run (the ``auto_*`` figures are null). Prints one JSON object;
where namespaces cannot be built, ``{"skipped": why}``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ("measured_s", "estimated_s", "simulated_s", "wire_bytes", "plan")


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--topology", help="a preset or topology file (default: far-lab; two-clusters with --short)")
    args = parser.parse_args()
    from fusionllm.reaper import start_reaper
    from fusionllm.testbed.cmd import run_testbed
    from fusionllm.testbed.lab import missing

    why = missing()
    if why:
        print(json.dumps({"skipped": why, "short": args.short}))
        return
    start_reaper()  # killed, the swarm's processes go too
    signal.signal(signal.SIGTERM, _terminate)  # unwinds: the processes and namespaces go
    if args.short:
        topology, schedulers, steps, modes = args.topology or "two-clusters", ["opfence", "dtfm"], 6, ("none",)
    else:
        topology, steps, modes = args.topology or "far-lab", 20, ("none", "auto")
        schedulers = ["opfence", "bw-blind", "petals", "dtfm"]
    full = run_testbed(topology, schedulers, steps=steps, compressions=modes, say=lambda t: print(t, file=sys.stderr))
    out: dict[str, Any] = {
        "topology": topology,
        "schedulers": {k: {f: v[f] for f in KEYS} for k, v in full["schedulers"].items()},
    }
    for key in ("opfence_vs_best_blind_measured", "opfence_vs_dtfm_measured", "estimator_error_max"):
        out[key] = full[key]
    out["estimator_error_max_one_scale"] = full["estimator_error_max_one_scale"]
    out["auto_vs_none_measured"] = full["auto_vs_none_measured"]
    out["auto_loss_ratio"] = full["auto_loss_ratio"]
    for key in ("auto_measured_s", "auto_estimated_s", "auto_estimator_error", "auto_codecs_live"):
        out[key] = full.get(key)
    out["short"] = args.short
    print(json.dumps(out))


if __name__ == "__main__":
    main()
