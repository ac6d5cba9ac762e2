"""One swarm on the testbed: the coordinator in its namespace, told the pinned plan
(``coordinator.pinned``), and one ``join`` per peer in its own, each throttled to its
share of the compute and delaying its sends by its links' latency; their output is
read for the numbers the report needs. Each process leads its own process group, and
``stop`` ends every group (the DHT child and the p2p daemon with it). The processes
are forked from a warm zygote into their namespaces (``Launcher.spawn(netns=)``):
five fresh interpreters a run cost 3 CPU-seconds of imports each. Each runs in the
run's work folder, which is how ``strays`` finds it (a forked process's environment
in ``/proc`` is the zygote's; the p2p daemon's carries the run's mark)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusionllm.launcher import ZYGOTE_MODULE, Launcher, Started
from fusionllm.reaper import SELF_END_S, self_ending
from fusionllm.testbed.lab import Lab
from protocol.net.delay import ENV_VAR as DELAY_VAR

logger = logging.getLogger(__name__)

WORK_VAR = "FUSIONLLM_TESTBED_WORK"  # every process of a run carries its work folder (``strays``)
PLAN_VAR = "FUSIONLLM_TESTBED_PLAN"  # coordinator.pinned.ENV_VAR (not imported: no torch here)
_JOIN = re.compile(r"^\s+fusionllm join (.*)$")
_ESTIMATE = re.compile(r"^estimator: predicted ([\d.]+) ms per step, measured ([\d.]+) ms \(median\)")
_STAGE = re.compile(r"([\d.]+)/([\d.]+) ms")
_BOUNDARY = re.compile(r"^\s+boundary (\d+) .*?: (\S+), ([\d.]+) MB on the wire")
_LOSS = re.compile(r"^loss ([\d.]+) -> ([\d.]+) ")
_PARTS = re.compile(r"^  stage (\d+) step [\d.]+ ms(?: \(predicted [\d.]+\))?: (.*) ms$")
_PART = re.compile(r"([a-z_]+) ([\d.]+)")


@dataclass
class Measured:
    """What a finished run printed: the median step, the coordinator's own estimate,
    each boundary's codec and wire bytes, the loss at the end (mean of the last steps)."""

    step_s: float = float("nan")
    coordinator_predicted_s: float = float("nan")
    wire_bytes: list[int] = field(default_factory=list)
    codecs: list[str] = field(default_factory=list)
    final_loss: float = float("nan")
    #: each stage's measured compute per micro-batch (seconds), as the coordinator's summary prints it
    stage_compute_s: list[float | None] = field(default_factory=list)
    #: each stage's step breakdown (part -> mean ms per step over its peers; a part not printed is 0)
    stage_parts: list[dict[str, float]] = field(default_factory=list)


def parse_summary(lines: list[str]) -> Measured:
    """The numbers of a coordinator's summary (``swarm_cmds._summary``'s lines)."""
    out = Measured()
    for line in lines:
        if m := _ESTIMATE.match(line):
            out.coordinator_predicted_s, out.step_s = float(m.group(1)) / 1e3, float(m.group(2)) / 1e3
            pairs = _STAGE.findall(line.split("predicted/measured:")[-1])
            out.stage_compute_s = [float(q) / 1e3 if float(q) > 0 else None for _, q in pairs]
        elif m := _BOUNDARY.match(line):
            out.codecs.append(m.group(2).rstrip(","))
            out.wire_bytes.append(round(float(m.group(3)) * 1e6))
        elif m := _LOSS.match(line):
            out.final_loss = float(m.group(2))
        elif (m := _PARTS.match(line)) and int(m.group(1)) == len(out.stage_parts):
            shown = re.sub(r"\([^)]*\)", "", m.group(2))  # the predictions beside the parts
            out.stage_parts.append({k: float(v) for k, v in _PART.findall(shown)})
    return out


_launcher: list[Launcher] = []  # this process's, made on first use (its zygote ends with us)


def _launch(args: list[str], env: dict[str, str], netns: str, cwd: Path) -> Started:
    if not _launcher:
        _launcher.append(Launcher({**os.environ, "OMP_NUM_THREADS": "1"}))
    return _launcher[0].spawn(args, env=env, cwd=cwd, text_stdout=True, netns=netns)


class _Proc:
    """``fusionllm *args`` in a namespace, its own process group, its output lines collected."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path, netns: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed by the reader thread)
        self.popen = _launch(args, env, netns, log.parent)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self._log:
            for line in self.popen.stdout:
                self.lines.append(line.rstrip("\n"))
                self._log.write(line)

    def wait_line(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if m := pattern.match(line):
                    return m
            seen = len(self.lines)
            if self.popen.poll() is not None and seen == len(self.lines):
                break
            time.sleep(0.1)
        raise RuntimeError(f"the {self.name} printed no line like {pattern.pattern!r}: {self.tail()}")

    def tail(self, n: int = 3) -> str:
        return " | ".join(self.lines[-n:]) or "(no output)"

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class SwarmSpec:
    """One run's processes: model flags, steps, the pinned plan's file, the work folder."""

    job_args: list[str]  # --model ... --model-args ... --micro-batches ... --steps ...
    plan_file: Path
    work: Path
    throttles: dict[str, float]  # peer -> --throttle
    delays: dict[str, str]  # peer -> FUSIONLLM_LINK_DELAY_MS
    compression: str = "none"
    timeout_s: float = 600.0
    call_ms: float = 0.0  # every peer's --throttle-call-ms


class Swarm:
    """The coordinator (host ``coordinator`` of ``lab``) and one peer per other host."""

    def __init__(self, lab: Lab, coordinator: str, spec: SwarmSpec) -> None:
        self.lab, self.coordinator, self.spec = lab, coordinator, spec
        self.procs: list[_Proc] = []

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (PLAN_VAR, DELAY_VAR)}
        return {**env, "OMP_NUM_THREADS": "1", WORK_VAR: str(self.spec.work), **extra}

    def run(self) -> Measured:
        """Train to the end; RuntimeError (one line) when the run fails or hangs."""
        spec, lab = self.spec, self.lab
        peers = [h for h in lab.hosts if h != self.coordinator]
        ip = lab.hosts[self.coordinator]
        # a flag beside its value, a few to a line, reads as a command line (fmt: skip below)
        coord_cmd = [
            "coordinator", *spec.job_args,
            "--run", "testbed", "--min-peers", str(len(peers)), "--host-maddrs", f"/ip4/{ip}/tcp/0",
            "--identity", str(spec.work / "coordinator.key"), "--status-port", "0",
            "--run-dir", str(spec.work / "run"), "--spot-check", "0", "--rebalance-every", "0",
            "--checkpoint-every", "0", "--compression", spec.compression, "--peer-wait", "180",
        ]  # fmt: skip
        env = self._env(**{PLAN_VAR: str(spec.plan_file)})
        coord = _Proc("coordinator", coord_cmd, env, spec.work / "coordinator.log", lab.ns[self.coordinator])
        self.procs.append(coord)
        join = coord.wait_line(_JOIN, 180).group(1).split()
        for h in peers:
            # a flag beside its value, as on a command line (fmt: skip below)
            cmd = [
                "join", *join, "--threads", "1",
                "--throttle", f"{spec.throttles[h]:.4f}", "--throttle-call-ms", f"{spec.call_ms:.4f}",
                "--identity", str(spec.work / f"{h}.key"),
                "--host-maddrs", f"/ip4/{lab.hosts[h]}/tcp/0",
            ]  # fmt: skip
            env = self._env(**{DELAY_VAR: spec.delays.get(h, "")})
            self.procs.append(_Proc(h, cmd, env, spec.work / f"{h}.log", lab.ns[h]))
        try:
            code = coord.popen.wait(spec.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the run took over {spec.timeout_s:g} s: {coord.tail()}") from None
        coord._reader.join(5)
        if code != 0:
            raise RuntimeError(f"the coordinator exited with {code}: {coord.tail()}")
        return parse_summary(coord.lines)

    def stop(self, grace: float = 5.0) -> None:
        """End every process of the run (SIGTERM, then SIGKILL to each group)."""
        for p in self.procs:
            p.kill(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for p in self.procs:
            p.kill(signal.SIGKILL)
            p.popen.wait()
        self.procs.clear()
        end_strays(self.spec.work, grace)  # what left the groups


def end_strays(work: Path, grace: float) -> None:
    """SIGKILL what a run in ``work`` left running (``strays``), for up to ``grace`` s.
    torch's shared-memory manager is left ``SELF_END_S`` to end by itself first (it
    unlinks its segments in /dev/shm as it does; killed, it left them), then killed:
    the last pass before giving up spares nothing."""
    began = time.monotonic()
    while left := strays(work):
        sparing = time.monotonic() - began < SELF_END_S
        for pid in left:
            if sparing and self_ending(pid):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # it gives up only after a pass that spared nothing: on a busy machine one scan of
        # /proc took over the second between the sparing's end and the give-up, and the
        # manager was left running
        if not sparing and time.monotonic() - began >= max(grace, SELF_END_S + 1.0):
            return
        time.sleep(0.1)


def strays(work: Path) -> list[int]:
    """Processes still running that a run in ``work`` (or a folder in it) started: its
    mark in their environment (a process started fresh, and the p2p daemon), or forked
    from a zygote (the commands and their DHT children) and working in that folder. (A
    shell or an editor in the folder is neither.)"""
    mark, inside = f"{WORK_VAR}={work}".encode(), os.path.realpath(work)
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                marked = any(entry.startswith(mark) for entry in f.read().split(b"\0"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                forked = ZYGOTE_MODULE.encode() in f.read().split(b"\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if marked or (forked and inside != os.sep and (cwd == inside or cwd.startswith(inside + os.sep))):
            found.append(pid)
    return found
