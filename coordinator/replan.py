"""When to start a new plan epoch, and what the new plan keeps: pure functions of
a snapshot, called by the live coordinator (``coordinator.run``) and by the
simulator (``sim.engine``)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.estimator import PASSES

#: a re-plan that nothing forces must beat the current plan's iteration time by this fraction
#: (the estimator's error on live CPU peers: moves predicted 9-20% faster measured 5-30% slower)
REPLAN_GAIN = 0.2
#: joins alone trigger an optional re-plan at most this often (iterations)
JOIN_REPLAN_EVERY = 10


def wants_replan(slowed: bool, joined: bool, iteration: int, last_optional: int) -> bool:
    """Whether to consider a move at ``iteration`` (the simulator's event-triggered form):
    a planned peer slowed down, or peers joined (at most every ``JOIN_REPLAN_EVERY`` iterations)."""
    return slowed or (joined and iteration - last_optional >= JOIN_REPLAN_EVERY)


@dataclass(frozen=True)
class Recovery:
    """What to do after planned peers were lost.

    ``kind``: ``replicas`` (every stage kept a peer: drop the lost replicas, keep the
    cut, no rollback: the survivors hold the state), ``standby`` (standby peers take
    the stages that lost their only peer; the state of those stages exists only in
    the last checkpoint, so every stage rolls back to it) or ``replan`` (too few
    standby peers: the caller re-plans the remaining peers, and rolls back).
    ``stages``: the new peer groups (None for ``replan``); ``taken``: (stage, lost
    peer, standby peer) for each replacement."""

    kind: str
    stages: list[list[str]] | None
    rollback: bool
    taken: list[tuple[int, str, str]]


def recover(stages: list[list[str]], lost: set[str], standby: list[str]) -> Recovery:
    """The recovery for ``stages`` (peer ids per stage, replica order) after ``lost``;
    ``standby`` lists the waiting peers, best first."""
    left = [[p for p in group if p not in lost] for group in stages]
    empty = [s for s, group in enumerate(left) if not group]
    if not empty:
        return Recovery("replicas", left, False, [])
    pool = [p for p in standby if p not in lost]
    if len(pool) < len(empty):
        return Recovery("replan", None, True, [])
    taken = []
    for s, new in zip(empty, pool, strict=False):
        old = next(p for p in stages[s] if p in lost)
        left[s] = [new]
        taken.append((s, old, new))
    return Recovery("standby", left, True, taken)


#: with automatic checkpoints, training time between two is this many times what one costs
#: (so checkpoints take about 2% of the run, and a rollback redoes at most that much time)
CHECKPOINT_COST_FACTOR = 50
#: what a checkpoint is assumed to cost before one was measured
CHECKPOINT_COST_GUESS_S = 0.2


def checkpoint_due(step: int, last: int, every: int | None, trained_s: float, cost_s: float | None) -> bool:
    """Whether to checkpoint after ``step`` steps, the last checkpoint being after
    ``last``: every ``every`` steps when set (0: never before the end), else when
    ``trained_s`` seconds of training since the last one reach ``CHECKPOINT_COST_FACTOR``
    times the measured cost of one."""
    if every is not None:
        return every > 0 and step % every == 0
    cost = CHECKPOINT_COST_GUESS_S if cost_s is None else cost_s
    return step > last and trained_s >= CHECKPOINT_COST_FACTOR * cost


def stall_seconds(step_seconds: list[float], floor: float, factor: float = 10.0) -> float:
    """How long a planned peer may stay silent before it counts as stalled: ``factor``
    times the median measured step time, never less than ``floor`` seconds."""
    if not step_seconds:
        return floor
    ordered = sorted(step_seconds[-50:])
    return max(floor, factor * ordered[len(ordered) // 2])


#: a rebalance must pay back its move this many times over the remaining steps
REBALANCE_PAYBACK = 2.0
#: after a rebalance, the next one is considered only this many checks later (no flapping),
#: unless a planned peer fell far since, measured on the same plan (``Rebalancer._fell``)
REBALANCE_COOLDOWN_CHECKS = 2
#: measurements of a peer's speed kept (the estimate is their median)
SPEED_SAMPLES = 9


#: a rebalance delivered when the measured speed-up reached this share of the predicted one
DELIVERED_SHARE = 0.5
#: the most a rebalance that did not deliver raises the bar for the next (on top of ``REPLAN_GAIN``)
MAX_DOUBT = 0.4


#: the share of a run's time that rebalance checks may spend planning while the peers
#: and their speeds hold: a check plans on a worker thread, but the step's commit waits
#: for it (0.3-0.4 s on the README demo, every 25 steps of 0.1 s: 13% of its time when
#: every check planned; seconds on a thousand peers)
CHECK_BUDGET = 0.02
#: and the share once they changed since the last check that planned (a peer joined or
#: left, or its speed moved by more than ``CHANGED_SPEED``): then a check is worth more,
#: but a thousand noisy peers show some change at nearly every check
CHANGED_BUDGET = 0.1
#: a speed change that counts for ``CHANGED_BUDGET``: the demo's peers, measured the same
#: way, moved by more than ``LEVEL_CHANGE`` between checks often enough that a third of
#: its checks planned (a peer slowed to a twentieth, or one that halved, is seen)
CHANGED_SPEED = 2.0


def apart(a: float, b: float, factor: float) -> bool:
    """Whether ``a`` and ``b`` (not negative) are over ``factor`` times apart."""
    return max(a, b) > factor * min(a, b)


def check_affordable(
    since_last_s: float,
    last_cost_s: float,
    speeds: dict[str, float],
    last: dict[str, float],
    last_unsettled: bool = False,
) -> bool:
    """Whether a rebalance check may plan now: the last check that planned took at most
    ``CHECK_BUDGET`` of the time since it began, or ``CHANGED_BUDGET`` where the peers
    or their speeds (``speeds``) changed since (``last``: other peers, or one's speed
    by more than ``CHANGED_SPEED``), or a peer's speed was still moving when it planned
    or its price of the current plan was newly far off (``last_unsettled``,
    ``speed_moved``, ``mispriced``): CI saw a check plan on a throttled peer's speed
    half-way down, its later ones skipped while the speed crept on from there, and the
    move come 100 steps late. A run whose steps take seconds checks every period."""
    moved = any(apart(v, last[p], CHANGED_SPEED) for p, v in speeds.items() if p in last)
    changed = speeds.keys() != last.keys() or moved or last_unsettled
    return last_cost_s <= (CHANGED_BUDGET if changed else CHECK_BUDGET) * since_last_s


#: a check that priced the current plan this many times off the steps measured before it,
#: by a factor that moved this much since the last check's, leaves the next check free
#: to plan, as one on a speed still moving does (``check_affordable``'s ``last_unsettled``)
MISPRICED = 1.5


def price_error(predicted_s: float, measured_s: float) -> float | None:
    """The median step measured before a check over its price of the current plan
    (fixed costs included); None where either is missing."""
    return measured_s / predicted_s if predicted_s > 0 and measured_s > 0 else None


def mispriced(error: float | None, last: float | None) -> bool:
    """Whether a check's price of the current plan was over ``MISPRICED`` times off what
    was measured (``error``, ``price_error``) by a factor new since the last check's
    (``last``; None: none priced): CI saw a check 20 steps after a peer was throttled to
    a twentieth price the current plan at 34.9 ms against 80 measured, decline, and the
    next check skipped as too costly while the speeds it planned on crept on (the move
    came 2 steps past its bound). An estimator off by a steady factor (3.6x on the H200)
    does not make every check plan at ``CHANGED_BUDGET``."""
    if error is None or not apart(error, 1.0, MISPRICED):
        return False
    return last is None or apart(error, last, MISPRICED)


#: the fewest measurements whose median ``speed_moved`` compares (fewer: too noisy to say)
MOVED_SAMPLES = 3


def speed_moved(samples: list[float], span: int = 2 * SPEED_SAMPLES) -> float:
    """How far a peer's speed moved over its last ``span`` measurements: the ratio
    (at least 1) of the medians of their first and their last ``SPEED_SAMPLES`` (or
    halves, in a shorter window; 1 under ``MOVED_SAMPLES`` each); above
    ``CHANGED_SPEED``, it changed level (the demo's loaded peers, single readings
    spread 4-5x, kept medians of nine within 1.9x of each other)."""
    recent = samples[-span:] if span > 0 else []
    k = min(SPEED_SAMPLES, len(recent) // 2)
    if k < MOVED_SAMPLES:
        return 1.0
    first, last = robust_speed(recent[:k]), robust_speed(recent[-k:])
    return max(first, last) / max(min(first, last), 1e-9)


def cooldown_steps(every: int) -> int:
    """Steps after a rebalance before the next may be decided."""
    return every * (REBALANCE_COOLDOWN_CHECKS + 1)


def next_doubt(predicted_gain: float, before: float, after: float) -> float:
    """How far the estimator's predictions are not to be trusted, once a rebalance's
    result is measured (tokens/s ``before`` -> ``after``, for a ``predicted_gain``
    speed-up factor): 0 when it delivered ``DELIVERED_SHARE`` of the predicted speed-up,
    else the shortfall (at most ``MAX_DOUBT``). The next rebalance must then be faster
    by ``REPLAN_GAIN`` plus the doubt: noise and the estimator's blind spots, which
    make moves that do not deliver, raise the bar; a large, real slow-down still clears it."""
    realized = after / before if before > 0 else 0.0
    if realized - 1 >= DELIVERED_SHARE * (predicted_gain - 1):
        return 0.0
    return min(max(predicted_gain - realized, 0.0), MAX_DOUBT)


#: a rebalance whose measured tokens/s fell by more than this fraction is undone
REVERT_LOSS = 0.05


#: moves (undos too) within this many checks, and how many of them, after which the next
#: move must be predicted twice as fast (``REPLAN_GAIN`` plus ``FLAP_DOUBT``)
FLAP_CHECKS = 50
FLAP_MOVES = 2
FLAP_DOUBT = 0.3


def damping(move_steps: list[int], step: int, every: int) -> float:
    """What a move at ``step`` must gain on top of ``REPLAN_GAIN``, however the last ones
    delivered, when ``FLAP_MOVES`` moves came within the last ``FLAP_CHECKS`` checks
    (``move_steps``: the steps of the run's moves): damping, as for flapping routes.
    Speeds that keep changing hide their volatility from the level rule, each move
    starting a plan's levels afresh, and CI saw 5 moves in 30 s of random speed changes,
    each predicted 21-48% faster and each delivering; a real slow-down (CI's throttle
    to a twentieth: 3.5x) still clears it."""
    recent = sum(1 for s in move_steps if step - s < FLAP_CHECKS * every)
    return FLAP_DOUBT if recent >= FLAP_MOVES else 0.0


#: a planned peer whose speed fell this many times since the last move was planned is a
#: new situation, not the noise that doubt and damping guard against: CI saw a peer
#: throttled to a twentieth right after two moves, and the best plan, 1.28x faster, kept
#: out by a 50% bar to the run's end. Far above the flap test's random speeds (2.9x at
#: most) times what running other operators, or sharing the machine otherwise, changes
FELL_FOR_GOOD = 8.0


def fell_for_good(speeds: dict[str, float], moved: dict[str, float]) -> bool:
    """Whether a planned peer's measured speed (``speeds``) fell over ``FELL_FOR_GOOD``
    times below the one the last move was planned on (``moved``)."""
    return any(p in moved and moved[p] > FELL_FOR_GOOD * v for p, v in speeds.items())


def bar(doubt: float, damped: float, speeds: dict[str, float], moved: dict[str, float]) -> float:
    """What a move must be predicted to gain on top of ``REPLAN_GAIN``: the doubt earlier
    moves left or the damping of recent ones (``damping``), whichever is larger; none
    where a planned peer fell far since the last move (``fell_for_good``)."""
    return 0.0 if fell_for_good(speeds, moved) else max(doubt, damped)


#: an undone plan is proposed again only when predicted this many times the speed-up it
#: was undone with (measured speeds that changed that much are another situation)
BAN_LIFT = 2.0


def still_banned(undone_gain: float, gain: float) -> bool:
    """Whether a plan that a revert undid (decided on a predicted speed-up of
    ``undone_gain``) stays out at a check that predicts it ``gain``. For ever, it kept out
    the right plan after a real slow-down: CI saw a move on noise at step 20 undone at
    40, a peer throttled to a twentieth at 47, and the rebalance wait until step 280
    (the bound: 107), the best plan for the slowed peer probably the undone one, then
    predicted 3.5x faster where it had been undone at 1.14x."""
    return gain < BAN_LIFT * undone_gain


def should_revert(before: float, after: float) -> bool:
    """Whether a rebalance made things measurably worse (tokens/s ``before`` -> ``after``)."""
    return before > 0 and after < (1 - REVERT_LOSS) * before


@dataclass(frozen=True)
class Rebalance:
    """Whether a candidate plan replaces the current one, and the figures why."""

    go: bool
    current_s: float  # predicted step seconds of the current plan, on measured speeds
    candidate_s: float
    gain_s: float  # seconds saved over the remaining steps
    move_s: float  # what the move costs: a checkpoint, the new stages' set-up
    why: str


def effective_flops(stage_flops: float, micro_batches: int, compute_s: float) -> float:
    """A peer's measured speed in the estimator's terms: the FLOP/s at which its stage's
    forward and backward (``estimator.PASSES`` x the forward FLOPs per micro-batch) took
    ``compute_s``."""
    return PASSES * stage_flops * micro_batches / max(compute_s, 1e-9)


def robust_speed(samples: list[float]) -> float:
    """The median of the last ``SPEED_SAMPLES`` measurements."""
    recent = sorted(samples[-SPEED_SAMPLES:])
    return recent[len(recent) // 2]


#: measurements of a peer's speed kept for its long-run throughput
LONG_SAMPLES = 200
#: a peer's speed (``robust_speed``, seen at each rebalance check) changed level when it
#: moved by more than this factor between two checks
LEVEL_CHANGE = 1.3
#: checks looked back on, and level changes within them that make a peer volatile
LEVEL_CHECKS = 10
VOLATILE_CHANGES = 2


def level_changes(levels: list[float | None]) -> int:
    """How often the speeds seen at consecutive checks changed level. ``None`` marks the
    start of a new plan epoch: a peer's measured speed is relative to the operators it
    runs, so a jump across a move is the move's, not the peer's, and is not counted."""
    pairs = zip(levels, levels[1:])
    return sum(1 for a, b in pairs if a is not None and b is not None and apart(a, b, LEVEL_CHANGE))


#: levels kept per peer: enough to see a volatile peer hold one level for ``LEVEL_CHECKS`` checks
LEVEL_HISTORY = 2 * LEVEL_CHECKS


def volatile(levels: list[float | None]) -> bool:
    """Whether a peer's speed is volatile: it changed level ``VOLATILE_CHANGES`` times
    within ``LEVEL_CHECKS`` checks, and has not held one level for ``LEVEL_CHECKS``
    checks since. The hysteresis matters: without it a peer flipping every few seconds
    went in and out of volatility as single changes left the window, was planned at its
    latest speed each time it went out, and the plan chased it (CI saw four moves in 30 s
    of random speed changes, against a bound of three)."""
    for end in range(len(levels), 1, -1):
        changes = level_changes(levels[max(0, end - LEVEL_CHECKS) : end])
        if changes != 1:  # two or more: volatile; none: a level held (or nothing seen yet)
            return changes >= VOLATILE_CHANGES
    return False


def new_level(levels: list[float | None]) -> bool:
    """Whether the last checks saw a lasting change: a peer that is not volatile held a
    level for two checks, then reached a new one at the check before the last and held
    it at the last, all in one plan (it clears the doubt that earlier moves left:
    ``next_doubt`` speaks of other conditions). One check of the new level is not
    enough: CI saw a peer's one-check blip clear the doubt of a move that had not
    delivered, and the next move follow it within the cool-down. Nor is a first
    reading in a plan as the old level: a move or an undo starts a plan's levels
    afresh, so a peer whose speed kept changing looked steady, and CI saw its next
    change clear the doubt right after an undo and the plan flap (5 moves in 30 s)."""
    last = levels[-4:]
    if len(last) < 4 or None in last:
        return False
    return (
        level_changes(last[:2]) == 0
        and level_changes(last[1:3]) == 1
        and level_changes(last[2:]) == 0
        and not volatile(levels)
    )


def planning_speed(samples: list[float], levels: list[float | None]) -> float:
    """The speed to plan a peer with: its recent median while its speed holds a level
    (a slow-down that lasts is acted on within two checks), else, once it changed level
    ``VOLATILE_CHANGES`` times in the last ``LEVEL_CHECKS`` checks (``volatile``), its long-run
    throughput (the harmonic mean of the kept measurements: work over time). A GPU shared
    with its owner's games is planned at what it delivers on average, not chased; but
    not one that fell to a new low far under its last levels (``fell_far``)."""
    if planned_at_recent(samples, levels):
        return robust_speed(samples)
    return len(samples) / sum(1 / max(x, 1e-9) for x in samples)


def planned_at_recent(samples: list[float], levels: list[float | None]) -> bool:
    """Whether ``planning_speed`` is the recent median: a peer that is not volatile, or
    one that fell far (``fell_far``)."""
    return not volatile(levels) or fell_far(levels, robust_speed(samples))


def fell_far(levels: list[float | None], recent: float) -> bool:
    """Whether ``recent`` is a new low over ``FELL_FOR_GOOD`` times under a level seen at
    the last ``LEVEL_CHECKS`` checks (``levels``), none of the last ``LEVEL_HISTORY``
    before its own run of checks at it within ``LEVEL_CHANGE`` of it. CI saw a peer that a
    loaded machine's noise had made volatile throttled to a twentieth, planned at an
    average still mostly of its speed before, and the move come 20 steps past its
    bound. A low seen before (a GPU whose owner games now and then) is planned at the
    average. The levels span moves: each is a robust median of one peer's measured
    FLOP/s, which other operators change by far less than ``FELL_FOR_GOOD``."""
    seen = [x for x in levels[-LEVEL_HISTORY:] if x is not None]
    near = [not apart(x, recent, LEVEL_CHANGE) for x in seen]
    while near and near[-1]:  # the checks at this level so far
        near.pop()
    return not any(near) and any(x > FELL_FOR_GOOD * recent for x in seen[-LEVEL_CHECKS:])


def rebalance(
    current_s: float, candidate_s: float, remaining_steps: int, move_s: float, doubt: float = 0.0
) -> Rebalance:
    """Move to the candidate only when it is faster by ``REPLAN_GAIN`` (plus ``doubt``,
    see ``next_doubt``) and what it saves over the remaining steps pays
    ``REBALANCE_PAYBACK`` times for the move."""
    gain = (current_s - candidate_s) * remaining_steps
    faster = candidate_s < (1 - REPLAN_GAIN - doubt) * current_s
    go = faster and gain >= REBALANCE_PAYBACK * move_s
    if not faster:
        why = (
            f"the best plan ({candidate_s * 1e3:.1f} ms) is not {REPLAN_GAIN + doubt:.0%} faster than "
            f"the current one ({current_s * 1e3:.1f} ms)"
        )
    elif not go:
        why = f"saving {gain:.1f} s over {remaining_steps} steps does not pay for a {move_s:.1f} s move"
    else:
        why = (
            f"{current_s * 1e3:.1f} -> {candidate_s * 1e3:.1f} ms per step saves {gain:.1f} s over "
            f"{remaining_steps} steps for a {move_s:.1f} s move"
        )
    return Rebalance(go, current_s, candidate_s, gain, move_s, why)
