"""Spot checks (accountable compute): what a re-execution of one micro-batch on one
stage needs, and how its results are compared.

A step's frames are signed by their senders, so the frames around one stage's work
on one micro-batch are evidence no one can forge: the inputs it received (signed by
the previous stage, or the coordinator), the output gradients it received (signed
by the next stage), and what it sent on (its activations and input gradients,
signed by itself). A replica of the stage holds the same weights until the step is
committed; it runs the micro-batch again from those inputs and compares.

Roles of the evidence, for the stage ``s`` of the peer checked (the *suspect*):

=========  ======  ========================  ============  ==================
role       kind    signed by                 kept by        its message's stage
=========  ======  ========================  ============  ==================
input      act     previous stage / coord.   the suspect    s
grad_out   grad    next stage                the suspect    s
output     act     the suspect               next stage     s + 1
grad_in    grad    the suspect               previous st.   s - 1
param_gr.  rgrad   the suspect               its replicas   s
=========  ======  ========================  ============  ==================

Most checks re-execute the forward only (``input`` and ``output``, or the loss on
the last stage): it is about a third of the micro-batch's compute and catches wrong
activations and losses. A share ``BACKWARD_SHARE`` of them runs the backward too
(``grad_out`` and ``grad_in`` join the evidence, and the parameter gradients are
compared): a peer that corrupts only its gradients is caught at that lower rate
(``survival``).

A replica re-executing compares the parameter gradients with the suspect's
``ReplicaGrads`` it received itself; an arbiter of another stage (two replicas
disagreed) gets them as the ``param_grads`` evidence.

A checker that disagrees also says what it computed, as a ``fingerprint``: two
re-executions that disagree with the suspect convict it only if they agree with
each other (two cheats disputing an honest peer's work compute different wrong
values).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from protocol.wire.messages import Activations, Gradients, Message, ReplicaGrads

#: role -> (message class, offset of its stage from the suspect's stage)
ROLES: dict[str, tuple[type[Message], int]] = {
    "input": (Activations, 0),
    "grad_out": (Gradients, 0),
    "output": (Activations, 1),
    "grad_in": (Gradients, -1),
    "param_grads": (ReplicaGrads, 0),
}
#: how far (relative to the norm) a re-execution may land from the suspect's values. Not
#: bit for bit even on one device kind: CPU reductions change their order with the thread
#: count and some CUDA backward kernels add with atomics, and an honest peer must never be
#: excluded for that. Tampering smaller than this goes unseen (it is also below what
#: training notices). Different device kinds, and half-precision autocast, get more.
SAME_KIND_RTOL = 1e-5
CROSS_DEVICE_RTOL = 1e-3
HALF_PRECISION_FACTOR = 100.0
#: elements of a fingerprint's random direction drawn at a time (bounds its memory)
FINGERPRINT_CHUNK = 1 << 20
#: the share of spot checks that re-execute the backward too (the rest: the forward only)
BACKWARD_SHARE = 0.25
#: micro-batches of a stage served by one peer that are checked together, at least: its
#: weights travel to the checker once for them (a stage's weights can outweigh the
#: step's activations many times over)
LONE_DRAW = 4
#: steps with no spot check under way that a run needs to say what the checks cost its steps
MIN_CLEAN_STEPS = 10


def roles_for(stage: int, num_stages: int, backward: bool = True) -> list[str]:
    """The evidence a re-execution of ``stage`` uses (the first stage has no previous
    stage, the last no next one; a forward-only check needs no gradients)."""
    roles = ["input"]
    if stage < num_stages - 1:
        roles += ["grad_out", "output"] if backward else ["output"]
    if stage > 0 and backward:
        roles.append("grad_in")
    return roles


def wrong_frame(role: str, msg: Message, run_id: str, step: int, mb: int, stage: int, epoch: int) -> str:
    """Why a signed frame is not the one ``role`` names ('' when it is)."""
    cls, offset = ROLES[role]
    if type(msg) is not cls:
        return f"{role} is a '{msg.KIND}' frame, not '{cls.KIND}'"
    got = (msg.run_id, msg.step, msg.mb, msg.stage, msg.epoch)  # type: ignore[attr-defined]
    want = (run_id, step, mb, stage + offset, epoch)
    if got != want:
        return f"{role} is the frame of (run, step, micro-batch, stage, epoch) {got!r}, not {want!r}"
    return ""


def tolerance(device_a: str, device_b: str, precision: str = "fp32") -> float:
    """The relative tolerance of a re-execution on ``device_b`` of work done on ``device_a``."""
    same = device_a.split(":")[0] == device_b.split(":")[0]
    return (SAME_KIND_RTOL if same else CROSS_DEVICE_RTOL) * (1.0 if precision == "fp32" else HALF_PRECISION_FACTOR)


def _tensors(value: Any) -> list[torch.Tensor | None]:
    if value is None or isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return [None]


def differs(ours: Sequence[Any], theirs: Sequence[Any], rtol: float) -> str:
    """Where two value lists (tensors, nested tuples of them, None) differ ('' when
    they agree): bit for bit when ``rtol`` is 0, else within ``rtol`` of the norm."""
    a, b = _tensors(list(ours)), _tensors(list(theirs))
    if len(a) != len(b):
        return f"{len(b)} values where {len(a)} were computed"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            if x is not y:
                return f"value {i} is {'missing' if y is None else 'extra'}"
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"value {i} is {y.dtype} {tuple(y.shape)}, computed {x.dtype} {tuple(x.shape)}"
        if rtol == 0.0:
            if not torch.equal(x, y):
                return f"value {i} differs in {int((x != y).sum())} of {x.numel()} elements"
        elif x.is_floating_point():
            gap = float(torch.linalg.vector_norm((x - y).double()))
            scale = float(torch.linalg.vector_norm(x.double()))
            if not gap <= rtol * scale + 1e-12:
                return f"value {i} is off by {gap:.3g} (norm {scale:.3g}, tolerance {rtol:g})"
        elif not torch.equal(x, y):
            return f"value {i} differs"
    return ""


def loss_differs(ours: float, theirs: float | None, rtol: float) -> str:
    if theirs is None or not math.isfinite(theirs):
        return f"it reported no finite loss ({theirs!r})"
    if ours == theirs or (rtol and abs(ours - theirs) <= rtol * abs(ours)):
        return ""
    return f"it reported a loss of {theirs!r}; its inputs give {ours!r}"


def fingerprint(values: Sequence[Any], seed: int) -> list[float]:
    """Two numbers per tensor of ``values`` (nested; None skipped): its norm, and its
    projection on a random unit direction drawn from ``seed``. Two re-executions within
    ``rtol`` of each other's norm give numbers within that of each other (the projection
    is 1-Lipschitz), and a different wrong result almost surely moves the projection."""
    out: list[float] = []
    gen = torch.Generator().manual_seed(seed)
    for t in _tensors(list(values)):
        if t is None:
            continue
        flat = t.detach().reshape(-1).to("cpu", torch.float64)
        dot, r2 = 0.0, 0.0
        for i in range(0, flat.numel(), FINGERPRINT_CHUNK):
            part = flat[i : i + FINGERPRINT_CHUNK]
            r = torch.randn(part.numel(), generator=gen, dtype=torch.float64)
            dot, r2 = dot + float(part @ r), r2 + float(r @ r)
        out += [float(torch.linalg.vector_norm(flat)), dot / math.sqrt(r2) if r2 else 0.0]
    return out


def seed_of(step: int, mb: int) -> int:
    """The seed of the fingerprints of micro-batch ``mb`` of ``step`` (every checker's the same)."""
    return (step * 1_000_003 + mb) % (1 << 63)


def alike(a: Sequence[float], b: Sequence[float], rtol: float) -> bool:
    """Whether two fingerprints come from results within ``rtol`` of each other's norm
    (twice it: each may be that far from the exact result). Non-finite: never."""
    if len(a) != len(b) or len(a) % 2 or not all(math.isfinite(x) for x in (*a, *b)):
        return False
    for i in range(0, len(a), 2):
        bound = 2 * rtol * max(a[i], b[i]) + 1e-12
        if abs(a[i] - b[i]) > bound or abs(a[i + 1] - b[i + 1]) > bound:
            return False
    return True


def step_overhead(seconds: Sequence[float], audited: Sequence[bool]) -> float | None:
    """What spot checks cost a run's steps: the share of its steps in which checks
    ran, times how much longer those took than the others (medians of each, so that
    a rare slow step, a checkpoint's, sways neither; a median of all the steps would
    hide checks that come rarely but cost much each). Both kinds come from one run
    (the same plan, peers and machine) and are drawn at random among each other;
    across two runs, the plans and the machine differ by more than the checks cost.
    None without ``MIN_CLEAN_STEPS`` clean steps, or with no checked one."""
    checked = [s for s, a in zip(seconds, audited, strict=True) if a]
    clean = [s for s, a in zip(seconds, audited, strict=True) if not a]
    if len(clean) < MIN_CLEAN_STEPS or not checked:
        return None
    return len(checked) / len(seconds) * (statistics.median(checked) / statistics.median(clean) - 1.0)


def lone_draw(rate: float, micro_batches: int) -> tuple[float, int]:
    """(the chance that a stage served by one peer is checked in a step, how many of
    its micro-batches then): as many checks on average as ``rate`` per micro-batch
    gives, drawn together, ``LONE_DRAW`` of them at least (all at most)."""
    k = min(micro_batches, max(LONE_DRAW, math.ceil(rate * micro_batches)))
    return rate * micro_batches / k, k


def survival(f: float, checked: float, micro_batches: int, steps: int) -> float:
    """The probability that a peer corrupting a fraction ``f`` of its micro-batches,
    ``micro_batches`` of them a step, each re-executed with probability ``checked``,
    passes ``steps`` steps uncaught: ``(1 - f * checked) ** (micro_batches * steps)``.
    A cheat in activations or losses is seen by every check (``checked`` = the rate);
    one only in gradients by the backward ones (the rate times ``BACKWARD_SHARE``)."""
    return (1.0 - f * checked) ** (micro_batches * steps)


def lone_survival(f: float, rate: float, micro_batches: int, steps: int, share: float = 1.0) -> float:
    """``survival`` for the peer of a stage served by one: its micro-batches are drawn
    together (``lone_draw``), so a step passes unseen unless it is drawn and one of the
    drawn micro-batches is corrupted (and, ``share``, checked that way):
    ``(1 - q (1 - (1 - f share) ** k)) ** steps``. A little above ``survival`` at
    the same rate: the checks come in fewer steps."""
    chance, k = lone_draw(rate, micro_batches)
    return (1.0 - chance * (1.0 - (1.0 - f * share) ** k)) ** steps
