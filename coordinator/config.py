"""The coordinator's settings: one typed config, every default in one place."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from coordinator.defaults import DEFAULT_REBALANCE_EVERY
from protocol.model.job import JobSpec
from protocol.net.hostaddrs import LOOPBACK_MADDRS
from protocol.trust.admission import CERT_TTL_S
from protocol.trust.spot_rate import DEFAULT_SPOT_CHECK


@dataclass
class CoordinatorConfig:
    job: JobSpec
    run_id: str = "fusionllm"
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))  # the CLI: every interface
    announce_maddrs: list[str] = field(default_factory=list)  # what the join line names instead of host_maddrs
    data_path: str = "direct"  # "libp2p": every frame inside libp2p's streams (protocol.net.direct)
    initial_peers: list[str] = field(default_factory=list)
    min_peers: int = 1
    num_stages: int | None = None
    schedule: str = "1f1b"
    peer_wait_s: float = 120.0
    step_timeout_s: float = 300.0
    record_ttl: float = 10.0
    identity: str | None = None  # key file; None: a fresh key for this process only
    compression: str = "none"  # none, fp16, bf16, int8, int4 (every link), adatopk, auto or auto-lowrank (per link)
    topk_fraction: float | None = None  # pin AdaTopK's kept fraction on the links that need compressing
    lowrank_rank: int | None = None  # pin auto-lowrank's rank on the links that get low-rank activations
    link_mbps: list[float] = field(default_factory=list)  # pace each stage boundary's link (loopback demos)
    status: bool = True  # serve the status page, /api/v1/state and /metrics
    status_host: str = "127.0.0.1"
    status_port: int | None = None  # None: 8470, or any free port if that is taken
    run_dir: str | None = None  # checkpoints and run metadata; None: a new folder in checkpoint.default_run_dir(run_id)
    resume: bool = False  # continue the run in run_dir from its last checkpoint
    checkpoint_every: int | None = None  # None: automatic (replan.checkpoint_due); 0: only the last step
    standby: int = 0  # the slowest N peers of the first plan wait as standby
    rebalance_every: int = DEFAULT_REBALANCE_EVERY  # steps between rebalance checks (0: never)
    stall_floor_s: float = 8.0  # a planned peer silent this long (or 10 median steps, if longer) has stalled
    send_timeout_s: float = 30.0  # a send to a peer that takes longer counts as a lost peer
    private: bool = False  # admit only peers whose hello proves the swarm's secret (coordinator.admission)
    cert_ttl: float = CERT_TTL_S  # a private swarm's admission certificates hold this long (renewed before)
    spot_check: float = DEFAULT_SPOT_CHECK  # each replicated micro-batch re-executed with this chance (auditing)
    stages_as: str = "program"  # STAGE_FORMS: how peers get their stages
    ask_links_s: float = 3.0  # the first plan's deciding guessed links probed within this (0: not asked)

    def job_fields(self) -> dict[str, Any]:
        """The job as it travels and is stored: JSON (a tuple of betas comes back a list)."""
        return json.loads(json.dumps(dataclasses.asdict(self.job)))
