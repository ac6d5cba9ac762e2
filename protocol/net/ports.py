"""Listen addresses: is a port free before the p2p daemon is asked to take it? (The
daemon binds with SO_REUSEPORT, so it would share a port with an orphaned one
without complaint.)"""

from __future__ import annotations

import errno
import logging
import socket

from multiaddr import Multiaddr

logger = logging.getLogger(__name__)


class PortTaken(RuntimeError):
    """A listen address's port is in use by another process."""


def check_listen_ports(maddrs: list[str]) -> None:
    """Raise :class:`PortTaken` if a /ip4|ip6/A/tcp/N address (N != 0) cannot be bound now."""
    for text in maddrs:
        parts = list(Multiaddr(text).items())
        if len(parts) < 2 or parts[0][0].name not in ("ip4", "ip6") or parts[1][0].name != "tcp":
            continue
        host, port = parts[0][1], int(parts[1][1])
        if port == 0:
            continue
        family = socket.AF_INET if parts[0][0].name == "ip4" else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                # SO_REUSEADDR: a port in TIME_WAIT is free, a live listener is not (no SO_REUSEPORT)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as the Go daemon binds
                s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortTaken(
                    f"port {port} on {host} is taken (another coordinator, or a p2p daemon left by one that "
                    f"was killed?); choose another --port, or stop that process"
                ) from None
            logger.debug("could not test %s (%s); the p2p daemon will tell", text, exc)
