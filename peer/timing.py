"""Where a peer's step time goes: the step's timeline on the peer cut into the parts
of ``protocol.wire.messages.STEP_PARTS``, reported with each ``StepDone``.

A window runs from one report to the next (the first from the epoch's first step),
so what a peer does after a step's ``StepDone`` (the commit's round trip, the
optimizer's update, a checkpoint's snapshot) counts in the next step's window, and
the windows of consecutive steps tile the peer's time. Each part is measured around
the one thing the step's coroutine awaits or runs at that moment, so the parts never
overlap; ``other`` is the rest of the window."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from protocol.wire.step_parts import STEP_PARTS


class StepTimes:
    """The current window's seconds per part; ``report`` closes the window."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.parts: dict[str, float] = dict.fromkeys(STEP_PARTS, 0.0)
        self.began: float | None = None

    def start(self) -> None:
        """Open a window now unless one is open (the epoch's first step)."""
        if self.began is None:
            self.began = self.clock()

    def add(self, part: str, seconds: float) -> None:
        if part not in self.parts:
            raise KeyError(f"no step part '{part}'")
        self.parts[part] += max(seconds, 0.0)

    def thread_wait(self, seconds: float, checking: float) -> None:
        """``seconds`` spent waiting on the compute thread around a piece of work: the
        ``checking`` seconds a spot check held the thread meanwhile are ``spot_checks``',
        the rest (handing the work over and back) ``handoff``'s."""
        held = min(max(seconds, 0.0), max(checking, 0.0))
        self.add("spot_checks", held)
        self.add("handoff", seconds - held)

    def since(self, part: str, t0: float) -> float:
        """Add the seconds from ``t0`` (by this clock) to now to ``part``; returns now."""
        now = self.clock()
        self.add(part, now - t0)
        return now

    def waited(self, t0: float, wire_s: float) -> None:
        """A wait from ``t0`` to now for a message that took ``wire_s`` from its first
        byte to its delivery: the part before its first byte is the neighbour's (bubble)."""
        total = max(self.clock() - t0, 0.0)
        wire = min(total, max(wire_s, 0.0))
        self.add("wire", wire)
        self.add("bubble", total - wire)

    def report(self) -> dict[str, float]:
        """The window's parts, ``other`` and ``step`` (the window's length), in seconds;
        a new window opens now."""
        now = self.clock()
        began = now if self.began is None else self.began
        total = now - began
        out = {k: v for k, v in self.parts.items() if k != "other"}
        out["other"] = max(total - sum(out.values()), 0.0)
        out["step"] = total
        self.parts = dict.fromkeys(STEP_PARTS, 0.0)
        self.began = now
        return {k: round(v, 6) for k, v in out.items()}


def covered(breakdown: dict[str, Any]) -> float:
    """The share of a reported window that its named parts (all but ``other``) cover."""
    step = float(breakdown.get("step", 0.0))
    named = sum(float(v) for k, v in breakdown.items() if k in STEP_PARTS and k != "other")
    return named / step if step > 0 else 0.0
