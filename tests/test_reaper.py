"""No orphans: kill -9 of a command takes its DHT child, p2pd and every other descendant with it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fusionllm import reaper
from fusionllm.reaper import POLL_S, descendants
from protocol.net.ports import PortTaken, check_listen_ports
from tests.conftest import ROOT, run_cli
from tests.test_swarm import _join_command, _spawn

SMALL = ["--model-args", "n_layer=2,n_embd=64,n_head=4"]


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _settled_names(pid: int, count: int, timeout: float = 10.0) -> tuple[list[psutil.Process], list[str]]:
    """The descendants of ``pid`` and their sorted command lines, once ``count`` of them have finished exec.

    Popen returns when the child's exec has begun; until the kernel has laid out the new
    program's arguments, /proc/PID/cmdline reads empty (CI once caught exactly that window).
    """
    deadline = time.monotonic() + timeout
    while True:
        kids = _descendants(pid)
        names = sorted(" ".join(p.cmdline()) for p in kids)
        if (len(names) == count and all(names)) or time.monotonic() > deadline:
            return kids, names
        time.sleep(0.05)


def _running(p: psutil.Process) -> bool:
    """Still the same process (psutil compares create_time) and not a zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """Bounded wait for every process in ``procs`` to exit; returns those still running."""
    deadline = time.monotonic() + timeout
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    return alive


def _kill_all(procs: list[psutil.Process]) -> None:
    """Cleanup by PID, whatever a test left (psutil checks the PID was not reused)."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _kill9(proc: subprocess.Popen[str]) -> None:
    """kill -9 this one process (not its group), as a crash or the OOM killer would."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _tree(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """The command's descendants: hivemind's DHT child (a fork of the command), p2pd, the reaper."""
    kids = _descendants(proc.pid)
    names = [" ".join(p.cmdline()) for p in kids]
    assert any(p.name() == "p2pd" for p in kids), names
    assert any("fusionllm.reaper" in n for n in names), names
    assert any(p.ppid() == proc.pid and p.name() != "p2pd" and "fusionllm.reaper" not in n for p, n in zip(kids, names))
    # the watchdog snapshots every POLL_S: a process born within a poll of a kill -9 could escape it
    time.sleep(3 * POLL_S)
    return kids


def _readline_until(proc: subprocess.Popen[str], prefix: str, timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        assert line or proc.poll() is None, f"exited before printing '{prefix}'"
    raise AssertionError(f"never printed '{prefix}'")


def _coordinator(tmp_path: Path) -> subprocess.Popen[str]:
    return _spawn(
        "coordinator",
        "--port",
        "0",
        "--min-peers",
        "5",
        "--steps",
        "10",
        *SMALL,
        "--identity",
        str(tmp_path / "c.key"),
        "--run-dir",
        str(tmp_path / "run"),
        "--status-port",
        "0",
    )


class _Coordinators:
    """The coordinator the kill -9 tests share (it waits for 5 peers all along): the one
    started last while it runs, a new one once a test has killed it."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen[str]] = []
        self.join_args: list[str] = []

    def get(self) -> tuple[subprocess.Popen[str], list[str]]:
        """A running coordinator and its join arguments."""
        if not self.started or self.started[-1].poll() is not None:
            self.started.append(_coordinator(self.tmp.mktemp("coordinator")))
            self.join_args = _join_command(self.started[-1])
        return self.started[-1], self.join_args

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                kids = _descendants(proc.pid)
                _kill9(proc)
                _kill_all(kids)


@pytest.fixture(scope="module")
def coordinators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Coordinators]:
    shared = _Coordinators(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.close()


def test_kill9_join_leaves_no_process_and_the_coordinator_runs_on(coordinators: _Coordinators, tmp_path: Path) -> None:
    """(The coordinator it leaves running is the one the next test kills: that its
    kill -9 leaves no process behind, once a peer has come and gone, is checked there.)"""
    coord, join_args = coordinators.get()
    peer: subprocess.Popen[str] | None = None
    kids: list[psutil.Process] = []
    try:
        coord_kids = _descendants(coord.pid)
        peer = _spawn("join", *join_args, "--threads", "1", "--identity", str(tmp_path / "p.key"))
        _readline_until(peer, "joined run")
        kids = _tree(peer)
        _kill9(peer)
        left = _all_gone(kids)
        assert not left, [" ".join(p.cmdline()) for p in left]
        assert coord.poll() is None and all(_running(p) for p in coord_kids), "the coordinator was hit too"
    finally:
        _kill_all(kids)
        if peer is not None and peer.poll() is None:
            _kill9(peer)


def test_kill9_coordinator_leaves_no_process(coordinators: _Coordinators) -> None:
    """(The coordinator the previous test left running, a peer of it killed, when run
    after it; else one of its own.)"""
    coord, _ = coordinators.get()
    kids: list[psutil.Process] = []
    try:
        kids = _tree(coord)
        _kill9(coord)
        left = _all_gone(kids)
        assert not left, [" ".join(p.cmdline()) for p in left]
    finally:
        _kill_all(kids)


def test_coordinator_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli(
            "coordinator",
            "--host-maddrs",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--identity",
            str(tmp_path / "c.key"),
            "--run-dir",
            str(tmp_path / "run"),
            "--status-port",
            "0",
            timeout=60,
        )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is taken" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_check_listen_ports_lets_free_and_time_wait_ports_pass() -> None:
    with socket.socket() as server:
        # as Go's listeners (p2pd's) do; a TIME_WAIT socket lets a new bind through only if it had it too
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(PortTaken, match=f"port {port} "):
            check_listen_ports(["/ip4/0.0.0.0/tcp/1", f"/ip4/127.0.0.1/tcp/{port}/p2p/" + "12D3KooW" + "A" * 44])
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            conn.close()  # the server's side closes first: its port lingers in TIME_WAIT
            assert client.recv(1) == b""
    # the listener is closed, the port only in TIME_WAIT; port 0 and other transports are not checked
    waiting = [c for c in psutil.net_connections("tcp4") if c.laddr and c.laddr.port == port]
    assert any(c.status == psutil.CONN_TIME_WAIT for c in waiting), waiting
    check_listen_ports([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/9/quic"])


def _script(script: str, cwd: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """``python -c script`` in a session of its own (with ``env`` added), its stdout a pipe."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        start_new_session=True,
        cwd=cwd,
    )


def test_reaper_ends_the_children_of_a_killed_parent() -> None:
    script = (
        "import subprocess, sys, time\n"
        "from fusionllm.reaper import start_reaper\n"
        "start_reaper(); start_reaper()\n"  # once per process
        "subprocess.Popen(['sleep', '1000'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(1000)\n"
    )
    parent = _script(script)
    kids: list[psutil.Process] = []
    try:
        _readline_until(parent, "ready", timeout=30)
        kids, names = _settled_names(parent.pid, count=2)
        assert len(names) == 2 and "fusionllm.reaper" in names[0] and names[1] == "sleep 1000", names
        time.sleep(3 * POLL_S)  # one snapshot of the watchdog at least
        _kill9(parent)
        assert not _all_gone(kids, timeout=5.0)
        assert parent.stdout is not None and parent.stdout.read() == "", "the pipe saw EOF: nobody else holds it"
    finally:
        _kill_all(kids)
        if parent.poll() is None:
            _kill9(parent)


SHARED_STATE = """
import os, time
from fusionllm.reaper import start_reaper
from hivemind.utils.mpfuture import MPFuture
future = MPFuture()  # hivemind's shared state: a torch_shm_manager, a segment in /dev/shm
start_reaper()
if os.fork() == 0:  # as a DHT child: a second process the manager serves
    time.sleep(1000)
    os._exit(0)
print("ready", flush=True)
time.sleep(1000)
"""


@contextlib.contextmanager
def _shared_state(script: str, count: int, cwd: Path | None = None, **env: str) -> Iterator[subprocess.Popen[str]]:
    """``script`` (a ``SHARED_STATE``) started and ready, its ``count`` descendants
    listed, torch's manager among them; after the block, all of them are gone within
    10 s and so are the segments it made (whatever is left is then killed)."""
    began = time.time()
    parent = _script(script, cwd, **env)
    kids: list[psutil.Process] = []
    try:
        _readline_until(parent, "ready", timeout=60)
        kids, names = _settled_names(parent.pid, count=count)
        assert any("torch_shm_manager" in n for n in names), names
        # its own: named by its pid, made since it started (another process of that pid may have left some)
        segments = [s for s in Path("/dev/shm").glob(f"torch_{parent.pid}_*") if s.stat().st_mtime >= began - 1]
        assert segments
        yield parent
        assert not _all_gone(kids, timeout=10.0)
        assert not [s for s in segments if s.exists()]
    finally:
        _kill_all(kids)
        if parent.poll() is None:
            _kill9(parent)


def test_a_killed_commands_shared_memory_is_unlinked() -> None:
    """The watchdog signalled torch's shared-memory manager with the rest: killed, it
    left its segments in /dev/shm and its folder in /tmp (16,000 of each here). Left to
    end by itself once the processes it serves are gone, it unlinks them."""
    with _shared_state(SHARED_STATE, count=3) as parent:
        time.sleep(3 * POLL_S)  # one snapshot of the watchdog at least
        _kill9(parent)


UNWATCHED = SHARED_STATE.replace("start_reaper()\n", "")


@pytest.mark.parametrize("how", ["a timed-out command", "a testbed run's strays"])
def test_killing_a_tree_spares_torch_shared_memory_manager(how: str, tmp_path: Path) -> None:
    """The launcher's kill of a timed-out command and the testbed's end of a run's
    strays SIGKILLed torch's shared-memory manager too, which left its segments."""
    from fusionllm.launcher import _kill_tree
    from fusionllm.testbed.swarm import WORK_VAR, end_strays

    timed_out = how == "a timed-out command"  # its watchdog is spared too: it ends a manager that lingers
    script, count = (SHARED_STATE, 3) if timed_out else (UNWATCHED, 2)
    with _shared_state(script, count, tmp_path, **{WORK_VAR: str(tmp_path)}) as parent:
        if timed_out:
            time.sleep(3 * POLL_S)  # one snapshot of the watchdog at least
            _kill_tree(parent.pid)
        else:
            _kill9(parent)  # its fork (a DHT child) is left: a stray
            end_strays(tmp_path, 2.0)


@pytest.mark.parametrize("scan_s", [0.0, 1.5], ids=["quick-scan", "slow-scan"])
def test_a_testbed_runs_lingering_shared_memory_manager_is_killed_in_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scan_s: float
) -> None:
    """The manager spared by ``end_strays`` is killed once ``SELF_END_S`` has passed
    without it ending (a stand-in by that name that never does), however long a scan
    of /proc takes: CI saw a busy machine's scans outlast the second between the
    sparing's end and the give-up, and the manager left running."""
    from fusionllm.reaper import SELF_END_S
    from fusionllm.testbed import swarm
    from fusionllm.testbed.swarm import WORK_VAR, end_strays

    scan = swarm.strays
    monkeypatch.setattr(swarm, "strays", lambda work: (time.sleep(scan_s), scan(work))[1])

    stand_in = tmp_path / "torch_shm_manager"
    stand_in.write_bytes(Path("/bin/sleep").read_bytes())
    stand_in.chmod(0o755)
    env = {**os.environ, WORK_VAR: str(tmp_path)}
    proc = subprocess.Popen([str(stand_in), "1000"], env=env, cwd=tmp_path, start_new_session=True)
    try:
        began = time.monotonic()
        end_strays(tmp_path, 1.0)
        assert proc.wait(5) == -signal.SIGKILL, "killed before end_strays returned"
        assert time.monotonic() - began >= SELF_END_S, "spared until then"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_watchdog_ends_a_lingering_shared_memory_manager_after_the_others(tmp_path: Path) -> None:
    """``reaper._reap``, what a watchdog does once its command is gone: an ordinary
    descendant is signalled at once; a shared-memory manager (a stand-in by that name
    that never ends by itself) is left ``SELF_END_S`` to end, then signalled too."""
    stand_in = tmp_path / "torch_shm_manager"
    stand_in.write_bytes(Path("/bin/sleep").read_bytes())
    stand_in.chmod(0o755)
    manager = subprocess.Popen([str(stand_in), "1000"], start_new_session=True)
    other = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        seen = {p.pid: psutil.Process(p.pid).create_time() for p in (manager, other)}
        began = time.monotonic()
        reaping = threading.Thread(target=reaper._reap, args=(seen, 1.0), daemon=True)
        reaping.start()
        assert other.wait(3) == -signal.SIGTERM
        with pytest.raises(subprocess.TimeoutExpired):  # not signalled with the others
            manager.wait(began + reaper.SELF_END_S - 1 - time.monotonic())
        assert manager.wait(5) == -signal.SIGTERM
        assert time.monotonic() - began >= reaper.SELF_END_S
        reaping.join(5)
        assert not reaping.is_alive()
    finally:
        for proc in (manager, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


HANGING_SHUTDOWN = """
import asyncio, os, signal, sys, time
import fusionllm.reaper
fusionllm.reaper.EXIT_GRACE_S = 1.0
from fusionllm.running import run_async

async def stubborn() -> None:  # swallows every cancellation: the loop's shutdown waits for it forever
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

async def command() -> int:
    asyncio.ensure_future(stubborn())
    await asyncio.sleep(0.1)
    print("ready", flush=True)
    if sys.argv[1] == "interrupt":
        await asyncio.sleep(3600)
    return 3

sys.exit(run_async(command()))
"""


@pytest.fixture(scope="module")
def hanging() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The ``HANGING_SHUTDOWN`` command of each kind, started together (their start-ups
    overlap); each test reads its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for how in ("done", "interrupt"):
            procs[how] = subprocess.Popen(
                [sys.executable, "-c", HANGING_SHUTDOWN, how],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _kill9(proc)


@pytest.mark.parametrize("how", ["done", "interrupt"])
def test_a_command_whose_shutdown_hangs_ends_anyway(hanging: dict[str, subprocess.Popen[str]], how: str) -> None:
    """A task that swallows its cancellation keeps asyncio's shutdown waiting forever;
    the command still ends ``EXIT_GRACE_S`` after its outcome (or after Ctrl-C), with
    its exit code, one line, and every thread's stack in a file, with each task not
    done and where it waits."""
    proc = hanging[how]
    try:
        _readline_until(proc, "ready", timeout=30)
        if how == "interrupt":
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            _kill9(proc)
    assert proc.returncode == (130 if how == "interrupt" else 3), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "shutting down took over 1 s" in lines[0], err
    stacks = Path(lines[0].split("stacks in ")[1].rstrip(")"))
    try:
        text = stacks.read_text()
        assert "Thread" in text and "in stubborn" in text, text  # the task that held the shutdown, and where
    finally:
        stacks.unlink()


SIGNALLED_AT_EXIT = """
import atexit, os, signal, sys, time
from fusionllm.running import run_async

def stopped_while_exiting() -> None:  # what a demo's SIGTERM does to a peer whose run just ended
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)

async def command() -> int:
    atexit.register(stopped_while_exiting)
    return 4

sys.exit(run_async(command()))
"""


def test_a_signal_after_the_command_ended_is_no_traceback() -> None:
    """A peer whose run has ended got the demo's SIGTERM while running its exit hooks: it
    printed a KeyboardInterrupt traceback into its log. Once the command is over a signal
    ends the process at once, with the command's own code and nothing printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SIGNALLED_AT_EXIT], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 4 and proc.stderr.strip() == "", proc.stderr


INTERRUPTED_IN_A_PROTOCOL = """
import asyncio, os, signal, sys
import fusionllm.reaper
fusionllm.reaper.EXIT_GRACE_S = 30.0
from fusionllm.running import run_async

class Interrupting(asyncio.BufferedProtocol):  # Ctrl-C while the event loop runs its callback
    def get_buffer(self, sizehint: int) -> memoryview:
        os.kill(os.getpid(), signal.SIGINT)
        return memoryview(bytearray(1024))

    def buffer_updated(self, nbytes: int) -> None:
        pass

async def command() -> int:
    server = await asyncio.get_running_loop().create_server(Interrupting, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(b"x")
    await asyncio.sleep(60)
    return 0

try:
    sys.exit(run_async(command()))
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_signal_during_a_protocols_callback_interrupts_the_command() -> None:
    """uvloop runs a protocol's ``get_buffer`` under ``except BaseException``: a
    KeyboardInterrupt raised there by the signal handler was lost, and an interrupted
    demo ran on until its grace ended it (about once in eight). The signal is raised
    from a callback of the loop instead: the command ends at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IN_A_PROTOCOL], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 130 and "shutting down took over" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20


UNOBSERVED = """
import asyncio, gc, sys
from fusionllm.running import run_async

async def fails() -> None:
    raise FileNotFoundError(2, "No such file or directory")

async def command() -> int:
    task = asyncio.ensure_future(fails())
    await asyncio.wait({task})
    del task
    gc.collect()  # asyncio reports the exception no one retrieved
    return 0

sys.exit(run_async(command()))
"""


def test_a_task_failing_unobserved_is_one_line_not_a_traceback() -> None:
    """asyncio reports a task whose exception nobody retrieved with a traceback; a
    command says it in one warning line (a CI run showed such a traceback at exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", UNOBSERVED], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and "never retrieved (in fails)" in lines[0] and "FileNotFoundError" in lines[0], proc.stderr


def test_the_watchdog_reads_the_same_descendants_as_psutil_from_the_children_files() -> None:
    """The watchdog walks ``/proc/PID/task/*/children`` (a few reads) instead of
    psutil's scan of every process; both see the same tree, grandchildren included."""
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & sleep 31) & wait"], start_new_session=True)
    try:
        top = psutil.Process(tree.pid)
        deadline = time.monotonic() + 5
        while len(top.children(recursive=True)) < 4 and time.monotonic() < deadline:  # sleep, the subshell, its two
            time.sleep(0.02)
        want = {p.pid: p.create_time() for p in top.children(recursive=True)}
        assert len(want) == 4
        assert descendants(top, -1) == want
        left_out = next(iter(want))
        assert left_out not in descendants(top, left_out), "the watchdog leaves itself out"
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait()


@pytest.mark.parametrize(
    ("newest", "finished", "scanned"),
    [
        (["7", "7", "7", "9", "9", "9", "9", "9"], True, [0, 3, 5]),  # moved, then every SCAN_EVERY polls
        (["0"] * 11, True, [0, 5, 10]),  # gVisor: loadavg never changes
        ([None, None, "7", None], True, [0, 1, 2, 3]),  # unreadable: every poll
        (["7", "7", "7"], False, [0, 1, 2]),  # a scan cut short is not trusted
    ],
)
def test_the_watchdog_scans_again_once_a_process_was_created_and_every_few_polls(
    monkeypatch: pytest.MonkeyPatch, newest: list[str | None], finished: bool, scanned: list[int]
) -> None:
    """A scan of the descendants is repeated when ``/proc/loadavg``'s newest pid moved
    (or cannot be read), after a scan that did not finish, and every ``SCAN_EVERY``
    polls whatever it says; the parent is checked at every poll."""
    assert reaper.SCAN_EVERY == 5
    polls = iter(newest)
    done: list[int] = []
    checked: list[int] = []
    monkeypatch.setattr(
        reaper, "_parent_alive", lambda parent, ppid: (checked.append(1), len(checked) <= len(newest))[1]
    )
    monkeypatch.setattr(reaper, "last_pid", lambda: next(polls))
    monkeypatch.setattr(reaper, "_refresh", lambda parent, seen, me: (done.append(len(checked) - 1), finished)[1])
    monkeypatch.setattr(reaper, "_reap", lambda seen, grace_s: None)
    reaper.watch(os.getpid(), poll_s=0)
    assert done == scanned and len(checked) == len(newest) + 1


def test_last_pid_moves_when_a_process_is_created() -> None:
    before = reaper.last_pid()
    subprocess.run(["true"], check=True)
    assert before is not None and reaper.last_pid() != before


SIGNALLED_IN_SHUTDOWN = """
import asyncio, os, signal, sys, threading, time
from fusionllm.running import run_async

async def command() -> int:
    signals, busy_s = int(sys.argv[1]), float(sys.argv[2])
    asyncio.get_running_loop().run_in_executor(None, time.sleep, busy_s)  # the loop's shutdown waits for it
    for i in range(signals):
        threading.Timer(0.3 + 0.2 * i, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return 4

sys.exit(run_async(command()))
"""


@pytest.mark.parametrize(("signals", "busy_s"), [(1, 1.0), (2, 60.0)])
def test_a_signal_while_the_loop_shuts_down_is_no_traceback(signals: int, busy_s: float) -> None:
    """A peer whose run had ended got the demo's SIGTERM while its event loop shut down
    (waiting for its executor's threads): the KeyboardInterrupt stopped uvloop's
    executor shutdown half way and its thread printed a traceback into the peer's log.
    The shutdown now goes on; the process ends with the command's own code, nothing
    printed. A second signal (Ctrl-C again) ends it at once, not after the 60 s job."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SIGNALLED_IN_SHUTDOWN, str(signals), str(busy_s)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 4 and proc.stderr.strip() == "", proc.stderr
    assert time.monotonic() - started < 10, "before the exit deadline (EXIT_GRACE_S, 20 s)"


def test_the_exit_watcher_sleeps_until_a_deadline_is_set_then_ends_the_process_at_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher thread does not wake to poll (it took the GIL from a peer's compute
    ten times a second); armed, it ends the process at the deadline."""
    import fusionllm.reaper as reaper

    ended: list[tuple[int, float]] = []
    monkeypatch.setattr(reaper, "_exit_at", [])
    monkeypatch.setattr(reaper, "_armed", reaper.threading.Event())
    monkeypatch.setattr(reaper, "_watcher", [])
    monkeypatch.setattr(reaper, "_expire", lambda code, grace: ended.append((code, time.monotonic())))
    sleeps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(reaper.time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    reaper.watch_exit()
    real_sleep(0.3)
    assert sleeps == [] and ended == [], "asleep until armed"
    armed = time.monotonic()
    reaper.exit_within(3, 0.2)
    reaper.exit_within(4, 0.0)  # only the first call counts
    reaper._watcher[0].join(5)
    assert [code for code, _ in ended] == [3]
    assert 0.2 <= ended[0][1] - armed < 1.0
    assert len(sleeps) <= 2, sleeps
