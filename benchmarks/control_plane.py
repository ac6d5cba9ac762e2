"""The coordinator's control plane under a synthetic load (issue 33): a real coordinator
process (``fusionllm coordinator``, waiting for more peers than will come, so that it
only takes their messages) and ``peers`` lightweight peers in this process, each a
libp2p node with its own key that says hello and then sends signed heartbeats at
``rate`` per second. The coordinator's CPU-seconds (its Python process, and with its
p2p daemon and DHT process) come from /proc over a quiet window and a loaded one of
the same length; their difference over the messages sent is the CPU one control
message costs, which ``discovery_cost.control_cpu``'s rates turn into CPU per 1,000
peers. (A heartbeat and a step report cost the coordinator alike: one small signed
frame, decoded, gated and verified.)"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path

import psutil
from hivemind.p2p import P2P

from protocol.net.transport import Transport
from protocol.trust.identity import Identity
from protocol.wire.gate import Gate
from protocol.wire.messages import Beat, Hello
from tests.swarmproc import Proc

RUN = "control-bench"
#: the coordinator's model: the smallest (it never plans; its size only sets start-up time)
MODEL = ["--model-args", "n_layer=2,n_embd=64,n_head=4"]
#: the longest the coordinator may take to print its join line
START_S = 120.0

logger = logging.getLogger(__name__)


def _cpu_s(pid: int) -> tuple[float, float]:
    """User plus system CPU-seconds so far of process ``pid`` and of it with its children."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    times = []
    for p in procs:
        try:
            t = p.cpu_times()
            times.append(t.user + t.system)
        except psutil.Error:
            times.append(0.0)
    return times[0], sum(times)


class Coordinator:
    """A coordinator that waits for peers forever, started at once (its start may
    overlap other work) and measured by ``measure``, which ends it; ``close`` ends it
    where ``measure`` never ran."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        args = ["--run", RUN, "--min-peers", "100000", "--peer-wait", "3600", "--port", "0", "--status-port", "0"]
        self.proc = Proc("coordinator", *args, "--identity", str(tmp / "c.key"), "--run-dir", str(tmp / "run"), *MODEL)

    def measure(self, peers: int, rate: float, seconds: float) -> dict[str, float]:
        """The coordinator's CPU per control message, measured (see the module's text)."""
        try:
            maddr = self.proc.wait_line(r"--initial-peers (\S+)", START_S).group(1)  # its maddr, with /p2p/<id>
            return asyncio.run(_load(maddr, peers, rate, seconds, self.proc.popen.pid))
        finally:
            self.close()

    def close(self) -> None:
        self.proc.kill_all()  # with its DHT process and p2p daemons
        self._tmp.cleanup()


async def _peer(maddr: str) -> tuple[Transport, str]:
    """A lightweight peer that said hello to the coordinator at ``maddr``."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    who = Identity.generate()
    tp = Transport(p2p, who, Gate(RUN))
    await tp.start()
    coordinator = maddr.rsplit("/p2p/", 1)[1]
    tp.learn(coordinator, [maddr])
    mine = [str(m) for m in await p2p.get_visible_maddrs()]
    await tp.send(coordinator, Hello(RUN, who.public_hex, maddrs=mine))
    return tp, coordinator


async def _load(maddr: str, peers: int, rate: float, seconds: float, pid: int) -> dict[str, float]:
    """The coordinator's CPU-seconds (process ``pid``, and with its children) over a
    quiet window and a loaded one (``seconds`` each), and the heartbeats sent."""
    made = await asyncio.gather(*(_peer(maddr) for _ in range(peers)))
    await asyncio.sleep(min(3.0, seconds))  # the hellos taken, the dial-backs done
    t0 = _cpu_s(pid)
    await asyncio.sleep(seconds)
    t1 = _cpu_s(pid)
    sent = [0]

    async def beat(tp: Transport, coordinator: str) -> None:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            await tp.send(coordinator, Beat(RUN, sent[0], 0))
            sent[0] += 1
            await asyncio.sleep(1.0 / rate)

    await asyncio.gather(*(beat(tp, c) for tp, c in made))
    t2 = _cpu_s(pid)
    for tp, _ in made:
        await tp.aclose()
        await tp.p2p.shutdown()
    n = max(sent[0], 1)
    return {
        "control_messages": sent[0],
        "coordinator_cpu_s_per_message": max(0.0, (t2[0] - t1[0]) - (t1[0] - t0[0])) / n,
        "coordinator_tree_cpu_s_per_message": max(0.0, (t2[1] - t1[1]) - (t1[1] - t0[1])) / n,
        "coordinator_quiet_cpu": (t1[0] - t0[0]) / seconds,
    }


def measure(peers: int, rate: float, seconds: float) -> dict[str, float]:
    """The coordinator's CPU per control message, measured (see the module's text)."""
    return Coordinator().measure(peers, rate, seconds)
