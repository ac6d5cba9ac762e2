"""Pipeline schedules as data: per stage, the ordered list of actions it runs in
one step. ``("F", mb)`` is a forward, ``("B", mb)`` a backward."""

from __future__ import annotations

from collections.abc import Sequence, Sized

Action = tuple[str, int]
Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule that cannot run: missing, repeated or mis-ordered actions."""


def gpipe(num_stages: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order (backwards in
    reverse, the textbook order, added a stage's parameter gradients in another order
    than one process does: last bits that fp16 grew to 5e-5 after five steps)."""
    one = [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
    return [list(one) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, micro_batches: int) -> Schedule:
    """1F1B: stage s warms up with ``num_stages - s`` forwards, then alternates."""
    out: Schedule = []
    for s in range(num_stages):
        warm = min(num_stages - s, micro_batches)
        acts: list[Action] = [("F", m) for m in range(warm)]
        f, b = warm, 0
        while b < micro_batches:
            acts.append(("B", b))
            b += 1
            if f < micro_batches:
                acts.append(("F", f))
                f += 1
        out.append(acts)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def uses_1f1b(groups: Sequence[Sized]) -> bool:
    """The one rule: a swarm runs 1F1B only when every stage has as many replicas
    (replica ``i`` of every stage forms a lane); else GPipe."""
    return len({len(g) for g in groups}) == 1


def effective(name: str, groups: Sequence[Sized]) -> str:
    """The schedule a swarm of stages with these replica groups runs for the job's ``name``."""
    return name if uses_1f1b(groups) else "gpipe"


def make(name: str, num_stages: int, micro_batches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule '{name}' (choose from {', '.join(SCHEDULES)})")
    sched = SCHEDULES[name](num_stages, micro_batches)
    validate(sched, num_stages, micro_batches)
    return sched


def validate(sched: Schedule, num_stages: int, micro_batches: int) -> None:
    """Check every stage runs F and B of each micro-batch once, F before B, and that
    the dependencies between stages can be met (simulated with unbounded buffers)."""
    if len(sched) != num_stages:
        raise ScheduleError(f"{len(sched)} stage lists for {num_stages} stages")
    want = {(k, m) for k in "FB" for m in range(micro_batches)}
    for s, acts in enumerate(sched):
        if sorted(acts) != sorted(want) or len(acts) != len(want):
            raise ScheduleError(f"stage {s} must run F and B of micro-batches 0..{micro_batches - 1} once each")
        seen: set[int] = set()
        for kind, m in acts:
            if kind == "F":
                seen.add(m)
            elif m not in seen:
                raise ScheduleError(f"stage {s} runs B{m} before F{m}")
    done: set[tuple[int, str, int]] = set()
    pos = [0] * num_stages
    progress = True
    while progress:
        progress = False
        for s in range(num_stages):
            while pos[s] < len(sched[s]):
                kind, m = sched[s][pos[s]]
                if kind == "F":
                    ready = s == 0 or (s - 1, "F", m) in done
                else:
                    ready = s == num_stages - 1 or (s + 1, "B", m) in done
                if not ready:
                    break
                done.add((s, kind, m))
                pos[s] += 1
                progress = True
    stuck = [s for s in range(num_stages) if pos[s] < len(sched[s])]
    if stuck:
        s = stuck[0]
        raise ScheduleError(f"deadlock: stage {s} waits forever at {sched[s][pos[s]]}")


def render(sched: Schedule) -> str:
    """One line per stage, e.g. ``stage 0: F0 F1 B0 F2 B1 B2``."""
    return "\n".join(f"stage {s}: " + " ".join(f"{k}{m}" for k, m in acts) for s, acts in enumerate(sched))
