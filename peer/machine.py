"""Which machine a peer runs on, as its advert says it: a digest of the machine's
identity salted with the run (so that peers on one machine match, and neither an
address nor a digest another run could match is given away), and its cores. The
coordinator divides a machine's compute among the CPU peers on it
(``coordinator.host_share``)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

#: where Linux keeps the machine's random identity (read when present)
MACHINE_ID = Path("/etc/machine-id")
#: hex digits of the digest an advert carries
DIGEST_DIGITS = 16


def host_digest(run_id: str, identity: str | None = None) -> str:
    """The salted digest of this machine for ``run_id`` (``identity``: the machine's,
    read from ``/etc/machine-id``, else its host name)."""
    if identity is None:
        try:
            identity = MACHINE_ID.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            identity = ""
        identity = identity or socket.gethostname()
    return hashlib.sha256(f"fusionllm-host:{run_id}:{identity}".encode()).hexdigest()[:DIGEST_DIGITS]


def machine_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
