"""Real coordinator and peer processes for integration tests: their output read
on a thread (so a pipe never fills), their descendants (DHT child, p2p daemon)
recorded by PID, and everything killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from fusionllm.launcher import Started
from tests.conftest import BASE_ENV, ROOT, launcher

SMALL = ["--model-args", "n_layer=2,n_embd=64,n_head=4"]
#: a run's tokens/s as its summary says it (a rebalance's lines before it name tokens/s too)
SUMMARY_RATE = re.compile(r"over \d+ steps in [\d.]+ s, ([\d,]+) tokens/s")


def summary_tokens_per_s(out: str) -> float | None:
    """The tokens/s of the summary in a swarm's output ``out``; None where it has none."""
    found = SUMMARY_RATE.search(out)
    return float(found.group(1).replace(",", "")) if found else None


class Proc:
    """One ``fusionllm`` process, its output lines, and every PID it ever started."""

    def __init__(
        self,
        *args: str,
        module: str = "fusionllm",
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        netns: str | None = None,
    ) -> None:
        env = {**os.environ, **BASE_ENV, **(env or {})}
        assert not (prefix and netns), "a prefix or a namespace, not both"
        self.args = args
        self.popen: Started
        if prefix:  # e.g. ip netns exec NS (it execs): a fresh interpreter inside
            self.popen = subprocess.Popen(
                [*prefix, sys.executable, "-m", module, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        else:  # forked from a warm zygote (into ``netns``, if named): the same process, less its seconds of imports
            self.popen = launcher().spawn(list(args), module=module, env=env, cwd=ROOT, text_stdout=True, netns=netns)
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line was read
        self.last_time = 0.0
        # pid -> the process noted: a pid, once its process is gone, may be another's
        # (pid_max is 32768 here, and a CI run wraps it several times); psutil tells the
        # two apart, and another's is neither killed, signalled nor counted alive
        self.pids: dict[int, psutil.Process] = {}
        self._add([self.popen.pid])
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def _add(self, pids: list[int]) -> None:
        for pid in pids:
            if pid not in self.pids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.pids[pid] = psutil.Process(pid)

    def note_children(self) -> None:
        """Remember the process's descendants now (to check later that they died)."""
        if (me := _same(self.pids, self.popen.pid)) is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._add([c.pid for c in me.children(recursive=True)])

    def wait_line(self, pattern: str, timeout: float = 90.0, after: int = 0) -> re.Match[str]:
        """Bounded wait for an output line matching ``pattern`` (among lines from index
        ``after`` on); ``last_time`` is when it was read."""
        deadline = time.monotonic() + timeout
        seen = after
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = re.search(pattern, self.lines[seen])
                seen += 1
                if m:
                    self.last_time = self.times[seen - 1]
                    return m
            if self.popen.poll() is not None and seen >= len(self.lines):
                self._reader.join(2)
                if seen >= len(self.lines):
                    break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.output[-3000:]}")

    def wait(self, timeout: float) -> int:
        code = self.popen.wait(timeout)
        self._reader.join(5)
        return code

    def signal(self, sig: int) -> None:
        self.note_children()
        if (me := _same(self.pids, self.popen.pid)) is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                me.send_signal(sig)

    def kill_all(self) -> None:
        self.note_children()
        for pid in self.pids:
            if (p := _same(self.pids, pid)) is not None:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    p.kill()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _same(noted: Mapping[int, psutil.Process], pid: int) -> psutil.Process | None:
    """The process noted as ``pid``, while it runs (None if it never was noted: a
    command reaped before it could be is gone, and its pid may be another's now)."""
    p = noted.get(pid)
    return p if p is not None and p.is_running() else None


def alive(pids: set[int] | Mapping[int, psutil.Process]) -> set[int]:
    """Those of ``pids`` still running (noted processes: the same processes)."""
    noted = pids if isinstance(pids, Mapping) else {}
    out = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = _same(noted, pid) if noted else psutil.Process(pid)
            if p is not None and p.status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
    return out


def wait_gone(pids: set[int] | Mapping[int, psutil.Process], timeout: float = 15.0) -> set[int]:
    """Bounded wait for ``pids`` to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def joined(proc: Proc, timeout: float = 120.0) -> str:
    """Bounded wait for a started peer to join; its peer id."""
    return proc.wait_line(r"joined run '.*' as (\w+)", timeout).group(1)


#: status page URL -> the coordinator serving it (to show its output when the page goes away)
COORDINATORS: dict[str, Proc] = {}


def api(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/v1/state", timeout=10) as r:
        return json.loads(r.read())


def wait_for(
    url: str, check: Callable[[dict[str, Any]], bool], timeout: float = 120.0, poll: float = 0.1
) -> dict[str, Any]:
    """Bounded wait until the coordinator's status API satisfies ``check``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = api(url)
        except OSError as exc:  # the coordinator is gone: say what it printed last
            coord = COORDINATORS.get(url)
            raise AssertionError(
                f"status page {url} unreachable ({exc}); the coordinator printed: "
                f"{coord.output[-3000:] if coord else '?'}"
            ) from None
        if check(state):
            return state
        assert time.monotonic() < deadline, f"status never satisfied the check: {json.dumps(state)[:2000]}"
        time.sleep(poll)


class Swarm:
    """A coordinator and ``peers`` joined peers; ``close`` kills what is left."""

    def __init__(self, tmp: Any, coordinator_args: list[str], peers: int, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = env  # the coordinator's environment, over the test's
        tmp.mkdir(parents=True, exist_ok=True)
        # any free port: tests run side by side and one after another (the default, 31337, is one per machine)
        coord_args = ["coordinator", *coordinator_args, "--identity", str(tmp / "c.key"), "--status-port", "0"]
        self.coord_args = [*coord_args, *([] if "--host-maddrs" in coordinator_args else ["--port", "0"])]
        self.procs: list[Proc] = []
        self.coord = self.start_coordinator()
        self.join_args = self.coord.wait_line(r"^\s+fusionllm join (.*)$").group(1).split()
        self.url = self.coord.wait_line(r"^status page: (\S+)").group(1)
        COORDINATORS[self.url] = self.coord
        self.peers = {}
        for i in range(peers):
            self.add_peer(i)

    def start_coordinator(self, *extra: str) -> Proc:
        proc = Proc(*self.coord_args, *extra, env=self.env)
        self.procs.append(proc)
        return proc

    def add_peer(self, i: int, *extra: str) -> str:
        """A peer joined; returns its peer id."""
        p = self.start_peer(i, *extra)
        pid = joined(p, 90.0)
        self.peers[pid] = p
        return pid

    def start_peer(self, i: int, *extra: str) -> Proc:
        """A peer started, not waited for (``joined`` waits): peers started together
        join side by side, not one after another."""
        p = Proc("join", *self.join_args, "--threads", "1", "--identity", str(self.tmp / f"p{i}.key"), *extra)
        self.procs.append(p)
        return p

    def add_hostile(self, mode: str, key: str, env: dict[str, str] | None = None) -> str:
        """A ``tests.hostile_peer`` of ``mode`` joined; returns its peer id."""
        return joined(self.start_hostile(mode, key, env))

    def start_hostile(self, mode: str, key: str, env: dict[str, str] | None = None) -> Proc:
        """A ``tests.hostile_peer`` of ``mode`` started, not waited for (``joined`` waits)."""
        p = Proc(mode, *self.join_args, "--identity", str(self.tmp / key), module="tests.hostile_peer", env=env)
        self.procs.append(p)
        return p

    def serving(self, state: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """Peer id -> (stage, replica) of the peers serving now."""
        return {p["id"]: (p["stage"], p["replica"]) for p in state["peers"] if p.get("state") == "serving"}

    def note_children(self) -> None:
        for p in self.procs:
            p.note_children()

    def all_pids(self) -> dict[int, psutil.Process]:
        return {pid: noted for p in self.procs for pid, noted in p.pids.items()}

    def reap(self) -> set[int]:
        """After the run: wait for every process still running to exit (60 s each),
        then return the PIDs any of them started that are still alive."""
        self.note_children()
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"'{p.args[0]}' did not exit within 60 s:\n{p.output[-3000:]}") from None
        return wait_gone(self.all_pids())

    def close(self) -> None:
        for p in self.procs:
            p.kill_all()


def join_together(swarm: Swarm, extras: list[list[str]], first: int = 0) -> list[str]:
    """Peers ``first``, ``first + 1``, ... of ``swarm`` (peer ``first + k`` with the flags
    ``extras[k]``) started together, so that their start-ups overlap, then each waited
    for until it joined; their peer ids in that order (in ``swarm.peers`` too)."""
    procs = [swarm.start_peer(i, *extra) for i, extra in enumerate(extras, first)]
    ids = []
    for p in procs:
        pid = joined(p)
        swarm.peers[pid] = p
        ids.append(pid)
    return ids
