"""The status page cannot slow training (issue 35): it is served by a process of its
own, reads the board at most once a second whatever the request rate, closes
connections that never finish their request head, caps connections per client, and
dies with the coordinator. (Steps/s under a flood against the same run's clean
windows is ``benchmarks/adversary.py``'s ``status_flood_ratio``.)"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from coordinator.status import StatusBoard
from coordinator.web import StatusServer
from coordinator.webserve import CLIENT_REQUEST_BURST, CLIENT_REQUESTS_PER_S, HEADER_TIMEOUT_S, MAX_PER_CLIENT, Limits
from tests.conftest import ROOT
from tests.statusflood import slowloris
from tests.swarmproc import SMALL, Proc, Swarm, api, wait_for, wait_gone


def _board() -> StatusBoard:
    board = StatusBoard("run", steps=100)
    ad = SimpleNamespace(device="cpu", flops=2e10, up_mbps=100.0, down_mbps=200.0, maddrs=["/ip4/1.2.3.4/tcp/5"])
    board.saw_adverts({"a": ad})
    return board


def _get(url: str, source: str = "") -> tuple[int, bytes]:
    parts = url.split("/")[2].rsplit(":", 1)
    conn = http.client.HTTPConnection(
        parts[0], int(parts[1]), timeout=20, source_address=(source, 0) if source else None
    )
    try:
        conn.request("GET", "/" + url.split("/", 3)[3])
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_the_board_is_read_at_most_once_a_second_whatever_the_request_rate() -> None:
    board = _board()
    reads = []
    state = board.state
    board.state = lambda: reads.append(time.monotonic()) or state()  # type: ignore[method-assign]

    async def main() -> tuple[list[int], int, int]:
        server = StatusServer(board, port=0)
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            with ThreadPoolExecutor(4) as pool:
                calls = [
                    loop.run_in_executor(pool, _get, server.url + path) for path in ["api/v1/state", "metrics"] * 100
                ]
                codes = [code for code, _ in await asyncio.gather(*calls)]
            step_before = json.loads((await loop.run_in_executor(None, _get, server.url + "api/v1/state"))[1])
            board.step_done(0, 2.5, 0.1, 100, [])
            await asyncio.sleep(1.1)  # the next request gets a fresh snapshot
            after = json.loads((await loop.run_in_executor(None, _get, server.url + "api/v1/state"))[1])
            return codes, step_before["training"]["step"], after["training"]["step"]
        finally:
            await server.aclose()

    t0 = time.monotonic()
    codes, before, after = asyncio.run(main())
    took = time.monotonic() - t0
    assert codes == [200] * 200
    assert (before, after) == (0, 1)
    assert len(reads) <= took + 1, f"{len(reads)} reads of the board in {took:.1f} s"
    assert all(b - a >= 0.95 for a, b in zip(reads, reads[1:])), reads


def test_limits_cap_connections_in_all_and_per_client() -> None:
    limits = Limits(total=3, per_client=2)
    assert limits.take("a") and limits.take("a") and not limits.take("a")
    assert limits.take("b") and not limits.take("c"), "the total cap"
    limits.give("a")
    assert limits.take("c") and limits.refused == 2 and limits.open == {"a": 1, "b": 1, "c": 1}


def test_the_page_process_dies_with_the_coordinator(tmp_path: Path) -> None:
    """kill -9 of the process that started the page ends the page's process too."""
    script = (
        "import asyncio\nfrom coordinator.status import StatusBoard\nfrom coordinator.web import StatusServer\n"
        "async def main():\n    s = StatusServer(StatusBoard('r', 1), port=0)\n    await s.start()\n"
        "    print(s.pid, flush=True)\n    await asyncio.sleep(60)\nasyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        assert not wait_gone({child}, 10), "the page's process outlived its coordinator"
    finally:
        proc.kill()
        proc.wait()


def _watch_slow(socks: list[socket.socket], t0: float, seconds: float) -> dict[int, float]:
    """Keep ``socks`` slow (a header line each second) for up to ``seconds``: when each
    was closed on us, in seconds from ``t0``."""
    closed: dict[int, float] = {}
    last_trickle = 0.0
    while len(closed) < len(socks) and time.monotonic() - t0 < seconds:
        open_ = [s for s in socks if s.fileno() not in closed]
        ready, _, _ = select.select(open_, [], [], 0.2)
        for s in ready:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                closed[s.fileno()] = time.monotonic() - t0
        if time.monotonic() - last_trickle >= 1.0:
            last_trickle = time.monotonic()
            for s in open_:
                try:
                    s.send(b"X-Slow: 1\r\n")
                except OSError:
                    closed.setdefault(s.fileno(), time.monotonic() - t0)
    return closed


def test_a_status_flood_and_a_slowloris_while_training(tmp_path: Path) -> None:
    """A 2-peer swarm trains while an outsider floods its page (>= 2,000 requests/s
    written whatever the answers) and holds slow connections from another address: the
    slow ones are closed within the header timeout (those over the per-client cap at
    once), the flooder is answered at its own address's budget, the page still answers
    a third address at once, and training goes on."""
    training = ["--steps", "100000", "--seed", "0", *SMALL, "--min-peers", "2", "--spot-check", "0"]
    # no rebalancing: the page must answer "training", and a move (on by default) plans for a moment
    swarm = Swarm(tmp_path, [*training, "--checkpoint-every", "0", "--rebalance-every", "0"], peers=2)
    try:
        wait_for(swarm.url, lambda s: s["training"]["step"] >= 3, timeout=120)
        before = api(swarm.url)["training"]["step"]
        flooder = Proc(swarm.url, "--rate", "2500", "--seconds", str(HEADER_TIMEOUT_S + 3), module="tests.statusflood")
        swarm.procs.append(flooder)
        flooder.wait_line("^flooding$", 30)
        t0 = time.monotonic()
        slow = slowloris(swarm.url, MAX_PER_CLIENT + 8, source="127.0.0.3")
        code, body = _get(swarm.url + "api/v1/state", source="127.0.0.2")
        assert code == 200 and json.loads(body)["phase"] == "training"
        closed = sorted(_watch_slow(slow, t0, HEADER_TIMEOUT_S + 3).values())
        for s in slow:
            s.close()
        assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections still open"
        assert closed[7] < 2.0, f"those over the per-client cap are closed at once: {closed}"
        assert closed[-1] <= HEADER_TIMEOUT_S + 2.0, closed
        tally = json.loads(flooder.wait_line(r"^\{.*\}$", 30).group(0))
        assert tally["written_per_s"] >= 2000, tally  # the flood was offered whatever the answers
        budget = CLIENT_REQUESTS_PER_S + CLIENT_REQUEST_BURST / tally["seconds"]
        assert 0 < tally["answers_per_s"] <= budget, tally  # answered, at the flooder's own budget
        assert _get(swarm.url + "metrics", source="127.0.0.2")[0] == 200
        wait_for(swarm.url, lambda s: s["training"]["step"] >= before + 10, timeout=30)
    finally:
        swarm.close()
