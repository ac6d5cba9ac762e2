"""The zygote that :class:`fusionllm.launcher.Launcher` starts (``python -m
fusionllm.zygote FD``): it imports ``PRELOAD`` once, then forks one child per request
that comes over its connections (the caller's, and each child's own, named in the
child's ``ZYGOTE_ENV``); a child becomes the command it was asked for."""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

from fusionllm.launcher import MAX_MESSAGE, PRELOAD, REAP_POLL_S, ZYGOTE_ENV, enter_netns, pool_settings


def _single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork one child per request until the caller closes; returns (in a child only)
    the request the child is to run. Each child gets a connection of its own, for the
    commands it starts in turn; when one closes, the commands asked on it are killed."""
    conns = [sock]
    asked: dict[int, socket.socket | None] = {}  # each child -> the connection that asked (None: closed)
    while True:
        ready, _, _ = select.select(conns, [], [], REAP_POLL_S)
        _reap(asked)
        for conn in ready:
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data and conn is sock:
                return None
            if not data:
                _hang_up(conns, asked, conn)
            elif len(fds) != 2 or not _single_threaded():
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"error": "cannot fork"}).encode())
            else:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                pid = os.fork()
                if pid == 0:
                    for other in [*conns, ours]:
                        other.close()
                    request = json.loads(data)
                    _become(request, fds, theirs)
                    return request
                for fd in fds:
                    os.close(fd)
                theirs.close()
                asked[pid] = conn
                conns.append(ours)
                conn.send(json.dumps({"pid": pid}).encode())


def _reap(asked: dict[int, socket.socket | None]) -> None:
    """Collect exited children and tell the connection that asked for each."""
    for pid, conn in list(asked.items()):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if not done:
            continue
        del asked[pid]
        try:
            if conn is not None:
                conn.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass


def _hang_up(conns: list[socket.socket], asked: dict[int, socket.socket | None], conn: socket.socket) -> None:
    """A command's connection closed (it ended, or was killed): the commands it started
    through us die with it, each with its session (``_reap`` collects them)."""
    for pid in [p for p, c in asked.items() if c is conn]:
        asked[pid] = None
        for kill in (os.killpg, os.kill):  # its session; or itself, if it has not made one yet
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    conns.remove(conn)
    conn.close()


def _become(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In a fresh fork: the session, network namespace, streams, environment and state
    of a new process, and its own connection to the zygote (``ZYGOTE_ENV``; none in
    another namespace)."""
    import random

    os.setsid()
    if request.get("netns"):
        try:
            enter_netns(request["netns"])
        except OSError as exc:  # the command never runs in the wrong namespace
            os.write(fds[1], f"fusionllm: error: {exc}\n".encode())
            os._exit(2)
    pools = pool_settings(os.environ)  # the zygote's, with which it imported
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in enumerate([devnull, *fds]):
        os.dup2(fd, target)
    for fd in {devnull, *fds} - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    fd = conn.detach()
    if request.get("netns"):  # what it starts must run in its namespace: a zygote of its own there, not ours
        os.close(fd)
        os.environ.pop(ZYGOTE_ENV, None)
    else:
        os.environ[ZYGOTE_ENV] = json.dumps({"pid": os.getppid(), "fd": fd, "pools": pools})
    os.chdir(request["cwd"])
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    random.seed()  # the fork copied the zygote's generator: each process draws its own
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    _own_cross_process_locks()
    sys.argv = [request["module"], *request["args"]]


def _own_cross_process_locks() -> None:
    """hivemind makes its MPFuture locks at import: semaphores that every process forked
    from the zygote would share. One command killed while it held one (each DHT call
    takes one; tests and users kill -9) left every later DHT start forked from the same
    zygote waiting for good: CI saw a coordinator print nothing for 180 s and a demo
    time out, on one worker. Each command gets locks of its own (shared, as hivemind
    means them to be, with its own DHT process)."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # its two locks and SharedBytes' one
    aio = sys.modules.get("hivemind.utils.asyncio")
    if aio is not None:
        aio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # what the imports made is never collected: a child's collections leave those pages shared
    sock.send(json.dumps({"ready": True}).encode())
    request = _serve(sock)
    if request is None:
        return  # the caller closed: the commands run on by themselves
    os._exit(_run(request))


def _run(request: dict[str, Any]) -> int:
    """The command, then the exit a fresh interpreter makes (threads joined, atexit
    handlers, streams flushed) less its teardown of every module: that would touch,
    and so copy, each page the child shares with the zygote (about 1.5 s)."""
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as multiprocessing's children do
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _main()
