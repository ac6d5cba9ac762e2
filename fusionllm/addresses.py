"""Where ``fusionllm coordinator`` and ``join`` listen and what they tell other
machines: their flags (``--port``, ``--announce``, ``--host-maddrs``), read into
multiaddrs, and the lines the coordinator prints about them (the port to open, the
status page). The parser and the commands import this module; it imports neither,
nor torch."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from multiaddr import Multiaddr

from fusionllm.usage import UsageError
from protocol.net.hostaddrs import AddressError, JoinAddrs, announce_maddr, ip_of, listen_maddrs
from protocol.net.ports import PortTaken, check_listen_ports
from protocol.net.reach import tcp_ports


def add_data_path_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--data-path``: for ``coordinator``, ``join`` and ``demo`` (``protocol.net.direct``)."""
    p.add_argument(
        "--data-path",
        choices=["direct", "libp2p"],
        default="direct",
        help="how frames travel to and from processes that can dial each other: 'direct' over plain TCP "
        "(signed, not encrypted: an observer on the path sees activations), 'libp2p' inside libp2p's "
        "encrypted streams (slower); direct only where both ends allow it (default: direct)",
    )


def add_listen_flags(p: argparse.ArgumentParser, port_type: Callable[[str], int], port_help: str) -> None:
    """``--port`` (or ``--host-maddrs``, exactly) and ``--announce``, for ``coordinator`` and ``join``."""
    p.add_argument("--port", type=port_type, default=None, metavar="N", help=port_help)
    p.add_argument(
        "--announce",
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="ADDR",
        help="where other machines should dial this one, instead of its interfaces' addresses: an IP or host "
        "name (at --port), HOST:PORT (e.g. your router's public address and a port it forwards here) or a "
        "multiaddr; behind a NAT without one, a peer dials out instead (default: the interfaces' addresses)",
    )
    add_data_path_flag(p)
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="listen exactly on these multiaddrs instead of --port (e.g. /ip4/127.0.0.1/tcp/0: this machine only; "
        "default: every interface at --port)",
    )


def check_maddrs(values: list[str], flag: str) -> list[str]:
    """Each address must parse as a libp2p multiaddr (py-multiaddr)."""
    for v in values:
        try:
            Multiaddr(v)
        except Exception as exc:
            raise UsageError(f"{flag} '{v}' is not a valid multiaddr: {exc}") from None
    return values


def listen_options(args: argparse.Namespace, default_port: int) -> tuple[list[str], list[str]]:
    """Where to listen (``--port``, or ``--host-maddrs``) and the multiaddrs to announce
    (``--announce``); raises UsageError (one line) for a bad value, both ways of saying
    where to listen, or a port another process holds."""
    if args.host_maddrs is not None and args.port is not None:
        raise UsageError("--port and --host-maddrs both say where to listen: give one")
    if args.host_maddrs is not None:
        host = check_maddrs(args.host_maddrs, "--host-maddrs")
        port = next(iter(tcp_ports(host)), 0)
    else:
        port = default_port if args.port is None else args.port
        host = listen_maddrs(port)
    announce = []
    for value in args.announce:
        try:
            announce.append(announce_maddr(value, port))
        except AddressError as exc:
            raise UsageError(f"--announce '{value}': {exc}") from None
    try:
        check_listen_ports(host)
    except PortTaken as exc:
        raise UsageError(str(exc)) from None
    return host, announce


def reach_lines(join: JoinAddrs, ports: list[int], announced: bool, listen: list[str]) -> list[str]:
    """What the coordinator says of its join line: the TCP ``ports`` other machines must
    reach, or that the line works on this machine only. Nothing when it ``listen``s on
    loopback only because it was told to (``--host-maddrs``, the demo)."""
    if join.loopback_only:
        if all((ip := ip_of(m)) is not None and ipaddress.ip_address(ip).is_loopback for m in listen):
            return []
        return ["this machine has no address other machines can reach (only loopback): the join line works here only"]
    port = f"TCP port{'s' if len(ports) > 1 else ''} {', '.join(map(str, ports))}" if ports else "its TCP port"
    it = "them" if len(ports) > 1 else "it"
    if announced and not ports:
        return ["other machines dial the --announce address, but this listens at any free port: fix one with --port"]
    if announced:
        return [f"other machines dial the --announce address: it must lead to {port} here (forwarded, not firewalled)"]
    seen = f"; other peers see this machine at {', '.join(join.observed)}" if join.observed else ""
    return [
        f"other machines must reach {port} here: let {it} through this machine's firewall (behind a NAT router: "
        f"forward {it} here and add --announce <the router's public IP>){seen}"
    ]


def status_lines(url: str, join: JoinAddrs) -> list[str]:
    """Where the status page is, and how another machine gets to it."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [f"status page: {url}"]
    there = next((a for a in map(ip_of, join.maddrs) if a is not None), None) if not join.loopback_only else None
    where = f"[{there}]" if there and ":" in there else there
    if ip.is_loopback:
        to = f"<you>@{there}" if there else "<you>@<this machine>"
        how = (
            f"on this machine only; from another, 'ssh -L {port}:127.0.0.1:{port} {to}' and open "
            f"http://127.0.0.1:{port}/ there (or serve it to the network with --status-host 0.0.0.0)"
        )
    elif ip.is_unspecified and where:
        how = f"served on every interface: from another machine, http://{where}:{port}/ (read-only, for anyone)"
    else:
        return [f"status page: {url}"]
    return [f"status page: {url}", f"  {how}"]
