"""Reachability: can others open connections to a peer, or must it dial out?

The coordinator finds out by dialling back (``dial_back``): a TCP connection to the
address the peer's own connection came from (what its router shows the internet),
at each port the peer listens on. It never dials an address a peer merely claims:
the coordinator cannot be made to open connections to third parties. A peer behind
a NAT (a home router, a campus firewall) is not reachable there unless its user
forwarded the port; it then *dials out* to the peers it works with, and they use
those connections in both directions (``Assign.nat`` names such peers).

A joining peer that reaches none of its initial peers says why from a plain TCP
connection to each (``why_unreachable``): refused, no answer, or open."""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

#: how long one dial-back may take
DIAL_BACK_TIMEOUT_S = 3.0
#: ports of one peer dialled back at most
MAX_DIAL_BACK_PORTS = 4

#: what a peer may do when it is not reachable (printed by ``fusionllm join``)
HOW_TO_BE_REACHABLE = (
    "forward TCP port {port} on your router to this machine and join with --port {port} --announce <your public IP>"
)


@dataclass(frozen=True)
class Reach:
    """A dial-back's result: ``direct`` when some port answered; ``detail`` says what was tried."""

    direct: bool
    detail: str


def tcp_ports(maddrs: list[str]) -> list[int]:
    """The TCP ports in ``maddrs`` (``/ip4|ip6/…/tcp/PORT…``), at most ``MAX_DIAL_BACK_PORTS``."""
    ports: list[int] = []
    for m in maddrs:
        parts = m.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and _digits(parts[4]):
            port = int(parts[4])
            if 0 < port < 65536 and port not in ports:
                ports.append(port)
    return ports[:MAX_DIAL_BACK_PORTS]


def observed_ip(maddrs: list[str]) -> str | None:
    """The IP address of the first ``/ip4`` or ``/ip6`` multiaddr (a connection's remote end)."""
    for m in maddrs:
        parts = m.split("/")
        if len(parts) >= 3 and parts[1] in ("ip4", "ip6"):
            try:
                return str(ipaddress.ip_address(parts[2]))
            except ValueError:
                continue
    return None


async def dial_back(ip: str | None, ports: list[int], timeout: float = DIAL_BACK_TIMEOUT_S) -> Reach:
    """Whether a TCP connection to ``ip`` opens at any of ``ports``."""
    if ip is None or not ports:
        return Reach(False, "no address of its connection, or no port it listens on, to dial back")
    tried = []
    for port in ports:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            tried.append(f"{_host(ip)}:{port} ({_why(exc)})")
            continue
        writer.close()
        return Reach(True, f"dialled back at {_host(ip)}:{port}")
    return Reach(False, "could not dial back " + ", ".join(tried))


async def why_unreachable(maddrs: list[str], timeout: float = DIAL_BACK_TIMEOUT_S) -> str:
    """Why no DHT node answered at ``maddrs`` (a joining peer's initial peers), from a
    TCP connection tried to each at once: one line, what each did and the likely cause."""
    targets = list(dict.fromkeys(t for t in map(_host_port, maddrs) if t is not None))
    if not targets:
        return "none of them is an address with a TCP port (/ip4|ip6|dns/HOST/tcp/PORT)"
    got = await asyncio.gather(*(_tcp_probe(host, port, timeout) for host, port in targets))
    tried = ", ".join(f"{_host(h)}:{p} ({why})" for (h, p), why in zip(targets, got))
    ports = ", ".join(sorted({str(p) for _, p in targets}))
    if "open" in got:
        cause = "something listens there but no DHT node with that peer id answered: a wrong port or peer id"
    elif all(why == "refused" for why in got):
        cause = "nothing listens there: the coordinator is no longer running, or the port is wrong"
    else:
        cause = (
            f"a firewall on the coordinator's machine or on the way drops TCP port {ports}, or the address is "
            "wrong (a private address dialled from outside its network?)"
        )
    return f"{tried}: {cause}"


async def _tcp_probe(host: str, port: int, timeout: float) -> str:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return "refused"
    except (OSError, asyncio.TimeoutError) as exc:
        return _why(exc)
    writer.close()
    return "open"


def _host_port(maddr: str) -> tuple[str, int] | None:
    parts = maddr.split("/")
    ok = len(parts) >= 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] == "tcp"
    return (parts[2], int(parts[4])) if ok and _digits(parts[4]) and 0 < int(parts[4]) < 65536 else None


def _digits(text: str) -> bool:
    return text.isascii() and text.isdecimal() and len(text) <= 5


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer"
    return getattr(exc, "strerror", None) or type(exc).__name__
