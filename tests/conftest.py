from __future__ import annotations

import atexit
import os
import subprocess
from pathlib import Path

# hypothesis' pytest plugin imports hypothesis only when it writes the run's summary; in a
# run none of whose tests had imported it, pytest parsed its modules then (to rewrite them)
# and CPython 3.11.7's parser failed with "SystemError: AST constructor recursion depth
# mismatch" (its depth count left off by something a test ran): every test passed and
# pytest exited 1 (tests/test_coordinator_inbox.py alone). Imported here, before any test.
import hypothesis  # noqa: F401
import pytest

from fusionllm.launcher import ZYGOTE_MODULE, Launcher
from fusionllm.reaper import start_reaper

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # every command a test starts

#: every process a test session starts carries this session's mark in its environment
#: (inherited by what it starts: a benchmark's swarms, a peer's p2pd), so that checks for
#: leftover processes look at this session's alone, not at another session's or at
#: another pytest-xdist worker's running beside it
os.environ.setdefault("FUSIONLLM_TEST_SESSION", str(os.getpid()))
_MARKS = [f"{k}={os.environ[k]}".encode() for k in ("FUSIONLLM_TEST_SESSION", "PYTEST_XDIST_WORKER") if k in os.environ]


def of_this_session(pid: int) -> bool:
    """Whether process ``pid`` was started by this test session (and this xdist worker)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
    return all(mark in env for mark in _MARKS)


_launcher: list[Launcher] = []


def launcher() -> Launcher:
    """The tests' one zygote (:mod:`fusionllm.launcher`), started on first use and
    closed when pytest exits: commands fork from it instead of importing torch anew.
    The first use starts this process's reaper too: a test run or a benchmark killed
    mid-swarm (kill -9, a CI timeout) takes its swarms with it, where they would
    otherwise run on, blocked on a pipe nobody reads."""
    if not _launcher:
        start_reaper()
        _launcher.append(Launcher({**os.environ, **BASE_ENV}))
        atexit.register(_launcher[0].close)
    return _launcher[0]


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``fusionllm`` as its own process and capture its output."""
    return launcher().run(list(args), env={**os.environ, **BASE_ENV}, cwd=cwd or ROOT, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def demo_output(*args: str, timeout: float = 600) -> str:
    """What ``fusionllm demo *args`` printed; a failed demo ends the caller (a benchmark)
    with its exit code and both streams' tails."""
    done = run_cli("demo", *args, timeout=timeout)
    if done.returncode != 0:
        tails = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise SystemExit(f"the demo {' '.join(args)} exited {done.returncode}:\n{tails}")
    return done.stdout


def stray_commands() -> list[str]:
    """The command lines of this session's ``fusionllm`` processes running outside this
    test process's own tree: a ``join`` started fresh, or anything a zygote forked
    (those read ``python -m fusionllm.zygote``)."""
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        ours = ZYGOTE_MODULE in cmd or ("join" in cmd and "fusionllm" in " ".join(cmd))
        if ours and p.info["pid"] not in mine and of_this_session(p.info["pid"]):
            out.append(" ".join(cmd))
    return out
