"""Running a command's coroutine on an event loop (``run_async``): Ctrl-C and SIGTERM
stop it, once it has its exit code the process ends within ``EXIT_GRACE_S``, and
whatever kills it, what it started dies too (``fusionllm.reaper``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

from fusionllm.reaper import exit_within, start_reaper, watch_exit
from fusionllm.usage import EXIT_INTERRUPTED
from protocol.trust.text import clean

logger = logging.getLogger(__name__)

_command_pid = 0  # the process that installed ``_interrupted`` (forked children inherit it)


def _interrupted(signum: int, frame: Any) -> None:
    """The first Ctrl-C or SIGTERM is raised as KeyboardInterrupt from a callback of the
    command's event loop. Raised here, it could land in a protocol's callback, which
    uvloop runs under ``except BaseException``: it was lost, and the command ran on
    until ``EXIT_GRACE_S`` ended it (seen about once in eight interrupted demos)."""
    if _in_a_child(signum):
        return
    exit_within(EXIT_INTERRUPTED)  # however the shutdown goes, it ends
    if _command_loop and not _command_loop[0].is_closed() and not _interrupt_asked:
        _interrupt_asked.append(signum)
        _command_loop[0].call_soon_threadsafe(_raise_interrupt)
        return
    raise KeyboardInterrupt


def _raise_interrupt() -> None:
    if _command_loop:  # (not once the command has its outcome: a signal then is ``_shutting_down``'s)
        raise KeyboardInterrupt


_command_loop: list[asyncio.AbstractEventLoop] = []  # the loop running the command's coroutine
_interrupt_asked: list[int] = []  # a signal asked the loop to raise KeyboardInterrupt


def _in_a_child(signum: int) -> bool:
    """In hivemind's DHT child (forked, it inherits the handlers): the signal's default (it ends)."""
    if os.getpid() == _command_pid:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


def _shutting_down(signum: int, frame: Any) -> None:
    """A signal while the event loop shuts down after the command has its exit code (a
    demo stops its peers as their runs end): the first is ignored, the loop's shutdown
    goes on and the process ends with that code (within ``EXIT_GRACE_S`` however it
    goes); a second (Ctrl-C again) ends it at once with that code. Raised as
    KeyboardInterrupt there, it stopped uvloop's executor shutdown half way, and a
    thread's traceback went into the peer's log."""
    if _in_a_child(signum):
        return
    if _signalled_in_shutdown:
        os._exit(_ended[0])
    _signalled_in_shutdown.append(signum)


_signalled_in_shutdown: list[int] = []


async def _bounded(coro: Coroutine[Any, Any, int]) -> int:
    """``coro``'s exit code; once it has one, the process ends within ``EXIT_GRACE_S``
    (the event loop's own shutdown cancels and awaits every task first)."""
    code = 1
    asyncio.get_running_loop().set_exception_handler(_one_line)
    _command_loop[:] = [asyncio.get_running_loop()]
    try:
        code = await coro
        return code
    except (KeyboardInterrupt, asyncio.CancelledError):
        code = EXIT_INTERRUPTED
        raise
    finally:
        exit_within(code)
        _ended[0] = code
        if os.getpid() == _command_pid:  # run_async's own process, on its main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _shutting_down)
        _command_loop.clear()


def _one_line(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's own reports (a task that failed with no one awaiting it, a callback
    that raised): one warning line; the traceback only at debug level."""
    exc = context.get("exception")
    what = f"{type(exc).__name__}: {exc}" if exc is not None else ""
    coro = getattr(context.get("future"), "get_coro", lambda: None)()
    where = f" (in {coro.__qualname__})" if coro is not None else ""
    logger.warning("%s%s %s", clean(str(context.get("message", "asyncio"))), where, clean(what)[:500])
    logger.debug("asyncio's report in full: %s", context, exc_info=exc)


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine; Ctrl-C (even where a shell started us with SIGINT
    ignored) and SIGTERM stop it, and whatever kills us, the DHT child, p2pd and the
    peers a demo started die too."""
    global _command_pid
    start_reaper()
    watch_exit()
    _command_pid = os.getpid()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    code = EXIT_INTERRUPTED
    try:
        try:
            import uvloop

            code = uvloop.run(_bounded(coro))
        except ImportError:  # no uvloop on this platform
            code = asyncio.run(_bounded(coro))
        return code
    finally:
        _ended[0] = code
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _after_the_end)


_ended = [EXIT_INTERRUPTED]  # the finished command's exit code (for ``_after_the_end``)


def _after_the_end(signum: int, frame: Any) -> None:
    """A signal once the command is over (a demo stops its peers as their own exit runs
    the interpreter's exit hooks): end now with the command's code, no traceback."""
    os._exit(_ended[0])
