"""A pytest plugin that records which tests start processes, for issue 29's "every
test that starts processes passes five runs in a row" (CONTRIBUTING.md, "Five runs").

Load it with ``PYTHONPATH=tests PYTEST_ADDOPTS="-p procspy" PROCSPY_OUT=PREFIX``: each
pytest process (each xdist worker) writes ``PREFIX.<worker>.json`` with the node ids of
the tests that forked, exec'd or posix-spawned a process, started one through the
launcher's zygote, or had a child process (other than the zygote and its reaper) alive
when their body began or ended; and every test's outcome. Not loaded by default."""

from __future__ import annotations

import _posixsubprocess
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from fusionllm import launcher

_current: dict[str, str | None] = {"id": None}
_started: set[str] = set()
_outcomes: dict[str, str] = {}
_LONG_LIVED = ("fusionllm.zygote", "fusionllm.reaper")  # started once, shared by every test


def _mark() -> None:
    if _current["id"] is not None:
        _started.add(_current["id"])


def _wrap(owner: Any, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark()
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


for _owner, _name in ((_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec"), (os, "fork")):
    _wrap(_owner, _name)
if hasattr(os, "posix_spawn"):
    _wrap(os, "posix_spawn")
_wrap(launcher.Launcher, "_fork")


def _live_children() -> bool:
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if not any(name in line for name in _LONG_LIVED):
            return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current["id"] = item.nodeid
    yield
    _current["id"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if _live_children():
        _mark()
    yield
    if _live_children():
        _mark()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if (report.when == "call" or report.outcome != "passed") and _outcomes.get(report.nodeid) in (None, "passed"):
        _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PROCSPY_OUT")
    if out:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{out}.{worker}.json", "w") as f:
            json.dump({"started": sorted(_started), "outcomes": _outcomes}, f)
