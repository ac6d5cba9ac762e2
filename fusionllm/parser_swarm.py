"""The parsers of the swarm's commands: ``demo``, ``coordinator``, ``join``, ``token``
and ``ban``. No torch or hivemind here."""

from __future__ import annotations

import argparse

from coordinator.defaults import DEFAULT_REBALANCE_EVERY
from fusionllm import parser_types as t
from fusionllm.addresses import add_data_path_flag, add_listen_flags
from fusionllm.parser_job import add_threads_flag, add_training_job
from protocol.model.options import STAGE_FORMS
from protocol.net.hostaddrs import COORDINATOR_PORT, PEER_PORT
from protocol.trust.admission import CERT_TTL_S, RENEWALS_PER_TTL
from protocol.trust.spot_rate import DEFAULT_SPOT_CHECK

#: the id of a run that ``coordinator --run`` and ``join --run`` name by default
DEFAULT_RUN = "fusionllm"


def _add_identity_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--identity",
        default=default,
        metavar="PATH",
        help="Ed25519 key file, created (mode 0600) if missing",
    )


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline and compression")
    g.add_argument(
        "--stages", type=t.positive, default=None, metavar="K", help="pipeline stages (default: one per peer)"
    )
    g.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="the pipeline schedule")
    g.add_argument(
        "--compression",
        type=t.compression,
        default="none",
        help="codec on the stage boundaries: none, fp16, bf16, int8, int4 (every link); adatopk (links too slow "
        "for the compute get block-wise top-k, the kept fraction from their measured bandwidth); auto (slow links "
        "get the mildest codec that suffices, fp16 or int8, accuracy first); auto-lowrank (auto, then low-rank "
        "activations with 4-bit unbiased gradients: faster on the slowest links, at a measured cost in loss)",
    )
    g.add_argument(
        "--topk-fraction",
        type=t.fraction,
        default=None,
        metavar="F",
        help="pin AdaTopK's kept fraction, 0 < F <= 1 (default: from each link's bandwidth)",
    )
    g.add_argument(
        "--rank",
        type=t.rank,
        default=None,
        metavar="R",
        help="pin the rank of auto-lowrank's low-rank activations on slow links, R >= 1 (default: from each link)",
    )
    g.add_argument(
        "--link-mbps",
        type=t.rates,
        default=[],
        metavar="R1,R2,...",
        help="pace the sends across each stage boundary to this many Mbit/s (0: unpaced), e.g. 1000,1000,20 "
        "(default: unpaced)",
    )
    g.add_argument(
        "--stages-as",
        choices=STAGE_FORMS,
        default="program",
        help="send stages to peers as programs of ATen operators (peers import no model code; a model "
        "that does not trace to them falls back to code) or as the model's code (peers need --allow-code for a "
        "model that is not built in)",
    )


def _add_fault_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers, faults and checkpoints")
    g.add_argument("--peer-wait", type=t.seconds, default=120.0, metavar="S", help="seconds to wait for peers")
    g.add_argument(
        "--step-timeout", type=t.seconds, default=300.0, metavar="S", help="seconds without progress before giving up"
    )
    g.add_argument("--standby", type=t.natural, default=0, metavar="N", help="keep the N slowest peers as standby")
    g.add_argument(
        "--stall-timeout",
        type=t.seconds,
        default=8.0,
        metavar="S",
        help="a planned peer silent this long (or 10 median steps, if longer) counts as stalled",
    )
    g.add_argument(
        "--rebalance-every",
        type=t.natural,
        default=None,
        metavar="N",
        help="every N steps, re-plan on the peers' measured speeds and move when it pays off; 0: never "
        f"(default: {DEFAULT_REBALANCE_EVERY})",
    )
    g.add_argument(
        "--spot-check",
        type=t.chance,
        default=DEFAULT_SPOT_CHECK,
        metavar="P",
        help="re-execute each micro-batch of a replicated stage on another replica with chance P, and exclude "
        "a peer whose signed work differs (0: off)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=t.natural,
        default=None,
        metavar="N",
        help="checkpoint every stage's weights and optimizer state every N steps (0: only at the end; default: "
        "automatic, so that checkpoints cost about 2%% of the training time)",
    )
    g.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where checkpoints and the run's metadata go (default: a new folder in ~/.fusionllm/runs/RUN/; demo: "
        "in its log folder)",
    )


def _add_status_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("status page")
    g.add_argument("--status-host", default="127.0.0.1", metavar="ADDR", help="address of the status page")
    g.add_argument(
        "--status-port",
        type=t.port,
        default=None,
        metavar="PORT",
        help="port of the status page (default: 8470, or any free port if taken; 0: any free port)",
    )


def _add_swarm_flags(p: argparse.ArgumentParser) -> None:
    """What a coordinator runs by: demo and coordinator."""
    _add_pipeline_flags(p)
    _add_fault_flags(p)
    _add_status_flags(p)
    _add_identity_flag(p, "~/.fusionllm/coordinator.key")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a local swarm: a coordinator and N peer processes on loopback")
    p.add_argument("--peers", type=t.positive, default=4, metavar="N", help="number of peer processes")
    add_data_path_flag(p)
    add_training_job(p, save_default="fusionllm-demo.safetensors")
    _add_swarm_flags(p)


def _add_private_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("private swarm")
    g.add_argument(
        "--private",
        action="store_true",
        help="admit only peers joined with the token it prints (the secret stays in the run "
        "directory; 'fusionllm token --rotate' makes a new one, 'fusionllm ban' drops a peer)",
    )
    g.add_argument(
        "--cert-ttl",
        type=t.cert_ttl,
        default=CERT_TTL_S,
        metavar="SECONDS",
        help="a private swarm's admission certificates hold this long, renewed "
        f"{RENEWALS_PER_TTL} times in it: a banned peer is refused everywhere within it (default: {CERT_TTL_S:.0f})",
    )


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="host a swarm run: DHT, stage assignment, training driver")
    g = p.add_argument_group("the run and its network")
    g.add_argument("--run", default=DEFAULT_RUN, help="run id (peers join with the same)")
    g.add_argument("--min-peers", type=t.positive, default=2, metavar="N", help="peers to wait for before training")
    add_listen_flags(
        g,
        t.port,
        f"TCP port to listen on, every interface, IPv4 and IPv6: other machines must reach it "
        f"(default: {COORDINATOR_PORT}; 0: any free port)",
    )
    g.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="join an existing DHT (default: start one)"
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint, with the same flags as its first start "
        "(default: a new run)",
    )
    add_training_job(p)
    _add_swarm_flags(p)
    _add_private_flags(p)


def _add_join(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help="lend this machine to a swarm")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="where to join, as the coordinator prints it (default: none; required without --token)",
    )
    p.add_argument(
        "--token", default=None, help="a private swarm's join token, as its coordinator prints it (default: none)"
    )
    add_listen_flags(
        p,
        t.port,
        f"TCP port to listen on, every interface, IPv4 and IPv6 (default: {PEER_PORT}, any free port, as "
        "several peers may run on one machine; fix one to forward it on your router)",
    )
    p.add_argument("--run", default=DEFAULT_RUN, help="the run to join")
    p.add_argument(
        "--coordinator-key",
        type=t.key_hex,
        default=None,
        metavar="HEX",
        help="the coordinator's public key, as its join command prints it: only it is trusted "
        "(default: the only coordinator of the run, trusted on first use)",
    )
    _add_join_code_flags(p)
    _add_join_compute_flags(p)
    _add_identity_flag(p, "~/.fusionllm/peer.key")


def _add_join_code_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what code it runs")
    g.add_argument(
        "--allow-code",
        action="append",
        default=[],
        metavar="MODULE",
        help="also run models from this module (pkg.mod or path/file.py; repeatable): their Python is "
        "imported here (default: only FusionLLM's built-in models)",
    )
    g.add_argument(
        "--allow-ops",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="also run stage programs that call operators of this torch.ops namespace (repeatable; "
        "default: aten only); its operators must be registered here, e.g. by --allow-code",
    )


def _add_join_compute_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("this machine")
    g.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
    add_threads_flag(g)
    g.add_argument(
        "--join-timeout", type=t.seconds, default=30.0, metavar="S", help="seconds to reach the DHT and coordinator"
    )
    g.add_argument(
        "--coordinator-grace",
        type=t.seconds,
        default=120.0,
        metavar="S",
        help="seconds to wait for a lost coordinator to come back before leaving",
    )
    g.add_argument(
        "--throttle",
        type=t.throttle,
        default=1.0,
        metavar="F",
        help="compute at the fraction F of this machine's speed (0 < F <= 1): idle after each compute call until "
        "it has lasted 1/F times its work (its CPU time on one CPU thread, else its duration), and advertise F "
        "times the measured FLOP/s; to try out rebalancing",
    )
    g.add_argument(
        "--throttle-call-ms",
        type=t.call_ms,
        default=0.0,
        metavar="MS",
        help="with --throttle, leave the first MS milliseconds of each compute call's work unstretched: its own "
        "fixed work (Python, the stage's graph), as on a device slower at its FLOPs whose host is not "
        "(0 to 1000; default: 0, all of it stretched; the testbed measures it)",
    )
    g.add_argument(
        "--throttle-file",
        default=None,
        metavar="PATH",
        help="while running, read the throttle F from this file about once a second (absent or bad: the last "
        "value stays; default: none)",
    )
    g.add_argument(
        "--advertise-flops",
        type=t.positive_float,
        default=None,
        metavar="X",
        help="advertise X FLOP/s instead of what this machine measured (the coordinator goes by the measured "
        "speed of each step after the first; to try out that it does; default: the measured speed)",
    )


def _add_token_and_ban(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="print a private swarm's join token (--rotate: with a new secret)")
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the coordinator's run directory")
    p.add_argument("--rotate", action="store_true", help="new secret: older tokens admit no new peers")
    p = sub.add_parser("ban", help="drop peers from a run and refuse them from now on")
    p.add_argument("peers", nargs="+", metavar="PEER_ID", help="peer ids or public keys")
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the coordinator's run directory")


def add_swarm_commands(sub: argparse._SubParsersAction) -> None:
    _add_demo(sub)
    _add_coordinator(sub)
    _add_join(sub)
    _add_token_and_ban(sub)
