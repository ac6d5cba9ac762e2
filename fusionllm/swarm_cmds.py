"""``fusionllm coordinator``, ``join`` and ``demo``: the swarm from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tqdm import tqdm

from fusionllm.addresses import check_maddrs, listen_options, reach_lines, status_lines
from fusionllm.launcher import Launcher, Started
from fusionllm.running import run_async
from fusionllm.usage import EXIT_INTERRUPTED, UsageError, job_from_args
from protocol.model.job import foreign_code
from protocol.net.hostaddrs import COORDINATOR_PORT, LOOPBACK_MADDRS, PEER_PORT
from protocol.trust.admission import CERT_TTL_S
from protocol.trust.text import clean

logger = logging.getLogger(__name__)


def _check_cost(overhead: float | None) -> str:
    if overhead is None:
        return ""
    return f"; steps {overhead:+.1%} on average against those with no check under way"


def _summary(summary: Any, save: str | None) -> str:
    k = min(10, len(summary.losses))
    first, last = sum(summary.losses[:k]) / k, sum(summary.losses[-k:]) / k
    lines = [
        f"loss {first:.4f} -> {last:.4f} (mean of the first and last {k} steps) over {len(summary.losses)} steps "
        f"in {summary.seconds:.0f} s, {summary.tokens / max(summary.seconds, 1e-9):,.0f} tokens/s",
        f"cut {summary.assignment.cut.to_list()}",
        f"{len(summary.checkpoint_s)} checkpoints, {summary.epochs} plan epochs, {summary.failures} peers lost, "
        f"{summary.steps_redone} steps redone, {len(summary.rebalances)} rebalances (checks that planned: "
        f"{summary.checks_planned}, for {summary.check_planning_s:.1f} s beside the steps), "
        f"{summary.spot_checks} spot checks "
        f"({summary.audit_share:.1%} of the peers' training compute; commits waited "
        f"{summary.audit_wait_s:.1f} s for them{_check_cost(summary.check_overhead)})",
    ]
    lines += [f"validation loss after step {steps}: {loss:.6f}" for steps, loss in summary.val_losses]
    for s, group in enumerate(summary.assignment.stages):
        for r, p in enumerate(group):
            ad = summary.adverts[p]
            lines.append(
                f"  stage {s} replica {r}: peer {p} ({ad.device}, {ad.flops / 1e9:.1f} GFLOP/s, "
                f"up {ad.up_mbps:.0f} Mbit/s, {summary.connections.get(p, 'direct')})"
            )
    if summary.forwarded_bytes:
        lines.append(f"  forwarded {summary.forwarded_bytes / 1e6:.2f} MB between peers behind NATs")
    for link in summary.links:
        lines.append(
            f"  boundary {link.boundary} (stage {link.boundary} <-> {link.boundary + 1}, {link.mbps:.0f} Mbit/s "
            f"measured): {link.codec}, {link.wire_bytes / 1e6:.2f} MB on the wire for {link.raw_bytes / 1e6:.2f} MB "
            f"of tensors, ratio {link.ratio:.1f}x"
        )
    est = summary.estimate
    if est:
        lines.append(
            f"estimator: predicted {est['predicted_step_s'] * 1e3:.1f} ms per step, measured "
            f"{est['measured_step_s'] * 1e3:.1f} ms (median); per micro-batch, stage by stage, predicted/measured: "
            + ", ".join(f"{s['predicted_ms']:.2f}/{s['measured_ms']:.2f} ms" for s in est["stages"])
        )
        if est.get("repriced_at_step") is not None:
            lines.append(
                f"estimator: that prediction is the plan's price at step {est['repriced_at_step']} on the speeds and "
                f"fixed costs the swarm measured (a rebalance check that kept it); on the peers' start-up readings "
                f"it was "
                f"{est['planned_step_s'] * 1e3:.1f} ms"
            )
        if est.get("delivered_step_s"):
            again, measured = est["delivered_step_s"], est["measured_step_s"]
            lines.append(
                f"estimator: for the compute the peers delivered, predicted {again * 1e3:.1f} ms per step, "
                f"measured {measured * 1e3:.1f} ms ({again / measured - 1:+.0%})"
            )
        if est.get("breakdown"):
            from coordinator.breakdown import breakdown_lines

            mean = est["mean_step_s"] * 1e3
            lines.append(
                "where the step time goes, stage by stage (mean ms per step; the coordinator's over the same "
                f"steps: {mean:.1f}):"
            )
            lines += breakdown_lines(est["breakdown"])
    if save:
        lines.append(f"saved {save}")
    return "\n".join(lines)


def _recovery_options(args: argparse.Namespace) -> dict[str, Any]:
    """The coordinator's checkpoint, resume and failure-detection settings from the flags."""
    resume = getattr(args, "resume", None)
    if resume and args.run_dir and Path(resume).expanduser() != Path(args.run_dir).expanduser():
        raise UsageError(f"--resume {resume} and --run-dir {args.run_dir} name different run directories")
    return {
        "run_dir": resume or args.run_dir,
        "resume": bool(resume),
        "checkpoint_every": args.checkpoint_every,
        "standby": args.standby,
        **({} if args.rebalance_every is None else {"rebalance_every": args.rebalance_every}),
        "stall_floor_s": args.stall_timeout,
    }


def _check_init(path: str | None, model: Any) -> None:
    """Refuse ``--init`` weights that do not fit before any process or socket starts."""
    from coordinator.weights import InitError, read_init

    if path:
        try:
            read_init(path, model)
        except InitError as exc:
            raise UsageError(str(exc)) from None


def _check_codec_flags(args: argparse.Namespace) -> None:
    """A codec's pin given without its mode would be ignored: refused instead."""
    if args.rank is not None and args.compression != "auto-lowrank":
        raise UsageError("--rank pins the low rank of --compression auto-lowrank; give that mode too")
    if args.topk_fraction is not None and args.compression != "adatopk":
        raise UsageError("--topk-fraction pins the kept fraction of --compression adatopk; give that mode too")


async def _coordinate(args: argparse.Namespace, on_ready: Any = None) -> int:
    from coordinator.config import CoordinatorConfig
    from coordinator.outcome import SwarmError
    from coordinator.swarm import Coordinator

    _check_codec_flags(args)
    job = job_from_args(args)
    model = job.checked_model()  # fails early on a bad model or data
    _check_init(job.init, model)
    cfg = CoordinatorConfig(
        job=job,
        run_id=args.run,
        host_maddrs=args.host_maddrs,
        announce_maddrs=args.announce,
        data_path=args.data_path,
        initial_peers=args.initial_peers,
        min_peers=args.min_peers,
        num_stages=args.stages,
        schedule=args.schedule,
        peer_wait_s=args.peer_wait,
        step_timeout_s=args.step_timeout,
        identity=os.path.expanduser(args.identity),
        compression=args.compression,
        topk_fraction=args.topk_fraction,
        lowrank_rank=args.rank,
        link_mbps=args.link_mbps,
        status_host=args.status_host,
        status_port=args.status_port,
        private=getattr(args, "private", False),
        cert_ttl=getattr(args, "cert_ttl", CERT_TTL_S),
        spot_check=args.spot_check,
        stages_as=args.stages_as,
        **_recovery_options(args),
    )
    if args.stages and args.link_mbps and len(args.link_mbps) != args.stages - 1:
        raise UsageError(f"--link-mbps gives {len(args.link_mbps)} rates for {args.stages - 1} stage boundaries")
    coord = Coordinator(cfg)
    try:
        await coord.start()
    except SwarmError as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        await coord.aclose()
        return 2
    bar: tqdm | None = None
    try:
        print(f"coordinator is up; volunteers join with:\n  {coord.join_command()}", flush=True)
        _print_reach(coord)
        code = foreign_code(cfg.job.model)
        if code:
            print(
                f"the model is code from '{code}': volunteers get its stages as programs of ATen operators and "
                f"import nothing (a model that does not trace to them needs volunteers with --allow-code {code})",
                flush=True,
            )
        if coord.status is not None:
            print("\n".join(status_lines(coord.status.url, coord.join_addrs)), flush=True)
        if coord.run_dir is not None:
            print(f"run directory: {coord.run_dir.path} (after a crash: --resume {coord.run_dir.path})", flush=True)
        if on_ready is not None:
            await on_ready(coord)

        def on_peers(n: int) -> None:
            print(f"{n} of {cfg.min_peers} peers have joined", flush=True)

        def on_step(rep: Any) -> None:
            nonlocal bar
            if bar is None:
                bar = tqdm(
                    total=job.steps,
                    desc="train",
                    unit="step",
                    dynamic_ncols=True,
                    mininterval=0.2 if sys.stderr.isatty() else 5.0,
                )
            bar.set_postfix(loss=f"{rep.loss:.4f}", tok_s=f"{rep.tokens / max(rep.seconds, 1e-9):,.0f}")
            bar.update(rep.step + 1 - bar.n)  # back after a rollback

        def on_event(text: str) -> None:
            line = f"{time.strftime('%H:%M:%S')} {clean(text)}"
            if bar is not None:
                tqdm.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
            sys.stdout.flush()

        try:
            summary = await coord.run(model, on_step, on_peers, on_event)
        except SwarmError as exc:
            if bar is not None:
                bar.close()
            logger.error("%s", exc)
            print(f"fusionllm: run failed: {exc}", file=sys.stderr)
            return 1
        if bar is not None:
            bar.close()
        if args.save:
            model.load_state_dict(summary.state, strict=False)
            state = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
            save_file(state, args.save)
        print(_summary(summary, args.save), flush=True)
        return 0
    finally:
        await coord.aclose()


def _print_reach(coord: Any) -> None:
    """The port other machines must reach, or that the join line works here only."""
    cfg = coord.config
    for line in reach_lines(coord.join_addrs, coord.listen_ports(), bool(cfg.announce_maddrs), cfg.host_maddrs):
        print(line, flush=True)


def cmd_coordinator(args: argparse.Namespace) -> int:
    check_maddrs(args.initial_peers, "--initial-peers")
    args.host_maddrs, args.announce = listen_options(args, COORDINATOR_PORT)
    return run_async(_coordinate(args))


async def _join(args: argparse.Namespace) -> int:
    from peer.config import JoinError, PeerConfig
    from peer.node import PeerNode

    node = PeerNode(
        PeerConfig(
            initial_peers=args.initial_peers,
            run_id=args.run,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce,
            data_path=args.data_path,
            device=args.device,
            join_timeout=args.join_timeout,
            identity=os.path.expanduser(args.identity),
            coordinator_grace=args.coordinator_grace,
            throttle=args.throttle,
            advertise_flops=args.advertise_flops,
            coordinator_key=args.coordinator_key,
            allow_code=list(args.allow_code),
            allow_ops=list(args.allow_ops),
            swarm_secret=args.swarm_secret,
            throttle_file=os.path.expanduser(args.throttle_file) if args.throttle_file else None,
            throttle_call_s=args.throttle_call_ms / 1e3,
        )
    )
    node.on_event = lambda text: print(f"{time.strftime('%H:%M:%S')} {clean(text)}", flush=True)
    try:
        await node.start()
        f = node.throttle.value
        throttled = f" (throttled to {f:g} of its speed)" if f < 1 else ""
        print(
            f"joined run '{args.run}' as {node.advert.peer_id}: {node.advert.device}, "
            f"{node.advert.flops / 1e9:.1f} GFLOP/s{throttled}; coordinator key {node.coordinator_fingerprint}; "
            "waiting for a stage",
            flush=True,
        )
        return await node.serve()
    except JoinError as exc:
        print(f"fusionllm: error: {exc}", file=sys.stderr)
        return 2
    except asyncio.TimeoutError:
        print("fusionllm: error: timed out waiting for the coordinator", file=sys.stderr)
        return 1
    finally:
        await node.aclose()


def cmd_join(args: argparse.Namespace) -> int:
    from peer.bench import device_problem

    problem = device_problem(args.device) if args.device else None
    if problem:
        raise UsageError(problem)
    _apply_token(args)
    check_maddrs(args.initial_peers, "--initial-peers")
    args.host_maddrs, args.announce = listen_options(args, PEER_PORT)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return run_async(_join(args))


def _apply_token(args: argparse.Namespace) -> None:
    """``--token`` (a private swarm's) sets where to join, the run, the pinned key and
    the secret; without it, ``--initial-peers`` is required."""
    from protocol.trust.admission import TokenError, parse_token

    args.swarm_secret = ""
    if args.token is None:
        if not args.initial_peers:
            raise UsageError("join needs --initial-peers (or a private swarm's --token)")
        return
    try:
        token = parse_token(args.token)
    except TokenError as exc:
        raise UsageError(f"--token: {exc}") from None
    if args.coordinator_key not in (None, token.coordinator_key) or args.run not in ("fusionllm", token.run):
        raise UsageError("--token names the run and its coordinator: leave out --run and --coordinator-key")
    args.initial_peers = args.initial_peers or token.maddrs
    args.run, args.coordinator_key, args.swarm_secret = token.run, token.coordinator_key, token.secret


def cmd_token(args: argparse.Namespace) -> int:
    """Print a private swarm's join token (after a new secret, with --rotate)."""
    from coordinator.admission import SECRET_FILE, AccessRules, write_secret
    from coordinator.checkpoint import DB_NAME, RunDir

    path = Path(args.run_dir).expanduser()
    if not (path / SECRET_FILE).is_file() or not (path / DB_NAME).is_file():
        raise UsageError(f"--run-dir {path}: no private swarm there (start the coordinator with --private)")
    run_dir = RunDir(path).open()
    try:
        join, run_id = run_dir.get_meta("join", None), run_dir.get_meta("run_id", None)
    finally:
        run_dir.close()
    if not isinstance(join, dict) or not isinstance(run_id, str):
        raise UsageError(f"--run-dir {path}: the coordinator has not started there yet")
    if args.rotate:
        write_secret(path)
    print(f"fusionllm join --token {AccessRules(path, run_id, True).token(join['key'], join['maddrs'])}")
    return 0


def cmd_ban(args: argparse.Namespace) -> int:
    """Ban peers from the run in a run directory (the coordinator drops them at once)."""
    from coordinator.admission import SECRET_FILE, ban
    from coordinator.checkpoint import DB_NAME

    path = Path(args.run_dir).expanduser()
    if not path.is_dir():
        raise UsageError(f"--run-dir {path}: no such directory")
    if not (path / DB_NAME).is_file():  # a ban list elsewhere bans no one, silently
        raise UsageError(f"--run-dir {path}: not a run directory (no {DB_NAME}); give the one the coordinator printed")
    ban(path, args.peers)
    print(f"banned {', '.join(args.peers)} from the run in {path}")
    if (path / SECRET_FILE).is_file():
        print(
            "a private swarm: also run 'fusionllm token --rotate' so that the banned cannot rejoin under a new identity"
        )
    return 0


def _kill_groups(procs: list[Started], grace: float = 5.0) -> None:
    """SIGTERM each process's group (a peer, its DHT child and p2pd), then SIGKILL
    every group after ``grace`` s at most, all at once."""

    def signal_all(sig: int) -> None:
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    signal_all(signal.SIGKILL)  # leftovers (DHT child, p2pd) in each group
    for proc in procs:
        proc.wait()


def cmd_demo(args: argparse.Namespace) -> int:
    """The coordinator runs in this process; each peer is a separate process."""
    args.initial_peers, args.announce = [], []
    args.host_maddrs = list(LOOPBACK_MADDRS)
    args.min_peers = args.peers
    stages = args.stages or args.peers
    if args.link_mbps and len(args.link_mbps) != stages - 1:
        raise UsageError(f"--link-mbps gives {len(args.link_mbps)} rates for {stages - 1} stage boundaries")
    args.run = f"demo-{os.getpid()}"
    if args.save is None:
        args.save = "fusionllm-demo.safetensors"
    log_dir = Path(tempfile.mkdtemp(prefix="fusionllm-demo-"))
    own_run_dir = args.run_dir is None  # the demo's own: let go once the run finished (kept for --resume otherwise)
    if own_run_dir:
        args.run_dir = str(log_dir / "run")
    procs: list[Started] = []
    peer_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = Launcher(peer_env)  # imports torch and hivemind for the peers while the coordinator sets up

    started: list[asyncio.Future[None]] = []  # the thread that starts the peers (awaited by the loop's end)

    async def spawn(coord: Any) -> None:
        code = foreign_code(coord.config.job.model)
        cmds: list[list[str]] = []
        for i in range(args.peers):
            cmd = [
                "join",
                "--run",
                args.run,
                "--threads",
                "1",
                "--identity",
                str(log_dir / f"peer{i}.key"),
                "--coordinator-key",
                coord.identity.public_hex,
                *(["--allow-code", code] if code else []),  # the demo runs the user's own model
                *["--host-maddrs", *LOOPBACK_MADDRS],
                *["--data-path", args.data_path],
                "--initial-peers",
                *coord.visible_maddrs,
            ]
            cmds.append(cmd)
        # on a thread: the zygote may still be importing while the coordinator traces the model
        started.append(asyncio.ensure_future(asyncio.to_thread(start_peers, cmds)))

    def start_peers(cmds: list[list[str]]) -> None:
        for i, cmd in enumerate(cmds):
            with open(log_dir / f"peer{i}.log", "wb") as log:
                procs.append(launcher.spawn(cmd, env=peer_env, stdout=log.fileno()))
        print(f"started {args.peers} peer processes (logs in {log_dir}, kept only if the run fails)", flush=True)

    print(f"fusionllm demo: a coordinator and {args.peers} peers on loopback, talking libp2p", flush=True)
    failed: list[int] = []  # peers that exited with an error before the demo stopped them: their logs say why
    code = EXIT_INTERRUPTED  # what it is where Ctrl-C ends the run (``run_async`` raises)
    try:
        code = run_async(_coordinate(args, spawn))
    finally:
        stopped = False  # its peers stopped as they should: a clean run's logs are of no more use
        try:
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            try:
                _kill_groups(procs)
            finally:
                launcher.close()
            stopped = True
        finally:
            _tidy(log_dir, code == 0 and stopped)
    for i in failed if code != 0 else []:
        tail = (log_dir / f"peer{i}.log").read_text(errors="replace").strip().splitlines()[-3:]
        if tail:
            print(f"peer {i} log ({log_dir / f'peer{i}.log'}): " + " | ".join(tail), file=sys.stderr)
    return code


def _tidy(log_dir: Path, clean: bool) -> None:
    """After a demo: its peers' keys are of no more use (each demo starts new peers),
    and after a clean run (``clean``) nor are its logs or the run directory inside it
    (the demo's own, 5 MB of checkpoints; the model is saved; one given with ``--run-dir``
    is elsewhere and kept). A failed or interrupted run keeps its logs."""
    if clean:
        shutil.rmtree(log_dir, ignore_errors=True)
        return
    for key in log_dir.glob("peer*.key"):
        with contextlib.suppress(OSError):
            key.unlink()
    with contextlib.suppress(OSError):  # a run that failed before its peers started has nothing to keep
        log_dir.rmdir()
