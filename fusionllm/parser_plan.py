"""The parsers of ``plan`` and ``sim``: the model and its batch, a topology, the
scheduler's options. They take no training recipe (nothing is trained): no
``--steps``, ``--lr``, ``--init``, ``--save`` or ``--eval-every``. No torch here."""

from __future__ import annotations

import argparse

from coordinator.plan_options import DEFAULT_PRECISION, POLICIES, SCHEDULERS, TOKENS_PER_ITERATION, WORKLOADS
from coordinator.plan_options import defaults_text as batch_defaults
from fusionllm import parser_types as t
from fusionllm.parser_job import add_model_flags
from protocol.model.options import PRECISIONS
from sim.presets import PRESETS

_EPILOG = (
    "Built-in workloads (--model): "
    + "; ".join(f"{w.name}: {w.summary}" for w in WORKLOADS.values())
    + f". Default batches, M micro-batches x B sequences x S tokens ({TOKENS_PER_ITERATION:,} tokens per "
    + f"iteration): {batch_defaults()}."
)

_MODEL_HELP = (
    f"built-in name (gpt, gpt2, branchy) or MODULE:FUNC / file.py:FUNC; {', '.join(WORKLOADS)} are published "
    "model shapes traced without weights (--model-args changes them, e.g. n_layer=4)"
)


def _add_batch_flags(p: argparse.ArgumentParser) -> None:
    """The batch of one iteration, and the precision the plan models."""
    g = p.add_argument_group("batch (one iteration: M micro-batches of B sequences of S tokens)")
    g.add_argument(
        "--micro-batches",
        type=t.positive,
        default=None,
        metavar="M",
        help=f"micro-batches per iteration (default: {batch_defaults()}; other models: 4)",
    )
    g.add_argument(
        "--batch-size",
        type=t.positive,
        default=None,
        metavar="B",
        help="sequences per micro-batch, built-in workloads only (default: as above)",
    )
    g.add_argument(
        "--seq-len",
        type=t.positive,
        default=None,
        metavar="S",
        help="tokens per sequence, built-in workloads only (default: the model's context, as above)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="the training precision the plan models: the activations' dtype; weights, gradients and Adam's "
        f"moments stay fp32, 16 bytes per parameter (default: {DEFAULT_PRECISION} for the built-in workloads, as "
        "the presets' GPU speeds are mixed-precision; fp32 otherwise)",
    )


def _add_planner_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology and planner")
    g.add_argument(
        "--topology", required=True, metavar="FILE|PRESET", help=f"topology JSON file or preset ({', '.join(PRESETS)})"
    )
    g.add_argument(
        "--stages", type=t.positive, default=None, metavar="K", help="force the number of stages (default: chosen)"
    )
    g.add_argument("--max-stages", type=t.positive, default=32, metavar="K", help="the most stages a plan may have")
    g.add_argument(
        "--compression",
        choices=["auto", "auto-lowrank", "none"],
        default="auto",
        help="auto: slow links get the codec the live swarm's auto mode would give them (fp16, "
        "int8), or none where that reaches the loss sooner (each codec's measured steps factor); "
        "auto-lowrank: as the live swarm's, also low rank with int4 gradients; none: no codec",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _common(sub: argparse._SubParsersAction, name: str, helptext: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=helptext, epilog=_EPILOG)
    add_model_flags(p, _MODEL_HELP, "seeds the planners' choices, the simulated probes and the churn")
    _add_batch_flags(p)
    _add_planner_flags(p)
    return p


def add_plan_commands(sub: argparse._SubParsersAction) -> None:
    p = _common(sub, "plan", "dry-run the scheduler on a topology: stages, peers, predicted times, codecs")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="opfence", help="the planner")

    p = _common(sub, "sim", "simulate schedulers on a topology (seeded; churn optional)")
    p.add_argument(
        "--schedulers",
        type=t.schedulers,
        default=",".join(SCHEDULERS),
        metavar="A,B,...",
        help=f"comma-separated, from {', '.join(SCHEDULERS)} (default: all)",
    )
    p.add_argument("--iterations", type=t.positive, default=20, metavar="N", help="iterations to simulate")
    p.add_argument(
        "--churn", type=t.natural, default=0, metavar="N", help="N seeded joins, leaves and slow-downs (default: 0)"
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="rebalance",
        help="what the swarm does about churn: rebalance (the live coordinator's rules), none (recover from "
        "losses only) or restart (restart from the last checkpoint on every change)",
    )
    p.add_argument(
        "--plot",
        type=t.plot_path,
        default=None,
        metavar="OUT.png",
        help="plot each scheduler's iteration times and the churn events (default: no plot)",
    )
