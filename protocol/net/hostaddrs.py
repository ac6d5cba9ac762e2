"""Where a coordinator or a peer listens, and which of its addresses it tells others.

``fusionllm coordinator`` and ``join`` listen on every interface, IPv4 and IPv6, at
``--port``. What a join line names is what another machine can dial: the addresses
the p2p daemon reports (it expands ``0.0.0.0`` and ``::`` into each interface's, and
adds the public ones its peers observed), less loopback and link-local ones; the
observed public ones first. A host with no other address keeps loopback (the line
then works on that machine only, and says so). ``--announce`` replaces all of them:
the daemon then reports exactly what it names."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from multiaddr import Multiaddr

#: ``fusionllm coordinator``'s TCP port (IPv4 and IPv6): fixed, so that the port to open
#: in a firewall is known beforehand and a printed join line stays valid after a restart
COORDINATOR_PORT = 31337
#: ``fusionllm join``'s: any free port, as several peers may run on one machine (a peer
#: that others cannot dial back dials out instead; ``--port`` fixes one to forward)
PEER_PORT = 0
#: where the demo (one machine) and an embedded coordinator or peer listen by default
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)

_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9-]{1,63})*")


class AddressError(ValueError):
    """An address that cannot be announced; ``str()`` says why in one line."""


def listen_maddrs(port: int) -> list[str]:
    """Every interface, IPv4 and IPv6, at ``port`` (0: any free one)."""
    return [f"/ip4/0.0.0.0/tcp/{port}", f"/ip6/::/tcp/{port}"]


def announce_maddr(value: str, port: int) -> str:
    """``--announce``'s value as a multiaddr: a multiaddr (``/ip4/A/tcp/N``,
    ``/dns/NAME/tcp/N``...) as given; ``HOST:PORT`` or ``[IPv6]:PORT``; or an IP or
    host name alone, at ``port`` (the one this process listens on, which must then be
    fixed). Raises :class:`AddressError`."""
    value = value.strip()
    if value.startswith("/"):
        try:
            parts = [p.name for p, _ in Multiaddr(value).items()]
        except Exception as exc:
            raise AddressError(f"not a valid multiaddr ({exc})") from None
        if len(parts) < 2 or parts[1] != "tcp" or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
            raise AddressError("a multiaddr to announce starts /ip4|ip6|dns/HOST/tcp/PORT")
        return value
    if value.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = value[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise AddressError("write an IPv6 address with a port as [ADDRESS]:PORT")
        port_text = rest[1:]
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:  # an IPv4 address or name alone, or a bare IPv6 address
        host, port_text = value, ""
    where = _host_part(host)
    if port_text or value.endswith(":"):
        if not (port_text.isascii() and port_text.isdecimal() and 0 < int(port_text) < 65536):
            raise AddressError(f"'{port_text}' is not a port (1-65535)")
        port = int(port_text)
    elif port == 0:
        raise AddressError("no port: give HOST:PORT, or listen on a fixed --port")
    return f"{where}/tcp/{port}"


def _host_part(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host) or host.replace(".", "").isdecimal():
            raise AddressError(f"'{host}' is neither an IP address nor a host name") from None
        return f"/dns/{host}"
    if ip.is_unspecified or ip.is_multicast:
        raise AddressError(f"{ip} is not an address another machine can dial")
    return f"/ip{ip.version}/{ip}"


def ip_of(maddr: str) -> str | None:
    """The IP address a ``/ip4`` or ``/ip6`` multiaddr starts with (None for any other)."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def dialable(ip: str) -> bool:
    """Whether another machine may dial ``ip``: not loopback, link-local, unspecified or multicast."""
    addr = ipaddress.ip_address(ip)
    return not (addr.is_loopback or addr.is_link_local or addr.is_unspecified or addr.is_multicast)


@dataclass(frozen=True)
class JoinAddrs:
    """What a join line names: ``maddrs`` in order; ``observed``: the IPs among them on
    no interface of this host (where its peers saw it: a NAT's public side, say);
    ``loopback_only``: no address another machine can dial, so the line names loopback."""

    maddrs: list[str]
    observed: list[str]
    loopback_only: bool


def join_addrs(visible: list[str], local_ips: set[str] | None, announced: bool = False) -> JoinAddrs:
    """The addresses of ``visible`` (as the p2p daemon reports them) that another machine
    can dial. ``local_ips``: this host's interface addresses (None: unknown, nothing
    counts as observed). ``announced``: ``visible`` is what ``--announce`` named, kept whole."""
    if announced:
        return JoinAddrs(list(visible), [], False)
    keep = [m for m in visible if "/p2p-circuit" not in m and ((ip := ip_of(m)) is None or dialable(ip))]
    if not keep:
        return JoinAddrs(list(visible), [], True)
    seen = [ip for m in keep if (ip := ip_of(m)) is not None]
    observed = [] if local_ips is None else list(dict.fromkeys(ip for ip in seen if ip not in local_ips))
    keep.sort(key=lambda m: ip_of(m) not in observed)  # stable: the observed ones first
    return JoinAddrs(keep, observed, False)


def interface_ips() -> set[str] | None:
    """The IP addresses on this host's interfaces (None if they cannot be listed)."""
    import psutil

    try:
        listed = psutil.net_if_addrs()
    except (OSError, RuntimeError):
        return None
    ips = set()
    for addrs in listed.values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    ips.add(str(ipaddress.ip_address(a.address.split("%")[0])))
                except ValueError:
                    continue
    return ips
