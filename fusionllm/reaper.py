"""No orphans: every process a command starts dies with it, kill -9 included.

hivemind forks a DHT child, which starts the ``p2pd`` daemon; neither notices when
the command's process is killed with SIGKILL, and the daemon keeps listening (with
SO_REUSEPORT, so a restarted coordinator silently shares its port).
:func:`start_reaper` starts a small watchdog process (psutil only, no torch or
hivemind) that remembers the command's descendants while the command lives, and
terminates those still running once it is gone, however it went.
:func:`exit_within` ends the command itself should its own shutdown hang (a task
that swallows its cancellation, a thread that never returns): the watchdog then
ends what it started.
:func:`check_listen_ports` refuses a listen address whose port is still taken.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the watchdog looks at the parent and its descendants
#: a full scan of the descendants at least every this many polls, whatever ``last_pid`` says
#: (a child linked to its parent after its pid moved the cursor, a gVisor whose loadavg is fixed)
SCAN_EVERY = 5
GRACE_S = 2.0  # SIGTERM, then this long, then SIGKILL

EXIT_GRACE_S = 20.0  # how long a command may take to shut down once it is done or interrupted

_started: dict[int, subprocess.Popen[bytes]] = {}  # pid of the watched process -> its watchdog


_exit_at: list[tuple[float, int, float]] = []  # the first deadline armed: (time.monotonic, exit code, grace)
_armed = threading.Event()  # set with the deadline: the watcher sleeps until then, never waking to poll
_watcher: list[threading.Thread] = []


def exit_within(code: int, grace_s: float | None = None) -> None:
    """End this process with ``code`` if it is still shutting down after ``grace_s``
    (default ``EXIT_GRACE_S``): one line names the file where every thread's stack was
    written. Only the first call counts. Safe in a signal handler: it only sets the
    deadline (a handler interrupting this call finds it set and does nothing), which a
    thread started by :func:`watch_exit` acts on."""
    grace_s = EXIT_GRACE_S if grace_s is None else grace_s
    if not _exit_at:
        _exit_at.append((time.monotonic() + grace_s, code, grace_s))
        _armed.set()


def watch_exit() -> None:
    """Start (once per process) the thread that ends it at the deadline :func:`exit_within`
    sets. It sleeps until a deadline is set, then until the deadline: a thread that woke
    to poll took the GIL from the peer's compute ten times a second (2-6% of a peer's
    samples in a profile of the demo)."""
    if _watcher and _watcher[0].is_alive():
        return

    def watch() -> None:
        _armed.wait()
        while (left := _exit_at[0][0] - time.monotonic()) > 0:
            time.sleep(left)
        _expire(*_exit_at[0][1:])

    _watcher[:] = [threading.Thread(target=watch, name="fusionllm-exit-watch", daemon=True)]
    _watcher[0].start()


def _expire(code: int, grace_s: float) -> None:
    """Write every thread's stack to a file, say so in one line, and end the process,
    whatever of the first two fails (a full disk, a closed stderr)."""
    import faulthandler

    try:
        fd, path = tempfile.mkstemp(prefix=f"fusionllm-shutdown-{os.getpid()}-", suffix=".txt")
        with os.fdopen(fd, "w") as out:
            faulthandler.dump_traceback(out, all_threads=True)
            with contextlib.suppress(Exception):  # the line below is said whatever this does
                _pending_tasks(out)
        line = f"fusionllm: shutting down took over {grace_s:.0f} s; stopped (stacks in {path})\n"
        os.write(2, line.encode())
    finally:
        os._exit(code)


def _pending_tasks(out: IO[str]) -> None:
    """Each asyncio task not yet done, with where it waits: a shutdown that hangs is
    most often a task that does not end when cancelled, which the threads' stacks show
    only as the event loop running. (Read from this thread while the loop runs: a task
    that changes meanwhile is skipped.)"""
    import asyncio

    every = getattr(asyncio.tasks, "_all_tasks", None) or getattr(asyncio.tasks, "_scheduled_tasks", ())
    tasks: list[Any] = []
    for _ in range(10):  # (the loop may add a task while the set is read)
        with contextlib.suppress(RuntimeError):
            tasks = list(every)  # every loop's, uvloop's included
            break
    for task in tasks:
        try:
            if not task.done():
                out.write(f"\n{task!r}, awaiting:\n{''.join(_awaits(task.get_coro()))}")
        except Exception:  # noqa: BLE001 (a task that changed while it was read)
            continue


def _awaits(coro: Any) -> Iterator[str]:
    """Where a suspended coroutine waits, down its chain of awaits (a task's own stack
    shows only its outermost coroutine)."""
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            return
        yield f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)


def start_reaper() -> None:
    """Start this process's watchdog, once per process (a forked child needs its own call)."""
    me = os.getpid()
    if me in _started:
        return
    root = str(Path(__file__).resolve().parent.parent)
    path = [root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    # its own session: Ctrl-C, a terminal's hangup or a signal to our process group does not
    # stop it before its job; no inherited fds: a pipe to our caller sees EOF when we die
    _started[me] = subprocess.Popen(
        [sys.executable, "-m", REAPER_MODULE, str(me)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,
        env=env,
    )
    logger.debug("reaper %d watches process %d", _started[me].pid, me)


def _parent_alive(parent: psutil.Process, ppid: int) -> bool:
    if parent.pid == ppid and os.getppid() != ppid:
        return False  # we were re-parented: our parent has exited
    try:
        return parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE  # is_running checks create_time
    except psutil.Error:
        return False


def _children(pid: int) -> list[int] | None:
    """``pid``'s children, read from ``/proc/PID/task/*/children`` (the files of its
    own threads: a few reads, where psutil's ``children`` reads every process on the
    machine: 1% of a core per watchdog at ``POLL_S``); None where the kernel has no
    such files."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []  # gone
    except OSError:
        return None
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if os.path.exists(f"/proc/{pid}/task/{tid}"):
                return None  # the thread is there, its children file is not: this kernel has none
            # else the thread ended meanwhile
        except (OSError, ValueError):
            continue
    return out


def descendants(parent: psutil.Process, me: int) -> dict[int, float]:
    """The parent's descendants but ``me``: pid -> creation time."""
    out: dict[int, float] = {}
    todo = _children(parent.pid)
    if todo is None:
        return {p.pid: p.create_time() for p in parent.children(recursive=True) if p.pid != me}
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        with contextlib.suppress(psutil.Error):
            out[pid] = psutil.Process(pid).create_time()
            todo += _children(pid) or []
    out.pop(me, None)
    return out


def _refresh(parent: psutil.Process, seen: dict[int, float], me: int) -> bool:
    """Record the parent's descendants; keep earlier ones that still run (a dead middle
    re-parents them). False where the scan did not finish (the next poll scans again)."""
    try:
        now = descendants(parent, me)
    except psutil.Error:
        return False  # the parent or a child went away mid-scan
    for pid, born in seen.items():
        if pid not in now and _same(pid, born) is not None:
            now[pid] = born
    seen.clear()
    seen.update(now)
    return True


def _same(pid: int, born: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one born at ``born`` and not a zombie."""
    try:
        p = psutil.Process(pid)
        if p.create_time() == born and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


#: the watchdog's module: its command line names it (``python -m``)
REAPER_MODULE = "fusionllm.reaper"
#: descendants that end by themselves once the processes they serve are gone, and clean
#: up as they do: torch's shared-memory manager (hivemind's MPFuture state uses it)
#: unlinks its segments in /dev/shm and its folder in /tmp; signalled, it leaked both
SELF_ENDING = frozenset({"torch_shm_manager"})
#: how long a ``SELF_ENDING`` process is left to end: torch's manager exits 2 s (its own
#: timer) after its last client is gone, which a wait of just ``GRACE_S`` tied with
SELF_END_S = 5.0


def _reap(seen: dict[int, float], grace_s: float) -> None:
    """SIGTERM every recorded process still running, then SIGKILL those left after
    ``grace_s``; a ``SELF_ENDING`` one is first given ``SELF_END_S`` to end by itself."""
    served = {pid: born for pid, born in seen.items() if _named(pid, born) in SELF_ENDING}
    _end({pid: born for pid, born in seen.items() if pid not in served}, grace_s)
    _end(served, SELF_END_S, (None,))
    _end(served, grace_s)


def self_ending(pid: int) -> bool:
    """Whether ``pid`` runs a ``SELF_ENDING`` program: one that, killed, leaves its
    segments in /dev/shm, and that ends by itself once the processes it serves are gone."""
    try:
        return psutil.Process(pid).name() in SELF_ENDING
    except psutil.Error:
        return False


def _named(pid: int, born: float) -> str | None:
    p = _same(pid, born)
    try:
        return p.name() if p is not None else None
    except psutil.Error:
        return None


def _end(
    seen: dict[int, float], grace_s: float, signals: tuple[int | None, ...] = (signal.SIGTERM, signal.SIGKILL)
) -> None:
    """Each signal (None: none, only the wait) to every process of ``seen`` still
    running, then up to ``grace_s`` for them to end."""
    for sig in signals:
        alive = [p for pid, born in seen.items() if (p := _same(pid, born)) is not None]
        for p in alive if sig is not None else []:
            try:
                p.send_signal(sig)  # psutil checks the pid was not reused
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if _same(p.pid, seen[p.pid]) is not None]
        if not alive:
            return


def watch(parent_pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
    """Watch ``parent_pid``; once it is gone, end every descendant it had."""
    me, ppid = os.getpid(), os.getppid()
    try:
        parent = psutil.Process(parent_pid)
    except psutil.Error:
        return
    seen: dict[int, float] = {}
    scanned: str | None = None  # the newest pid at the last finished scan
    for poll in itertools.count():
        if not _parent_alive(parent, ppid):
            break
        newest = last_pid()  # read before the scan: a fork during it shows at the next poll
        if newest is None or newest != scanned or poll % SCAN_EVERY == 0:
            scanned = newest if _refresh(parent, seen, me) else None
        time.sleep(poll_s)
    _reap(seen, grace_s)


def last_pid() -> str | None:
    """The pid (or thread id) the kernel handed out last (``/proc/loadavg``'s last
    field); None where it cannot be read. Unchanged since a scan, no process was
    created since, and the scan mostly still holds (``watch`` scans anyway every
    ``SCAN_EVERY`` polls: a child is linked to its parent a moment after its pid is
    handed out, and gVisor's loadavg never changes). The coordinator's watchdog scanned
    its 26 descendants' 104 threads (1.8 ms) five times a second, 1.2 ms of CPU per demo
    step."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[-1]
    except (OSError, IndexError):
        return None


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the parent handles these itself; we outlive it
    watch(int(sys.argv[1]))


if __name__ == "__main__":
    main()
