"""What the coordinator concludes from a disputed spot check (``coordinator.spotchecks``
gathers the re-executions): who leaves the plan, who is excluded and why, and the
disputed micro-batch's signed frames kept in the run directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from coordinator.checkpoint import RunDir
from coordinator.runstate import EXCLUDED, PeerLost
from protocol.trust.spotcheck import alike
from protocol.wire.messages import Verdict

logger = logging.getLogger(__name__)

#: weights a peer showed: (names, tensors)
Shown = tuple[list[str], list[torch.Tensor]]


def undecided(step: int, mb: int, suspect: str, checkers: list[str]) -> PeerLost:
    """Checkers disagree with the suspect and with each other, and no more can
    re-execute: all of them leave the plan, none excluded."""
    why = f"disputed a spot check of step {step}, micro-batch {mb}, and no two re-executions agreed"
    return PeerLost({p: why for p in [suspect, *checkers]})


def convicted(suspect: str, twin: str, against: list[tuple[str, Verdict]], rtol: float) -> PeerLost:
    """Two checkers (``twin`` and the last) computed the same, and not what the suspect
    showed: the suspect is excluded, and so is any disputer who computed a third result."""
    (last, verdict), said = against[-1], dict(against)
    found = f"{said[twin].detail} (re-executed by {twin}; and by {last}: {verdict.detail})"
    lost = {suspect: f"{EXCLUDED}spot check: {found}"}
    for c, v in against[:-1]:
        if not alike(v.computed, verdict.computed, rtol):
            neither = f"its re-execution of {suspect}'s work matched neither it nor {twin} and {last}"
            lost[c] = f"{EXCLUDED}{neither} {own(v)}"
    return PeerLost(lost)


def own(verdict: Verdict) -> str:
    """What a disputing checker's own re-execution gave, for its exclusion's line (a
    checker that fakes a loss is named with it)."""
    return f"(its own verdict: {verdict.detail[:200]})"


def keep_evidence(
    run_dir: RunDir, step: int, mb: int, suspect: str, roles: list[str], evidence: list[torch.Tensor]
) -> None:
    """The disputed micro-batch's signed frames, in the run directory."""
    folder = Path(run_dir.path) / "evidence"
    try:
        folder.mkdir(exist_ok=True)
        tensors = {
            f"{role}/{part}": t.contiguous()
            for i, role in enumerate(roles)
            for part, t in zip(("head", "payload"), evidence[2 * i : 2 * i + 2], strict=True)
        }
        save_file(tensors, str(folder / f"step{step}-mb{mb}-{suspect[:16]}.safetensors"))
    except OSError as exc:
        logger.warning("could not keep the evidence of a spot check: %s", exc)


def same_weights(a: Shown, b: Shown) -> bool:
    """Whether two replicas showed the same weights, bit for bit."""
    same = (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
    return a[0] == b[0] and all(same)
