"""The ``fusionllm`` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from coordinator.plan_options import (
    DEFAULT_PRECISION,
    POLICIES,
    SCHEDULERS,
    TOKENS_PER_ITERATION,
    WORKLOADS,
    defaults_text,
)
from fusionllm.addresses import add_listen_flags
from fusionllm.data_cli import add_data_parser
from fusionllm.usage import EXIT_INTERRUPTED, EXIT_USAGE, EXPORT_FORMATS, UsageError, positive_int
from protocol.model.options import PRECISIONS, SCHEDULES, STAGE_FORMS, RecipeError, parse_betas
from protocol.net.hostaddrs import COORDINATOR_PORT, PEER_PORT
from protocol.trust.admission import CERT_TTL_S, MAX_CERT_TTL_S, MIN_CERT_TTL_S, RENEWALS_PER_TTL
from protocol.trust.spot_rate import DEFAULT_SPOT_CHECK
from sim.presets import PRESETS

#: the module that holds each command's ``cmd_<name>``: imported only once the arguments
#: parsed, as the commands import torch (seconds) and a usage error or --help needs none
COMMANDS = {
    **dict.fromkeys(("demo", "coordinator", "join", "token", "ban"), "fusionllm.swarm_cmds"),
    **dict.fromkeys(("plan", "sim"), "fusionllm.plan_cmds"),
    **dict.fromkeys(("train", "inspect", "compare", "status"), "fusionllm.commands"),
    "export": "fusionllm.export_cmds",
    "data": "fusionllm.data_cmds",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"fusionllm: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


_positive = positive_int


def _cert_ttl(text: str) -> int:
    low, high = int(MIN_CERT_TTL_S), int(MAX_CERT_TTL_S)
    return _whole(text, low, high, "a whole number of seconds", f"between {low} and {high} seconds")


def _add_job_flags(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        default="gpt",
        help="built-in name (gpt, gpt2, branchy) or MODULE:FUNC / file.py:FUNC; in plan and sim, "
        f"{', '.join(WORKLOADS)} are published model shapes traced without weights (--model-args changes them, "
        "e.g. n_layer=4)",
    )
    g.add_argument("--model-args", default="", help="keyword arguments for the model factory, k=v,k=v")
    g.add_argument("--data", default=None, help="built-in name (stdlib, branchy) or MODULE:FUNC called with the seed")
    g.add_argument("--data-args", default="", help="keyword arguments for the data factory, k=v,k=v")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--steps", type=_positive, default=steps)
    g.add_argument("--micro-batches", type=_positive, default=4)
    g.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (default: 3e-3)")
    g.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default="constant",
        help="after the warm-up: hold the rate, or bring it to --min-lr by the last step",
    )
    g.add_argument("--warmup", type=_natural, default=0, metavar="STEPS", help="linear warm-up steps (default: 0)")
    g.add_argument("--min-lr", type=_non_negative_float, default=0.0, help="the rate at the last step (default: 0)")
    g.add_argument(
        "--weight-decay",
        type=_non_negative_float,
        default=0.0,
        help="decoupled (AdamW) weight decay, not on biases and norms (default: 0)",
    )
    g.add_argument("--weight-decay-all", action="store_true", help="decay biases and norms too")
    g.add_argument("--betas", type=_betas, default=(0.9, 0.999), metavar="B1,B2", help="AdamW's (default: 0.9,0.999)")
    g.add_argument(
        "--clip-grad-norm",
        type=_non_negative_float,
        default=0.0,
        metavar="X",
        help="clip the gradient norm over every stage's parameters to X (default: 0, off)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="autocast precision; weights and optimizer state stay fp32; fp16 scales the loss",
    )
    g.add_argument(
        "--init",
        default=None,
        metavar="PATH.safetensors",
        help="start from these weights (the model's names, or GPT-2's layout for gpt2)",
    )
    g.add_argument(
        "--eval-every",
        type=_natural,
        default=0,
        metavar="N",
        help="validation loss every N steps and after the last (default: 0, never)",
    )
    g.add_argument(
        "--eval-batches", type=_positive, default=4, metavar="N", help="validation batches per evaluation (default: 4)"
    )
    g.add_argument("--save", default=None, metavar="PATH.safetensors", help="write the trained model here")


def _add_swarm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_positive, default=None, help="pipeline stages (default: one per peer)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--run", default="fusionllm", help="run id (peers join with the same)")
    p.add_argument("--peer-wait", type=float, default=120.0, help="seconds to wait for peers")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds without progress before giving up")
    p.add_argument(
        "--compression",
        type=_compression,
        default="none",
        help="codec on the stage boundaries: none, fp16, bf16, int8, int4 (every link); adatopk (links too slow "
        "for the compute get block-wise top-k, the kept fraction from their measured bandwidth); auto (slow links "
        "get the mildest codec that suffices: fp16, int8, or low-rank activations with 4-bit unbiased gradients)",
    )
    p.add_argument("--status-host", default="127.0.0.1", help="address of the status page (default: 127.0.0.1)")
    p.add_argument(
        "--status-port",
        type=_port,
        default=None,
        help="port of the status page (default: 8470, or any free port if taken; 0: any free port)",
    )
    p.add_argument("--topk-fraction", type=_fraction, default=None, help="pin AdaTopK's kept fraction (0 < F <= 1)")
    p.add_argument(
        "--rank", type=_rank, default=None, help="pin the rank of auto's low-rank activations on slow links (R >= 1)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=_natural,
        default=None,
        metavar="N",
        help="checkpoint every stage's weights and optimizer state every N steps (0: only at the end; default: "
        "automatic, so that checkpoints cost about 2%% of the training time)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where checkpoints and the run's metadata go (default: a new folder in ~/.fusionllm/runs/RUN/; demo: "
        "in its log folder)",
    )
    p.add_argument(
        "--spot-check",
        type=_chance,
        default=DEFAULT_SPOT_CHECK,
        metavar="P",
        help="re-execute each micro-batch of a replicated stage on another replica with chance P, and exclude "
        f"a peer whose signed work differs (0: off; default: {DEFAULT_SPOT_CHECK})",
    )
    p.add_argument(
        "--stages-as",
        choices=STAGE_FORMS,
        default="program",
        help="send stages to peers as programs of ATen operators (default; peers import no model code; a model "
        "that does not trace to them falls back to code) or as the model's code (peers need --allow-code for a "
        "model that is not built in)",
    )
    p.add_argument("--standby", type=_natural, default=0, metavar="N", help="keep the N slowest peers as standby")
    p.add_argument(
        "--rebalance-every",
        type=_natural,
        default=None,
        metavar="N",
        help="every N steps, re-plan on the peers' measured speeds and move when it pays off (e.g. 25; default: 0, "
        "never)",
    )
    p.add_argument(
        "--stall-timeout",
        type=_seconds,
        default=8.0,
        metavar="S",
        help="a planned peer silent this long (or 10 median steps, if longer) counts as stalled (default: 8)",
    )
    p.add_argument(
        "--link-mbps",
        type=_rates,
        default=[],
        metavar="R1,R2,...",
        help="pace the sends across each stage boundary to this many Mbit/s (0: unpaced), e.g. 1000,1000,20",
    )


def _whole(text: str, low: int, high: int, what: str, bounds: str) -> int:
    """``text`` as an integer in [low, high]; ``what`` names it, ``bounds`` the range."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not {bounds}")
    return value


def _positive_float(
    text: str, what: str = "a number", bounds: str = "a positive, finite number", zero: bool = False
) -> float:
    """A finite number above 0 (or ``zero``: at least 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if not (0.0 <= value if zero else 0.0 < value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not {bounds}")
    return value


def _natural(text: str) -> int:
    return _whole(text, 0, 1 << 40, "a whole number", "at least 0")


def _non_negative_float(text: str) -> float:
    return _positive_float(text, bounds="a non-negative, finite number", zero=True)


def _key_hex(text: str) -> str:
    from protocol.trust.identity import IdentityError, key_hex, public_key

    try:
        return key_hex(public_key(text.strip()))
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(f"'{text[:80]}' is not an Ed25519 public key in hex: {exc}") from None


def _betas(text: str) -> tuple[float, float]:
    try:
        return parse_betas(text)
    except RecipeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    return _positive_float(text, "a number of seconds", "a positive number of seconds")


def _port(text: str) -> int:
    return _whole(text, 0, 65535, "a port number", "a port (0-65535)")


def _compression(text: str) -> str:
    modes = ("none", "fp16", "bf16", "int8", "int4", "adatopk", "auto")
    if text not in modes:
        raise argparse.ArgumentTypeError(f"'{text}' is not one of {', '.join(modes)}")
    return text


def _chance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a chance in [0, 1]")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _throttle(text: str) -> float:
    from peer.throttle import ThrottleError, parse_throttle

    try:
        return parse_throttle(text)
    except ThrottleError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rank(text: str) -> int:
    return _whole(text, 1, 65536, "a whole number", "in [1, 65536]")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of Mbit/s") from None
    if any(not r >= 0 or r == float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"'{text}': rates must be finite and at least 0")
    return rates


def _add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_natural,
        default=0,
        help="torch CPU threads (default: torch's choice); a swarm's demo peers use 1, and a reference "
        "trained with the same count gives bitwise the same weights",
    )


def _add_identity_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--identity",
        default=default,
        metavar="PATH",
        help=f"Ed25519 key file, created (mode 0600) if missing (default: {default})",
    )


_WORKLOADS_EPILOG = (
    "Built-in workloads (--model): "
    + "; ".join(f"{w.name}: {w.summary}" for w in WORKLOADS.values())
    + f". Default batches, M micro-batches x B sequences x S tokens ({TOKENS_PER_ITERATION:,} tokens per "
    + f"iteration): {defaults_text()}."
)


def _add_batch_flags(p: argparse.ArgumentParser) -> None:
    """plan and sim: the batch of one iteration, and the precision the plan models."""
    g = p.add_argument_group("batch (one iteration: M micro-batches of B sequences of S tokens)")
    g.add_argument(
        "--micro-batches",
        type=_positive,
        default=None,
        metavar="M",
        help=f"micro-batches per iteration (default: {defaults_text()}; other models: 4)",
    )
    g.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        metavar="B",
        help="sequences per micro-batch, built-in workloads only (default: as above)",
    )
    g.add_argument(
        "--seq-len",
        type=_positive,
        default=None,
        metavar="S",
        help="tokens per sequence, built-in workloads only (default: the model's context, as above)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="the training precision the plan models: the activations' dtype; weights, gradients and Adam's "
        f"moments stay fp32, 16 bytes per parameter (default: {DEFAULT_PRECISION} for the built-in workloads, as "
        "the presets' GPU speeds are mixed-precision; fp32 otherwise)",
    )


def _schedulers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(repr(b) for b in bad) or '(none)'}; choose from {', '.join(SCHEDULERS)}"
        )
    return list(dict.fromkeys(names))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's weights as another library's model (GPT-2 for Hugging Face)")
    p.add_argument("run", metavar="RUN.safetensors", help="the run's weights, as --save writes them")
    p.add_argument("dir", metavar="DIR", help="the folder to write (absent or empty, unless --force)")
    p.add_argument(
        "--to",
        choices=EXPORT_FORMATS,
        required=True,
        help="gpt2-hf: config.json and model.safetensors that transformers loads as GPT2LMHeadModel",
    )
    p.add_argument("--model", default="gpt2", help="the run's --model (default: gpt2)")
    p.add_argument("--model-args", default="", help="the run's --model-args, k=v,k=v")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fusionllm", description="Decentralized training of LLMs on volunteers' GPUs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)

    p = sub.add_parser("demo", help="a local swarm: a coordinator and N peer processes on loopback")
    _add_job_flags(p, steps=1200)
    _add_swarm_flags(p)
    p.add_argument("--peers", type=_positive, default=4, help="number of peer processes")
    _add_identity_flag(p, "~/.fusionllm/coordinator.key")

    p = sub.add_parser("coordinator", help="host a swarm run: DHT, stage assignment, training driver")
    _add_job_flags(p, steps=100)
    _add_swarm_flags(p)
    add_listen_flags(
        p,
        _port,
        f"TCP port to listen on, every interface, IPv4 and IPv6: other machines must reach it "
        f"(default: {COORDINATOR_PORT}; 0: any free port)",
    )
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="join an existing DHT")
    p.add_argument("--min-peers", type=_positive, default=2, help="peers to wait for before training")
    p.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint (with the same flags as its first start)",
    )
    p.add_argument(
        "--private",
        action="store_true",
        help="admit only peers joined with the token it prints (the secret stays in the run "
        "directory; 'fusionllm token --rotate' makes a new one, 'fusionllm ban' drops a peer)",
    )
    p.add_argument(
        "--cert-ttl",
        type=_cert_ttl,
        default=CERT_TTL_S,
        metavar="SECONDS",
        help="a private swarm's admission certificates hold this long, renewed "
        f"{RENEWALS_PER_TTL} times in it: a banned peer is refused everywhere within it "
        f"(default {CERT_TTL_S:.0f})",
    )
    _add_identity_flag(p, "~/.fusionllm/coordinator.key")

    p = sub.add_parser("token", help="print a private swarm's join token (--rotate: with a new secret)")
    p.add_argument("--run-dir", required=True, help="the coordinator's run directory")
    p.add_argument("--rotate", action="store_true", help="new secret: older tokens admit no new peers")
    p = sub.add_parser("ban", help="drop peers from a run and refuse them from now on")
    p.add_argument("peers", nargs="+", metavar="PEER_ID")
    p.add_argument("--run-dir", required=True, help="the coordinator's run directory")

    p = sub.add_parser("join", help="lend this machine to a swarm")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR")
    p.add_argument("--token", default=None, help="a private swarm's join token, as its coordinator prints it")
    add_listen_flags(
        p,
        _port,
        f"TCP port to listen on, every interface, IPv4 and IPv6 (default: {PEER_PORT}, any free port, as "
        "several peers may run on one machine; fix one to forward it on your router)",
    )
    p.add_argument("--run", default="fusionllm", help="the run to join")
    p.add_argument(
        "--allow-code",
        action="append",
        default=[],
        metavar="MODULE",
        help="also run models from this module (pkg.mod or path/file.py; repeatable): their Python is "
        "imported here (default: only FusionLLM's built-in models)",
    )
    p.add_argument(
        "--allow-ops",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="also run stage programs that call operators of this torch.ops namespace (repeatable; "
        "default: aten only); its operators must be registered here, e.g. by --allow-code",
    )
    p.add_argument(
        "--coordinator-key",
        type=_key_hex,
        default=None,
        metavar="HEX",
        help="the coordinator's public key, as its join command prints it: only it is trusted "
        "(without it: the only coordinator of the run, trusted on first use)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
    _add_threads_flag(p)
    p.add_argument("--join-timeout", type=float, default=30.0, help="seconds to reach the DHT and coordinator")
    p.add_argument(
        "--coordinator-grace",
        type=_seconds,
        default=120.0,
        metavar="S",
        help="seconds to wait for a lost coordinator to come back before leaving (default: 120)",
    )
    p.add_argument(
        "--throttle",
        type=_throttle,
        default=1.0,
        metavar="F",
        help="compute at the fraction F of this machine's speed (0 < F <= 1): idle after each compute call for "
        "1/F - 1 times its duration, and advertise F times the measured FLOP/s; to try out rebalancing (default: 1)",
    )
    p.add_argument(
        "--throttle-file",
        default=None,
        metavar="PATH",
        help="while running, read the throttle F from this file about once a second (absent or bad: the last "
        "value stays)",
    )
    p.add_argument(
        "--advertise-flops",
        type=_positive_float,
        default=None,
        metavar="X",
        help="advertise X FLOP/s instead of what this machine measured (the coordinator goes by the measured "
        "speed of each step after the first; to try out that it does)",
    )
    _add_identity_flag(p, "~/.fusionllm/peer.key")

    for name, helptext in (
        ("plan", "dry-run the scheduler on a topology: stages, peers, predicted times, codecs"),
        ("sim", "simulate schedulers on a topology (seeded; churn optional)"),
    ):
        # "resolve": the batch flags below replace the job flags' --micro-batches and --precision
        p = sub.add_parser(name, help=helptext, conflict_handler="resolve", epilog=_WORKLOADS_EPILOG)
        _add_job_flags(p, steps=1)
        _add_batch_flags(p)
        p.add_argument("--topology", required=True, help=f"topology JSON file or preset ({', '.join(PRESETS)})")
        p.add_argument("--stages", type=_positive, default=None, help="force the number of stages")
        p.add_argument("--max-stages", type=_positive, default=32)
        p.add_argument(
            "--compression",
            choices=["auto", "none"],
            default="auto",
            help="auto: slow links get the codec the live swarm's auto mode would give them (fp16, "
            "int8, low rank with int4 gradients), or none where that reaches the loss sooner (each "
            "codec's measured steps factor); none: no codec (default: auto)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "plan":
            p.add_argument("--scheduler", choices=SCHEDULERS, default="opfence")
        else:
            p.add_argument(
                "--schedulers",
                type=_schedulers,
                default=",".join(SCHEDULERS),
                help=f"comma-separated, from {', '.join(SCHEDULERS)} (default: all)",
            )
            p.add_argument("--iterations", type=_positive, default=20)
            p.add_argument("--churn", type=_natural, default=0, metavar="N", help="N seeded joins, leaves, slow-downs")
            p.add_argument(
                "--policy",
                choices=POLICIES,
                default="rebalance",
                help="what the swarm does about churn: rebalance (the live coordinator's rules), none (recover from "
                "losses only) or restart (restart from the last checkpoint on every change)",
            )
            p.add_argument("--plot", default=None, metavar="OUT.png", help="plot iteration times")

    p = sub.add_parser("status", help="print a coordinator's status page in the terminal")
    p.add_argument(
        "--coordinator",
        default="http://127.0.0.1:8470",
        metavar="URL",
        help="the status page's address, as demo and coordinator print it (default: http://127.0.0.1:8470)",
    )
    p.add_argument("--json", action="store_true", help="print the raw /api/v1/state JSON")

    p = sub.add_parser("train", help="train in one process: the whole model or its stages")
    _add_job_flags(p, steps=10)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--reference", action="store_true", help="train the whole model")
    mode.add_argument("--stages", type=_positive, help="train through K rebuilt stages")
    _add_threads_flag(p)
    p.add_argument("--cut", default=None, help="explicit stage boundaries (op indices), e.g. 10,40")

    p = sub.add_parser("inspect", help="print the OP-DAG and a K-stage cut, and check it")
    _add_job_flags(p, steps=1)
    p.add_argument("--stages", type=_positive, default=2)
    p.add_argument("--cut", default=None, help="explicit stage boundaries (op indices), e.g. 10,40")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("compare", help="largest relative difference between two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-5)
    _add_export(sub)
    add_data_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # hivemind logs its own INFO lines (identity files, bootstrap) through its own handler
        logging.getLogger("hivemind").setLevel(logging.WARNING)
    # these import torch: only now that the arguments parsed
    handler = getattr(importlib.import_module(COMMANDS[args.command]), f"cmd_{args.command}")
    from protocol.model.graph import CutError, TraceFailure
    from protocol.model.job import ModelError, SpecError

    try:
        return int(handler(args) or 0)
    except (UsageError, SpecError, CutError, TraceFailure) as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelError as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fusionllm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> NoReturn:
    sys.exit(main())
