"""A volunteer's settings (``fusionllm join``'s flags) and the one error joining reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.net.hostaddrs import LOOPBACK_MADDRS
from protocol.net.records import ADVERT_TTL_S


class JoinError(RuntimeError):
    """The peer could not join the swarm; ``str()`` says why in one line."""


@dataclass
class PeerConfig:
    initial_peers: list[str]
    run_id: str = "fusionllm"
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))  # the CLI: every interface
    announce_maddrs: list[str] = field(default_factory=list)  # where others should dial it (a forwarded port)
    data_path: str = "direct"  # "libp2p": every frame inside libp2p's streams (protocol.net.direct)
    device: str | None = None
    advert_ttl: float = ADVERT_TTL_S
    join_timeout: float = 30.0
    bandwidth_probe_bytes: int = 4 << 20
    link_probe_bytes: int = 1 << 20
    message_timeout: float = 600.0
    identity: str | None = None  # key file; None: a fresh key for this process only
    coordinator_grace: float = 120.0  # how long to wait for a lost coordinator to come back
    throttle: float = 1.0  # compute at this fraction of the peer's speed (peer.throttle); in (0, 1]
    throttle_file: str | None = None  # read the throttle from this file about once a second while running
    throttle_call_s: float = 0.0  # a compute call's own work the throttle leaves unstretched (peer.throttle)
    advertise_flops: float | None = None  # advertise this instead of the measured FLOP/s (a lying peer, for tests)
    coordinator_key: str | None = None  # the coordinator's Ed25519 key (hex), pinned; None: trust on first use
    allow_code: list[str] = field(default_factory=list)  # model modules (MODULE or file.py) this peer may import
    allow_ops: list[str] = field(default_factory=list)  # operator namespaces a stage program may call beyond aten
    swarm_secret: str = ""  # a private swarm's secret (hex, from its join token): proven in the hello
