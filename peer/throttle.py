"""Throttling a peer's compute to a fraction F of its speed (``join --throttle``):
after each compute call the peer idles on its event loop until the call has lasted
1/F times the work it did, so its stage takes about 1/F as long while heartbeats and
messages keep flowing. The work is the call's CPU time where one CPU thread does it
(a one-thread CPU peer), else its wall time: a peer that shares a busy machine's
cores (the testbed's) waits for a core, and 1/F times that wait would emulate a
device slower than the one asked for (four replicas computing at once on two cores
took 4.8x as long as predicted). F may change while the peer runs, read from a file
(``join --throttle-file``), to try the rebalancer on a peer that slows down."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.tasks import every

logger = logging.getLogger(__name__)

#: seconds between reads of the throttle file
POLL_S = 1.0
#: a throttle file holds one number; longer contents are refused unread
MAX_FILE_BYTES = 64


class ThrottleError(ValueError):
    """A throttle out of (0, 1] or not a number; ``str()`` says why in one line."""


def check_throttle(value: float) -> float:
    """``value`` if it is a fraction in (0, 1]; else ThrottleError."""
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise ThrottleError(f"{value!r} is not a number in (0, 1]")
    return float(value)


def parse_throttle(text: str) -> float:
    """A throttle written as text (a command-line flag, a throttle file)."""
    try:
        return check_throttle(float(text))
    except ValueError:  # not a number, or ThrottleError: out of range
        raise ThrottleError(f"'{_printable(text)}' is not a number in (0, 1]") from None


def _printable(text: str, limit: int = 40) -> str:
    """Local file text as it may be logged: control characters replaced, shortened."""
    short = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return short + ("..." if len(text) > limit else "")


class Throttle:
    """The fraction of its speed a peer computes at. ``on_change`` is told each change
    (one line, e.g. ``throttle: 0.25 (from PATH)``), which is also logged at INFO."""

    def __init__(self, value: float = 1.0, on_change: Callable[[str], None] | None = None, call_s: float = 0.0) -> None:
        self._value = check_throttle(value)
        self.on_change = on_change
        #: a compute call's own work (Python, the stage's graph) that is not stretched:
        #: an emulated device slower at its FLOPs whose host runs Python as fast
        self.call_s = call_s if math.isfinite(call_s) and call_s > 0 else 0.0
        self._refused: str | None = None  # the last bad file content warned about

    @property
    def value(self) -> float:
        return self._value

    def set(self, value: float, source: str = "") -> bool:
        """Take a new value; True if it changed (then logged and told to ``on_change``)."""
        value = check_throttle(value)
        if value == self._value:
            return False
        self._value = value
        text = f"throttle: {value:g}" + (f" (from {source})" if source else "")
        logger.info("%s", text)
        if self.on_change is not None:
            self.on_change(text)
        return True

    def pause_for(self, compute_s: float, work_s: float | None = None) -> float:
        """Seconds to idle after a compute call that took ``compute_s`` and did
        ``work_s`` of work (its CPU time; None: ``compute_s``): the call then lasts
        ``work_s / F`` in all (the part beyond ``call_s`` stretched, the rest not), or
        as long as it took if that is longer."""
        work = compute_s if work_s is None else min(work_s, compute_s)
        if self._value >= 1.0 or not work > 0.0 or math.isinf(compute_s):
            return 0.0
        own = min(work, self.call_s)
        return max(0.0, (work - own) / self._value + own - compute_s)

    async def idle(self, compute_s: float, work_s: float | None = None) -> float:
        """Idle on the event loop (the compute thread stays free) for
        ``pause_for(compute_s, work_s)``; returns the pause."""
        pause = self.pause_for(compute_s, work_s)
        if pause > 0.0:
            await asyncio.sleep(pause)
        return pause

    def poll(self, path: str) -> bool:
        """Read the throttle file once; True if the value changed. An absent or empty
        file keeps the value silently; an unreadable one or a bad number keeps it with
        a warning, once per distinct content."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._refuse(f"<{exc.strerror or type(exc).__name__}>", f"throttle file {path} is unreadable: {exc}")
            return False
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:  # being written, or cleared: wait for a number
            return False
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ThrottleError(f"it holds more than {MAX_FILE_BYTES} bytes, not one number in (0, 1]")
            value = parse_throttle(text)
        except ThrottleError as exc:
            self._refuse(text, f"throttle file {path}: {exc}; keeping {self._value:g}")
            return False
        self._refused = None
        return self.set(value, path)

    def _refuse(self, content: str, warning: str) -> None:
        if content != self._refused:
            self._refused = content
            logger.warning("%s", warning)

    async def watch(self, path: str, interval: float = POLL_S, clock: Clock = SYSTEM_CLOCK) -> None:
        """Read the throttle file about every ``interval`` seconds, forever (cancel to stop)."""

        async def poll() -> None:
            self.poll(path)

        await every(interval, poll, what=f"reading the throttle file {path}", clock=clock, first=0.0)
