"""The live plan's cut edges: what crosses each (value specs, traced on the example
micro-batch), and the codec each link gets from the one codec choice
(``coordinator.codec_choice``) on the links the peers measured."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from coordinator.assign import Assignment, live_profile, network_from_adverts
from coordinator.codec_choice import AUTO_MODES, choose_codecs, float_bytes, planned_or_repicked
from coordinator.estimator import DagCosts, compute_s, edge_rates
from coordinator.opdag import OpDag
from protocol.model.graph import Cut, build_stage, partition, trace
from protocol.model.recipe import Recipe, autocast
from protocol.wire.codecs import Codec
from protocol.wire.encoding import encode_values
from protocol.wire.expect import describe
from protocol.wire.messages import Advert

#: a link no peer reported is taken to be this slow (Mbit/s): it gets compressed
UNMEASURED_MBPS = 1e-3
logger = logging.getLogger(__name__)


def boundary_specs(
    model: nn.Module, cut: Cut, example: tuple[torch.Tensor, ...], recipe: Recipe | None = None
) -> list[list[Any]]:
    """Per stage, the descriptions (dtype, shape) of its input values for the example
    micro-batch: stage 0 gets the batch, stage s the values crossing boundary s - 1
    (in the recipe's compute precision: under bf16 a linear layer's output crosses
    as bf16)."""
    part = partition(trace(model), cut)
    values: Any = list(example)
    specs = [describe(encode_values(values)[0])]
    with torch.no_grad(), autocast(recipe or Recipe()):
        for s in range(cut.num_stages - 1):
            values = list(build_stage(part, s)(*values))
            specs.append(describe(encode_values(values)[0]))
    return specs


def live_codecs(
    dag: OpDag,
    plan: Assignment,
    specs: list[list[Any]],
    measured: dict[str, dict[str, float]],
    adverts: dict[str, Advert],
    mode: str,
    fraction: float | None = None,
    rank: int | None = None,
    micro_batches: int = 1,
    say: Callable[[str], None] = lambda text: None,
) -> tuple[list[Codec], list[float]]:
    """The codec of each boundary of the live ``plan`` (``choose_codecs`` in ``mode``),
    and the bandwidth it was chosen for: the slowest link the peers measured between
    its two stages (``measured``: peer -> next peer -> Mbit/s), against each stage's
    compute per micro-batch on its slowest peer (the estimator's, from the adverts).
    ``specs``: each stage's input values (``boundary_specs``). Under ``auto``, a plan
    whose codecs the planner priced runs them, but where a boundary's measured link (per
    micro-batch, of ``micro_batches``) is far from the planner's (``planned_or_repicked``);
    ``say`` tells the run's events which, boundary by boundary."""
    mbps = [
        min(measured.get(p, {}).get(q, UNMEASURED_MBPS) for p in plan.stages[b] for q in plan.stages[b + 1])
        for b in range(len(plan.stages) - 1)
    ]
    costs = DagCosts.from_opdag(dag)
    seconds = [
        compute_s(costs, lo, hi, [live_profile(adverts[p]) for p in group])
        for (lo, hi), group in zip(plan.cut.ranges(costs.num_ops), plan.stages, strict=True)
    ]
    edge_bytes = [float_bytes(spec) for spec in specs[1:]]
    priced = plan.plan
    if mode in AUTO_MODES and priced is not None and len(priced.edge_mbps) == len(mbps) == len(priced.codecs):
        probed = {(p, q): v for p, got in measured.items() for q, v in got.items()}
        rates = edge_rates(plan.stages, network_from_adverts(list(adverts.values()), probed), micro_batches)
        codecs, again = planned_or_repicked(
            priced.codecs, priced.edge_mbps, rates, edge_bytes, priced.stage_s, specs[1:], rank, mode
        )
        for b, c in enumerate(codecs):
            how = "picked again for the measured link" if again[b] else "as the planner priced it"
            seen = f"{rates[b]:.1f} Mbit/s a micro-batch measured, {priced.edge_mbps[b]:.1f} planned"
            text = f"boundary {b}: {c}, {how} ({seen})"
            logger.info("%s", text)
            say(text)
        return codecs, mbps
    codecs = choose_codecs(edge_bytes, mbps, seconds, mode, fraction, specs[1:], rank=rank)
    for b, c in enumerate(codecs):
        logger.info("boundary %d: %.1f Mbit/s, %d bytes per micro-batch -> %s", b, mbps[b], edge_bytes[b], c)
    return codecs, mbps
