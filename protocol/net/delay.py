"""Added one-way latency per destination host, for an emulated testbed whose kernel
has no netem: the table comes from the environment (``FUSIONLLM_LINK_DELAY_MS``, e.g.
``10.77.0.2=40,10.77.0.3=40``: milliseconds per destination IP) and a send to a
listed host waits that long before its first byte goes out. The send path knows a
destination by its peer id; the transport keeps the addresses it learnt for each
(``Transport.learn``), and ``wait_addrs`` takes the first of their hosts the table
lists. Sends to one destination that are in flight at once each wait once, side by
side, as on a real link; a caller that awaits one send before the next pays the
latency per send, as a sender waiting for each acknowledgement would."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping

ENV_VAR = "FUSIONLLM_LINK_DELAY_MS"
MAX_DELAY_MS = 10_000.0  # a delay table asking for more is a typo, not a link


def parse_delays(text: str) -> dict[str, float]:
    """``host=ms,...`` -> {host: seconds}; a malformed entry raises ValueError in one line."""
    table: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        host, sep, value = entry.partition("=")
        try:
            ms = float(value) if sep and host.strip() else float("nan")
        except ValueError:
            ms = float("nan")
        if not 0 <= ms <= MAX_DELAY_MS:
            raise ValueError(f"{ENV_VAR}: {entry!r} is not host=milliseconds (0..{MAX_DELAY_MS:g})")
        table[host.strip()] = ms / 1000
    return table


class DelayTable:
    """One-way delays per destination host; hosts not listed get none."""

    def __init__(
        self,
        delays: Mapping[str, float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._delays = dict(delays or {})
        self._sleep = sleep

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DelayTable:
        """The table the environment names (empty when the variable is unset)."""
        env = os.environ if environ is None else environ
        return cls(parse_delays(env.get(ENV_VAR, "")))

    def delay_s(self, host: str) -> float:
        """Seconds added before a send to ``host``."""
        return self._delays.get(host, 0.0)

    def __bool__(self) -> bool:
        return bool(self._delays)

    def delay_for(self, maddrs: Iterable[str]) -> float:
        """Seconds added before a send to a peer listening at ``maddrs`` (multiaddrs):
        the delay of the first of their hosts the table lists, else none."""
        for maddr in maddrs:
            parts = str(maddr).split("/")
            for proto, value in zip(parts, parts[1:]):
                if proto in ("ip4", "ip6", "dns", "dns4", "dns6") and value in self._delays:
                    return self._delays[value]
        return 0.0

    async def wait_addrs(self, maddrs: Iterable[str]) -> None:
        """Wait the delay added on the way to a peer listening at ``maddrs``."""
        if self._delays:
            delay = self.delay_for(maddrs)
            if delay > 0:
                await self._sleep(delay)

    async def wait(self, host: str) -> None:
        """Wait the delay added on the way to ``host`` (returns at once when none)."""
        delay = self.delay_s(host)
        if delay > 0:
            await self._sleep(delay)
