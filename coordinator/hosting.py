"""Where a coordinator lives: its run directory (new, or the one it resumes), the
addresses it listens on and bootstraps from, and its DHT node."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import hivemind
from hivemind.p2p import P2P

from coordinator.checkpoint import DB_NAME, CheckpointError, RunDir, default_run_dir
from coordinator.config import CoordinatorConfig
from coordinator.outcome import SwarmError
from protocol.net import dhtstart
from protocol.net.ports import PortTaken, check_listen_ports
from protocol.trust.identity import Identity
from protocol.trust.run_records import RunRecords

logger = logging.getLogger(__name__)


def open_run_dir(cfg: CoordinatorConfig) -> RunDir:
    """The run directory: new (refusing one that holds another run's checkpoints) or,
    with ``resume``, the one of the same run and job. Raises SwarmError (one line)."""
    # by default a new folder per start, so a new run never meets an old one's checkpoints
    started = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    path = Path(cfg.run_dir).expanduser() if cfg.run_dir else default_run_dir(cfg.run_id) / started
    if cfg.resume and not (path / DB_NAME).is_file():
        raise SwarmError(f"--resume {path}: no run there (no {DB_NAME})")
    run_dir = RunDir(path)
    try:
        run_dir.open()
    except (OSError, CheckpointError) as exc:
        raise SwarmError(f"cannot use the run directory {path}: {exc}") from None
    job, run_id = run_dir.get_meta("job"), run_dir.get_meta("run_id")
    if cfg.resume:
        if run_id != cfg.run_id or job != cfg.job_fields():
            raise SwarmError(
                f"--resume {path}: that run is '{run_id}' with job {job}; start the coordinator with the same "
                "--run and job flags as the first time"
            )
    elif run_dir.latest() is not None:
        raise SwarmError(
            f"the run directory {path} already holds run '{run_id}' (checkpoint of step {run_dir.latest().step}); "
            f"continue it with --resume {path}, or choose another --run-dir"
        )
    run_dir.set_meta("run_id", cfg.run_id)
    run_dir.set_meta("job", cfg.job_fields())
    return run_dir


def addresses(cfg: CoordinatorConfig, run_dir: RunDir) -> tuple[list[str], list[str]]:
    """Where to listen and whom to bootstrap from: on resume, the previous ports
    (where free, so printed join commands stay valid) and the recorded peers."""
    if not cfg.resume:
        return cfg.host_maddrs, cfg.initial_peers
    ports = run_dir.get_meta("ports", {})
    if isinstance(ports, list):  # as an older version recorded them: one port, or one each of several
        ports = {"ip4": ports[0], "ip6": ports[0]} if len(ports) == 1 else {}
    host = list(cfg.host_maddrs)
    reused = [_on_port(m, ports.get(m.split("/")[1] if "/" in m else "")) for m in host]
    if reused != host:
        try:
            check_listen_ports(reused)
            host = reused
        except PortTaken as exc:
            logger.warning("cannot listen where the run did before: %s", exc)
    peers = [m for maddrs in run_dir.get_meta("peers", {}).values() for m in maddrs if "/p2p/" in m]
    return host, [*cfg.initial_peers, *peers]


async def start_dht(cfg: CoordinatorConfig, run_dir: RunDir, identity: Identity, private: bool) -> hivemind.DHT:
    """The coordinator's DHT node, with the same libp2p id after a restart, keeping only
    the run's records that its rule takes (``RunRecords``: signed by the identity they
    name; in a private swarm, adverts certified by this coordinator)."""
    host_maddrs, initial_peers = addresses(cfg, run_dir)
    identity_path = run_dir.path / "p2p.key"
    if not identity_path.exists():
        P2P.generate_identity(str(identity_path))
    validators = [RunRecords(cfg.run_id, identity.public_hex, private=private)]
    try:
        return await dhtstart.started(
            lambda: dhtstart.start_dht(
                timeout=dhtstart.READY_S,
                initial_peers=initial_peers,
                host_maddrs=host_maddrs,
                announce_maddrs=cfg.announce_maddrs or None,
                identity_path=str(identity_path),
                record_validators=validators,
            ),
            dhtstart.READY_S,
        )
    except (dhtstart.DhtDied, dhtstart.DhtNotReady) as exc:
        raise SwarmError(f"could not start the coordinator's DHT node: {exc}") from None


def _on_port(maddr: str, port: int | None) -> str:
    """``maddr`` at ``port`` instead of any free one (``/tcp/0``)."""
    if not port or "/tcp/0/" not in maddr + "/":
        return maddr
    return (maddr + "/").replace("/tcp/0/", f"/tcp/{port}/", 1)[:-1]


def family_ports(maddrs: list[str]) -> dict[str, int]:
    """The TCP port per address family (``ip4``, ``ip6``) among listening multiaddrs."""
    out: dict[str, int] = {}
    for m in maddrs:
        parts = m.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdecimal():
            out.setdefault(parts[1], int(parts[4]))
    return out


def tcp_ports(maddrs: list[str]) -> list[int]:
    """The TCP ports among listening multiaddrs."""
    out = set()
    for m in maddrs:
        parts = m.split("/")
        if "tcp" in parts and parts.index("tcp") + 1 < len(parts):
            out.add(int(parts[parts.index("tcp") + 1]))
    return sorted(out)
