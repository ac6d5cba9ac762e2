"""The parser of ``fusionllm testbed``: ``run`` (a topology, the schedulers, the model,
the steps) and ``down``. No torch here."""

from __future__ import annotations

import argparse

from fusionllm import parser_types as t
from fusionllm.testbed import DEFAULT_MODEL_ARGS, PRESET_NAMES
from fusionllm.usage import positive_int

DEFAULT_SCHEDULERS = "opfence,bw-blind,petals,dtfm"


def _steps(text: str) -> int:
    return positive_int(text, "a whole number of steps")


def _compression(text: str) -> str:
    if text not in ("none", "auto"):
        raise argparse.ArgumentTypeError(f"'{text}' is not none or auto")
    return text


def add_testbed_commands(sub: argparse._SubParsersAction) -> None:
    """``fusionllm testbed run`` and ``fusionllm testbed down``."""
    p = sub.add_parser(
        "testbed",
        help="train over emulated wide-area links (Linux, root): measured beside the estimator and the simulator",
        description="An emulated geo-distributed testbed: one network namespace per peer and the coordinator's, "
        "every pair of hosts shaped to a topology (htb per destination; latency added in the send path), the "
        "real swarm trained under each scheduler's plan in turn. Needs Linux, root and iproute2.",
    )
    tb = p.add_subparsers(dest="testbed_command", metavar="run|down", required=True)
    r = tb.add_parser("run", help="build the testbed, train under each scheduler, report, remove it all")
    r.add_argument(
        "--topology",
        default="two-clusters",
        metavar="FILE|PRESET",
        help=f"a topology file (the format of 'fusionllm sim --topology') or a preset: {', '.join(PRESET_NAMES)}; "
        "2 to 8 peers (default: two-clusters)",
    )
    r.add_argument(
        "--schedulers",
        type=t.schedulers,
        default=t.schedulers(DEFAULT_SCHEDULERS),
        metavar="S1,S2,...",
        help=f"the schedulers whose plans the swarm runs, in turn (default: {DEFAULT_SCHEDULERS})",
    )
    r.add_argument("--model", default="gpt", metavar="NAME", help="a built-in model (default: gpt)")
    r.add_argument("--model-args", default=DEFAULT_MODEL_ARGS, metavar="K=V,...", help="the model's shape, k=v,k=v")
    r.add_argument("--micro-batches", type=_steps, default=4, metavar="M", help="micro-batches per step")
    r.add_argument("--steps", type=_steps, default=30, metavar="N", help="optimizer steps per scheduler")
    r.add_argument(
        "--compression",
        type=_compression,
        default="none",
        metavar="none|auto",
        help="codecs on the stage boundaries: none, or auto (slow links get fp16 or int8, the mildest that keeps up)",
    )
    r.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    r.add_argument(
        "--work",
        default=None,
        metavar="DIR",
        help="where each run's plan, keys and logs go (default: a new folder in the temporary directory)",
    )
    tb.add_parser("down", help="remove every namespace, veth and qdisc a testbed left")
