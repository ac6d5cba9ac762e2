"""fusionllm.launcher: commands forked from a warm zygote are processes of their own,
and nothing is lost when the zygote cannot fork or dies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fusionllm import reaper
from fusionllm.launcher import ZYGOTE_ENV, Child, Launcher, _inherited, pool_settings
from tests.conftest import BASE_ENV, ROOT, launcher, stray_commands
from tests.swarmproc import SMALL, Proc, api, wait_for, wait_gone

PROBE = "tests.launch_probe"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LAUNCHER_TEST_ONLY_IN_PARENT"}
    return {**env, **BASE_ENV, **extra}


def _probe(zygote: Launcher, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[object, dict]:
    proc = zygote.spawn([*args], module=PROBE, env=env or _env(PROBE="yes"), cwd=cwd, text_stdout=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


@pytest.fixture
def zygote() -> Iterator[Launcher]:
    z = Launcher({**os.environ, **BASE_ENV})
    yield z
    z.close()


def test_a_forked_command_is_a_process_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCHER_TEST_ONLY_IN_PARENT", "1")  # in the caller's environment, not the request's
    first, me = _probe(launcher(), "3", cwd=tmp_path)
    second, other = _probe(launcher(), "0")
    assert isinstance(first, Child) and isinstance(second, Child)
    assert me["pid"] == first.pid and me["sid"] == first.pid  # its own session
    assert me["cwd"] == str(tmp_path) and me["argv"] == ["3"] and me["probe"] == "yes" and me["leaked"] is None
    assert me["stdin"] == ""  # /dev/null
    assert me["random"] != other["random"]  # each draws its own numbers, not the zygote's
    assert first.wait(30) == 3 and second.wait(30) == 0


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_command_runs_in_the_network_namespace_it_is_given(forked: bool) -> None:
    """``netns``: the fork enters the namespace before the command runs (a fresh start
    runs under ``ip netns exec``), and what it starts in turn runs there too (a zygote
    of its own, not the one outside); a namespace that is not there is one line, exit
    2, and the command never runs."""
    name = f"flz{os.getpid() % 100000}{'f' if forked else 'x'}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    env = _env(PROBE="yes") if forked else _env(PROBE="yes", OMP_NUM_THREADS="2")  # other settings: fresh
    try:
        inside = os.stat(f"/run/netns/{name}").st_ino
        proc = launcher().spawn(["nest", "0"], module=PROBE, env=env, text_stdout=True, netns=name)
        assert proc.stdout is not None
        nested = json.loads(proc.stdout.readline())
        assert isinstance(proc, Child) == forked and nested["own_zygote"] is not None
        assert nested["netns"] == nested["inner"]["netns"] == inside != os.stat("/proc/self/ns/net").st_ino
        assert proc.wait(60) == 0
        r = launcher().run(["0"], module=PROBE, env=env, timeout=30)
        assert r.returncode == 0 and json.loads(r.stdout)["netns"] != inside  # none named: ours
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if forked:  # the namespace is gone now
        with tempfile.TemporaryFile() as out:
            assert launcher().spawn(["0"], module=PROBE, env=env, netns=name, stdout=out.fileno()).wait(30) == 2
            out.seek(0)
            said = out.read().decode()
        assert said == f"fusionllm: error: no network namespace {name} (/run/netns/{name})\n", said


def test_run_captures_both_streams_and_the_exit_code() -> None:
    r = launcher().run(["train", "--steps", "1"], env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--reference --stages" in r.stderr


def test_a_command_past_its_timeout_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launcher().run(["--help"], env=_env(), cwd=ROOT, timeout=0.0)
    assert time.monotonic() - start < 30


def test_other_thread_settings_start_a_fresh_interpreter() -> None:
    proc, me = _probe(launcher(), "0", env=_env(PROBE="yes", OMP_NUM_THREADS="2"))
    assert isinstance(proc, subprocess.Popen) and me["probe"] == "yes" and me["sid"] == proc.pid
    assert proc.wait(30) == 0


def test_a_command_killed_holding_hiveminds_locks_does_not_stop_the_next_one() -> None:
    """hivemind's MPFuture locks are semaphores made at import, so in the zygote: a
    command killed while it held one left every later DHT start forked from the same
    zygote waiting for good (CI: a coordinator printed nothing for 180 s)."""
    holder, held = _probe(launcher(), "hold", env=_env())
    assert isinstance(holder, Child) and held == {"held": holder.pid}  # forked, not a fresh interpreter
    holder.kill()
    holder.wait(30)
    probe, free = _probe(launcher(), "locks", env=_env())
    assert isinstance(probe, Child)
    assert free == {"init": True, "update": True, "bytes": True, "executor": True}


def test_a_dead_zygote_leaves_its_commands_waitable_and_later_ones_start_fresh(zygote: Launcher) -> None:
    sleeper, _ = _probe(zygote, "0", "600")
    assert isinstance(sleeper, Child)
    os.kill(zygote.zygote_pid, signal.SIGKILL)
    zygote._zygote.wait(10)
    later, me = _probe(zygote, "5")
    assert isinstance(later, subprocess.Popen) and later.wait(30) == 5
    sleeper.kill()
    assert sleeper.wait(30) == -1  # reparented: its status went to whoever adopted it
    assert not psutil.pid_exists(sleeper.pid) or psutil.Process(sleeper.pid).status() == psutil.STATUS_ZOMBIE


def test_a_stuck_zygote_is_given_up_and_the_command_starts_fresh() -> None:
    stuck = Launcher({**os.environ, **BASE_ENV}, fork_wait_s=1.0)
    try:
        first, _ = _probe(stuck, "0")  # the zygote is ready: it forked once
        assert isinstance(first, Child) and first.wait(30) == 0
        os.kill(stuck._zygote.pid, signal.SIGSTOP)
        start = time.monotonic()
        proc, me = _probe(stuck, "4")
        assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 4 and me["probe"] == "yes"
        assert time.monotonic() - start < 20
        assert stuck._zygote.wait(10) == -signal.SIGKILL
    finally:
        stuck.close()


def test_kill9_of_a_demo_leaves_no_process(tmp_path: Path) -> None:
    """A demo started afresh: its zygote and the peers it forked are its descendants, and
    its reaper ends them all."""
    demo = Proc("demo", *_KILLED_DEMO, str(tmp_path / "run"), prefix=["env"])  # not forked: a zygote of its own
    try:
        url = demo.wait_line(r"^status page: (\S+)").group(1)
        wait_for(url, lambda s: s["training"]["step"] >= 2)
        tree = psutil.Process(demo.popen.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) for p in tree]
        assert sum(p.name() == "p2pd" for p in tree) >= 3, names  # the coordinator's and each peer's, all below it
        demo.note_children()
        os.kill(demo.popen.pid, signal.SIGKILL)
        assert not wait_gone(demo.pids, 30), [n for p, n in zip(tree, names, strict=True) if p.is_running()]
        assert not stray_commands()
        with pytest.raises(OSError):
            api(url)
    finally:
        demo.kill_all()


#: the status page on a port of its own: at the default one (8470), another worker's demo
#: took it once this one was killed, and the dead demo's page seemed to answer
_KILLED_DEMO = ["--peers", "2", "--steps", "100000", *SMALL, "--status-port", "0", "--run-dir"]


def test_kill9_of_a_forked_demo_leaves_no_process(tmp_path: Path) -> None:
    """A demo forked from a zygote has its peers forked by the same zygote (no zygote of
    its own): they are the zygote's children, and die when the demo's connection to it
    closes, kill -9 of the demo included."""
    zygote = psutil.Process(launcher().zygote_pid)
    before = {p.pid for p in zygote.children()}
    demo = Proc("demo", *_KILLED_DEMO, str(tmp_path / "run"))
    try:
        url = demo.wait_line(r"^status page: (\S+)").group(1)
        wait_for(url, lambda s: s["training"]["step"] >= 2)
        forked = [p for p in zygote.children() if p.pid not in before]
        assert demo.popen.pid in {p.pid for p in forked} and len(forked) == 3, forked  # the demo and its 2 peers
        tree = [*forked, *(c for p in forked for c in p.children(recursive=True))]
        names = [" ".join(p.cmdline()) for p in tree]
        assert sum(p.name() == "p2pd" for p in tree) >= 3, names
        demo.note_children()
        os.kill(demo.popen.pid, signal.SIGKILL)
        assert not wait_gone({p.pid for p in tree}, 30), [n for p, n in zip(tree, names, strict=True) if p.is_running()]
        assert not stray_commands()
        with pytest.raises(OSError):
            api(url)
    finally:
        demo.kill_all()


def test_a_forked_command_starts_its_own_commands_through_the_same_zygote() -> None:
    """A command's Launcher asks the zygote it was forked from (no second zygote, no
    second round of imports); what it starts is that zygote's child, and it sees the exit."""
    outer = launcher().spawn(["nest", "0"], module=PROBE, env=_env(), cwd=ROOT, text_stdout=True)
    assert outer.stdout is not None
    seen = json.loads(outer.stdout.readline())
    assert seen["own_zygote"] is None and seen["ppid"] == launcher().zygote_pid, seen
    assert seen["inner"]["probe"] == "inner" and psutil.Process(seen["inner"]["pid"]).ppid() in (
        launcher().zygote_pid,
        1,
    )
    assert json.loads(outer.stdout.readline()) == {"inner_code": 7}
    assert outer.wait(30) == 0


def test_kill9_of_a_forked_command_kills_what_it_started_through_the_zygote() -> None:
    outer = launcher().spawn(["nest", "600"], module=PROBE, env=_env(), cwd=ROOT, text_stdout=True)
    assert outer.stdout is not None
    inner = json.loads(outer.stdout.readline())["inner"]["pid"]
    assert psutil.Process(inner).ppid() == launcher().zygote_pid
    outer.kill()
    assert not wait_gone({outer.pid, inner}, 10)


def test_kill9_of_a_test_run_kills_the_commands_it_launched() -> None:
    """A test run or benchmark killed mid-swarm leaves none of its commands running."""
    code = (
        "import json, sys; from tests.conftest import BASE_ENV, ROOT, launcher; "
        f"p = launcher().spawn(['7', '600'], module='{PROBE}', env={{**BASE_ENV}}, cwd=ROOT, text_stdout=True); "
        "print(json.loads(p.stdout.readline())['pid'], flush=True); sys.stdin.read()"
    )
    harness = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    )
    assert harness.stdout is not None
    probe = int(harness.stdout.readline())
    assert psutil.pid_exists(probe)
    time.sleep(5 * reaper.POLL_S)  # the reaper notes its process's descendants at this period
    harness.kill()
    harness.wait()
    assert not wait_gone({probe}, 15)


def test_a_stale_zygote_variable_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable a forked command inherits proves nothing on its own: a process started
    some other way may carry it with a descriptor that is closed, or another file, or
    another process's socket."""
    other, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # created here, not by a zygote
    with open(tmp_path / "f", "w") as f:
        open_fds = len(os.listdir("/proc/self/fd"))
        for fd, pid in [(999, os.getpid()), (f.fileno(), os.getpid()), (mine.fileno(), os.getpid() + 1)]:
            named = {"pid": pid, "fd": fd, "pools": pool_settings(_env())}
            monkeypatch.setenv(ZYGOTE_ENV, json.dumps(named))
            assert _inherited(_env()) is None, named
        assert len(os.listdir("/proc/self/fd")) == open_fds, "a refused descriptor's copy is closed"
        named = {"pid": os.getpid(), "fd": mine.fileno(), "pools": pool_settings(_env(OMP_NUM_THREADS="4"))}
        monkeypatch.setenv(ZYGOTE_ENV, json.dumps(named))
        assert _inherited(_env()) is None  # it imported with other thread settings
    other.close()
    mine.close()


def test_a_reused_pid_is_a_new_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pids wrap (``pid_max`` is 32768 here): a command forked with the pid of one that
    already ended is a new command, not the old one with its exit code (CI saw a
    coordinator's ``wait`` return at once with an earlier command's code while it ran on,
    and a benchmark fail on it). A fake zygote answers over a socket pair."""
    import fusionllm.launcher as launcher_module

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(launcher_module, "_inherited", lambda env: ours)
    fake = Launcher(dict(os.environ))

    def fork_as(pid: int) -> Child:
        def answer() -> None:
            _, fds, _, _ = socket.recv_fds(theirs, 65536, 4)
            for fd in fds:
                os.close(fd)
            theirs.send(json.dumps({"pid": pid}).encode())

        zygote = threading.Thread(target=answer)
        zygote.start()
        child = fake.spawn(["--version"])
        zygote.join(5)
        assert isinstance(child, Child) and child.pid == pid
        return child

    try:
        first = fork_as(4242)
        theirs.send(json.dumps({"exit": 4242, "code": 9}).encode())
        assert first.wait(5) == 9
        second = fork_as(4242)
        assert second is not first and second.poll() is None, "the pid's earlier exit is not this command's"
        theirs.send(json.dumps({"exit": 4242, "code": 0}).encode())
        assert second.wait(5) == 0 and first.returncode == 9
    finally:
        theirs.close()
        fake.close()


def test_a_fork_that_comes_after_its_command_started_fresh_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote this process was forked from is not killed when it answers late (others
    use it): the command starts fresh, and the fork it makes afterwards would run beside
    it, a twin nobody watches (CI saw a coordinator print nothing for 90 s, likely behind
    such a twin holding its run directory). The late fork is killed, and later requests
    start fresh too. A fake zygote answers over a socket pair."""
    import fusionllm.launcher as launcher_module

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(launcher_module, "_inherited", lambda env: ours)
    slow = Launcher(dict(os.environ), fork_wait_s=0.5)
    twin = subprocess.Popen(["sleep", "600"], start_new_session=True)  # what the late fork made
    try:
        fresh = slow.spawn(["--help"])
        assert isinstance(fresh, subprocess.Popen) and fresh.wait(60) == 0, "started fresh once given up"
        _, fds, _, _ = socket.recv_fds(theirs, 65536, 4)
        for fd in fds:
            os.close(fd)
        theirs.send(json.dumps({"pid": twin.pid}).encode())
        assert twin.wait(10) == -signal.SIGKILL, "the late fork is killed"
        assert not slow._pid_reply, "its reply is no later request's"
    finally:
        twin.kill()
        theirs.close()
        slow.close()
