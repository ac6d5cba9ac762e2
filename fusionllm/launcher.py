"""Start ``fusionllm`` processes without paying for their imports each time.

A process that trains imports torch, torch._dynamo (AdamW's first step does) and
hivemind: about 4.5 CPU-seconds, more than a small swarm's peers spend on anything
else before their first step. :class:`Launcher` starts one warm process (the
*zygote*, ``python -m fusionllm.zygote``) that imports all of that once, then
forks each command from there: a forked child is a separate process with its own
session, environment, working directory and standard streams, which runs the
command's module as ``python -m`` would, and exits as a fresh interpreter does.

The zygote forks only while it runs a single thread (a fork copies no other thread,
and a lock such a thread held would stay locked); if it ever runs more, or dies,
:meth:`Launcher.spawn` starts the command as a fresh interpreter instead. The
zygote is the caller's child and the commands its children, so a caller's reaper
(:mod:`fusionllm.reaper`) sees them all; it exits once the caller closes or dies.

A command forked from a zygote may start commands of its own (a demo its peers, a
benchmark its swarms): its :class:`Launcher` asks the same zygote, over a connection
of its own that the fork left open (named in ``ZYGOTE_ENV``), instead of starting
another zygote and paying for the imports again. The commands it starts so are the
zygote's children, not its own: when that connection closes (the command ended or was
killed, kill -9 included), the zygote kills those still running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

#: what the zygote imports before it forks anything: the commands' heavy imports
PRELOAD = (
    *("torch", "torch._dynamo", "torch.optim", "hivemind", "fusionllm.swarm_cmds", "fusionllm.commands"),
    *("peer.node", "coordinator.swarm"),  # what ``join`` and ``coordinator`` import once they run: 0.1-0.4 s each
)
#: read by the thread pools the preloaded libraries set up at import: a request that
#: asks for other values than the zygote imported with starts fresh
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
IMPORT_WAIT_S = 120.0  # the longest the first request waits for the zygote's imports, then starts fresh
FORK_WAIT_S = 10.0  # the longest a request waits for its fork once the zygote is ready
REAP_POLL_S = 0.05  # how often the zygote collects its exited children
MAX_MESSAGE = 1 << 20  # one request (argv, environment, cwd) or reply, in bytes
CLONE_NEWNET = 0x40000000  # setns(2)'s flag for a network namespace
#: in a forked command's environment: {"pid": the zygote, "fd": the command's own
#: connection to it, "pools": the zygote's IMPORT_TIME_ENV values}
ZYGOTE_ENV = "FUSIONLLM_ZYGOTE"
ZYGOTE_MODULE = "fusionllm.zygote"  # its command line, which each command it forks shows too
ROOT = str(Path(__file__).resolve().parent.parent)


class Child:
    """A command the zygote forked: the part of ``subprocess.Popen`` its callers use."""

    def __init__(self, pid: int, args: list[str], stdout: IO[str] | None) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        """Read stdout (a ``text_stdout`` pipe) to its end and wait for the exit."""
        text: list[str] = []
        if self.stdout is not None:
            stream = self.stdout
            reader = threading.Thread(target=lambda: text.append(stream.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(timeout)
        return ("".join(text) if self.stdout is not None else None), None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Started = Child | subprocess.Popen  # what spawn returns: forked when it could be, else a fresh interpreter


class Launcher:
    """One zygote, started now (its imports overlap with the caller's work), and the
    commands forked from it. ``env`` is the zygote's environment (give it
    ``OMP_NUM_THREADS=1``: more threads at import, and it cannot fork). A zygote not
    ready within ``IMPORT_WAIT_S``, or that has not forked a command within
    ``fork_wait_s`` once ready, is killed, and that command and every later one start
    fresh. ``close`` ends the zygote, not the commands."""

    def __init__(self, env: dict[str, str] | None = None, fork_wait_s: float = FORK_WAIT_S) -> None:
        self._fork_wait_s = fork_wait_s
        self._ready = threading.Event()  # the zygote has done its imports
        self._env = dict(os.environ if env is None else env)
        self._zygote: subprocess.Popen[bytes] | None = None  # None: the zygote this process was forked from
        shared = _inherited(self._env)
        if shared is not None:
            self._sock = shared
            self._ready.set()
        else:
            self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._zygote = _start_zygote(self._env, theirs)
            theirs.close()
        self._lock = threading.Lock()  # one request, one pid reply at a time
        self._pid_reply: list[dict[str, Any]] = []
        self._abandoned = 0  # requests given up on (no pid within fork_wait_s): their late forks are killed
        self._replied = threading.Condition()
        self._children: dict[int, Child] = {}
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="fusionllm-launcher", daemon=True)
        self._reader.start()

    def spawn(
        self,
        args: list[str],
        *,
        module: str = "fusionllm",
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        text_stdout: bool = False,
        netns: str | None = None,
    ) -> Started:
        """``python -m module *args`` in its own session, stdin from /dev/null, stdout
        to the file descriptor ``stdout`` (or, with ``text_stdout``, to a pipe whose
        reading end is the result's ``stdout``), stderr to ``stderr`` (default: where
        stdout goes), in the network namespace ``netns`` of ``ip netns`` where one is
        named (a fork enters it; a fresh start runs under ``ip netns exec``). The
        caller keeps its descriptors."""
        env = dict(os.environ if env is None else env)
        cwd = os.fspath(cwd or os.getcwd())
        read_end: int | None = None
        mine: list[int] = []  # descriptors opened here, closed once the child has its copies
        if text_stdout:
            read_end, stdout = os.pipe()
            mine.append(stdout)
        elif stdout is None:
            stdout = os.open(os.devnull, os.O_WRONLY)
            mine.append(stdout)
        fds = [stdout, stdout if stderr is None else stderr]
        try:
            child = self._fork(args, module, env, cwd, fds, netns)
            if child is None:
                return self._exec(args, module, env, cwd, fds, read_end, netns)
            child.stdout = open(read_end, encoding="utf-8", errors="replace") if read_end is not None else None
            return child
        finally:
            for fd in mine:
                os.close(fd)

    def run(
        self,
        args: list[str],
        *,
        module: str = "fusionllm",
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(..., capture_output=True, text=True)`` for a command: its
        exit code and both streams. After ``timeout`` it and every process below it are
        killed, and ``TimeoutExpired`` carries what it printed."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            child = self.spawn(args, module=module, env=env, cwd=cwd, stdout=out.fileno(), stderr=err.fileno())
            try:
                code: int | None = child.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(child.pid)
                child.wait()
                code = None
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read().decode("utf-8", errors="replace"))
        if code is None:
            raise subprocess.TimeoutExpired([module, *args], timeout or 0.0, output=texts[0], stderr=texts[1])
        return subprocess.CompletedProcess([module, *args], code, texts[0], texts[1])

    def _fork(
        self, args: list[str], module: str, env: dict[str, str], cwd: str, fds: list[int], netns: str | None
    ) -> Child | None:
        """The command forked by the zygote, or None where it cannot be (a fresh start then)."""
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd, "netns": netns}).encode()
        same_pools = all(env.get(k) == self._env.get(k) for k in IMPORT_TIME_ENV)
        with self._lock:
            if not self._ready.wait(IMPORT_WAIT_S):
                self._give_up()
            if not self._alive or not same_pools or len(request) > MAX_MESSAGE:
                return None
            try:
                socket.send_fds(self._sock, [request], fds)
            except OSError:
                return None
            with self._replied:
                if not self._replied.wait_for(lambda: self._pid_reply or not self._alive, self._fork_wait_s):
                    self._abandoned += 1  # its command starts fresh: a fork that comes later is a twin
                    self._give_up()
                reply = self._pid_reply.pop(0) if self._pid_reply else {}
        child = reply.get("child")
        if not isinstance(child, Child):
            return None
        child.args = [module, *args]
        return child

    def _give_up(self) -> None:
        """A stuck zygote (stopped, swapping) is ended (one this process was forked from is
        left, and asked no more): a late reply would answer the next request."""
        with self._replied:
            self._alive = False
        if self._zygote is not None:
            self._zygote.kill()

    @property
    def zygote_pid(self) -> int | None:
        """The zygote this launcher started (None: it asks the one its process was forked from)."""
        return None if self._zygote is None else self._zygote.pid

    @staticmethod
    def _exec(
        args: list[str],
        module: str,
        env: dict[str, str],
        cwd: str,
        fds: list[int],
        read_end: int | None,
        netns: str | None,
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=fds[0],
            stderr=fds[1],
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        if read_end is not None:
            proc.stdout = open(read_end, encoding="utf-8", errors="replace")
        return proc

    def _read(self) -> None:
        """The zygote's replies: a pid for each request, then each child's exit."""
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            reply = json.loads(data)
            if "ready" in reply:
                self._ready.set()
            elif "exit" in reply:
                child = self._children.pop(reply["exit"], None)
                if child is not None:
                    child._exited(int(reply["code"]))
            else:
                self._replied_with(reply)
        self._lost()

    def _replied_with(self, reply: dict[str, Any]) -> None:
        """A pid (or a refusal) for the oldest request. One given up on meanwhile started
        fresh: its fork, come late, would run beside it (CI saw a twin coordinator
        hold the run directory the one it watched needed), and is killed."""
        with self._replied:
            late, self._abandoned = self._abandoned > 0, max(0, self._abandoned - 1)
            if late:
                if isinstance(reply.get("pid"), int):
                    _kill_tree(reply["pid"])
                return
            if isinstance(reply.get("pid"), int):  # registered before the next reply (its exit) is read
                reply["child"] = self._children[reply["pid"]] = Child(reply["pid"], [], None)
            self._pid_reply.append(reply)
            self._replied.notify_all()

    def _lost(self) -> None:
        """The zygote is gone: later commands start fresh; the ones it forked are
        reparented, and are seen to end by polling."""
        with self._replied:
            self._alive = False
            self._replied.notify_all()
        self._ready.set()  # nothing to wait for
        for child in list(self._children.values()):
            if child.returncode is None:
                threading.Thread(target=_poll_orphan, args=(child,), daemon=True).start()

    def close(self) -> None:
        """End the zygote now (mid-import, too); commands it forked run on. A zygote this
        process was forked from runs on, and kills the commands it forked for us."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote.wait()


def _start_zygote(env: dict[str, str], theirs: socket.socket) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(theirs.fileno(),),
        start_new_session=True,  # a Ctrl-C to the caller's group is the caller's to handle
        env={**env, "PYTHONPATH": _pythonpath(env)},
    )


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace ``name`` of ``ip
    netns`` (``/run/netns/NAME``): the network namespace only (``ip netns exec`` also
    remounts ``/sys`` and binds ``/etc/netns/NAME``'s files, which nothing here reads);
    OSError (one line) where it cannot (no such namespace, not root)."""
    import ctypes

    if not name or "/" in name or name in (".", ".."):
        raise OSError(f"not a network namespace's name: {name!r}")
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    except FileNotFoundError:
        raise OSError(f"no network namespace {name} (/run/netns/{name})") from None
    except OSError as exc:
        raise OSError(f"cannot open network namespace {name}: {exc.strerror}") from None
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(f"cannot enter network namespace {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def pool_settings(env: dict[str, str] | os._Environ[str]) -> dict[str, str | None]:
    """``env``'s thread settings (``IMPORT_TIME_ENV``): a zygote serves only requests with its own."""
    return {k: env.get(k) for k in IMPORT_TIME_ENV}


def _inherited(env: dict[str, str]) -> socket.socket | None:
    """This process's own connection to the zygote it was forked from, if it has one that
    imported with ``env``'s thread settings (the variable alone proves nothing: a process
    started some other way may carry it, and the descriptor be closed or another file)."""
    try:
        named = json.loads(os.environ.get(ZYGOTE_ENV, "null"))
        pid, fd, pools = int(named["pid"]), int(named["fd"]), named["pools"]
    except (ValueError, TypeError, KeyError):
        return None
    if pools != pool_settings(env):
        return None
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # not a socket
        os.close(copy)
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        same = sock.type == socket.SOCK_SEQPACKET and struct.unpack("3i", creds)[0] == pid
    except OSError:
        same = False
    if not same:
        sock.close()
        return None
    os.close(fd)  # the duplicate is ours: a second Launcher here starts its own zygote
    os.environ.pop(ZYGOTE_ENV, None)
    return sock


def _poll_orphan(child: Child) -> None:
    import psutil

    while child.returncode is None:
        try:
            if psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        child._done.wait(0.2)
    if child.returncode is None:
        child._exited(-1)  # its status went to whoever reaped it


def _kill_tree(pid: int) -> None:
    """SIGKILL a command and every process below it (some run sessions of their own),
    but torch's shared-memory manager and the command's watchdog: the manager ends by
    itself once the rest are gone, unlinking its segments in /dev/shm (killed, it left
    them), and the watchdog, its command gone, ends one that does not (``reaper.SELF_END_S``)."""
    import psutil

    try:
        below = [p for p in psutil.Process(pid).children(recursive=True) if not _spared(p)]
    except psutil.Error:
        below = []
    for kill in (os.killpg, os.kill):  # its session, or itself alone if it has none yet
        try:
            kill(pid, signal.SIGKILL)
            break
        except (ProcessLookupError, PermissionError):
            pass
    for proc in below:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _spared(proc: Any) -> bool:
    """Whether ``_kill_tree`` leaves the psutil process ``proc`` to end by itself: torch's
    shared-memory manager, or a command's watchdog (``fusionllm.reaper``)."""
    import psutil

    from fusionllm.reaper import REAPER_MODULE, self_ending

    try:
        return self_ending(proc.pid) or REAPER_MODULE in proc.cmdline()
    except psutil.Error:
        return False


def _pythonpath(env: dict[str, str]) -> str:
    entries = [ROOT, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return os.pathsep.join(dict.fromkeys(entries))
