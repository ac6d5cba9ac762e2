"""A join line pasted on other machines (issue 30): a coordinator started with its
default flags, on the public side of the namespace lab (``tests/netlab.py``), prints
a ``fusionllm join`` line; run exactly as printed in two other namespaces, one on
the public side and one behind a home router's NAT, it trains to the end, equal to
one process."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import run_cli
from netlab import PUBLIC_IP, NatLab, missing
from swarmproc import SMALL, Proc

from fusionllm.local import compare_checkpoints
from protocol.net.hostaddrs import COORDINATOR_PORT

WHY = missing()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "")


def test_the_printed_join_line_works_from_other_machines(tmp_path: Path) -> None:
    steps, save = 4, tmp_path / "swarm.safetensors"
    common = ["--steps", str(steps), "--seed", "0", *SMALL]
    lab = NatLab(routers=1)
    procs: list[Proc] = []
    try:
        # HOME: the default key files and run directory, kept in the test's folder
        flags = [*common, "--min-peers", "2", "--save", str(save)]
        coord = Proc("coordinator", *flags, env={"HOME": str(tmp_path)}, netns=lab.pub)
        procs.append(coord)
        line = coord.wait_line(r"^\s+(fusionllm join .*)$").group(1)
        argv = shlex.split(line)
        for i, ns in enumerate([lab.routers[0], lab.hosts[0]]):  # on the public side; behind the NAT
            (tmp_path / f"p{i}").mkdir()
            procs.append(Proc(*argv[1:], env={"HOME": str(tmp_path / f"p{i}")}, netns=ns))
        assert coord.wait(240) == 0, coord.output[-3000:]
        for p in procs[1:]:
            p.wait(60)
    finally:
        for p in procs:
            p.kill_all()
        lab.close()
    assert not lab.leftovers(), "the lab's namespaces were removed"
    out = coord.output
    named = re.findall(r"/ip[46]/([^/]+)/tcp/(\d+)/p2p/", line)
    assert {ip for ip, _ in named} == {PUBLIC_IP, "10.77.1.1"}, line  # no loopback, no link-local
    assert {int(port) for _, port in named} == {COORDINATOR_PORT}, line
    assert f"other machines must reach TCP port {COORDINATOR_PORT} here" in out, out[-3000:]
    assert re.search(r"ssh -L (\d+):127\.0\.0\.1:\1 ", out), "how to reach the status page from elsewhere"
    assert "Traceback" not in out and len(re.findall(r"stage \d replica \d: peer", out)) == 2, out[-3000:]
    for p in procs[1:]:
        assert "Traceback" not in p.output and p.popen.returncode == 0, p.output[-2000:]
    assert "reachable: the coordinator dialled back" in procs[1].output, procs[1].output[-2000:]
    assert "behind a NAT: the coordinator could not dial back" in procs[2].output, procs[2].output[-2000:]
    ref = tmp_path / "ref.safetensors"
    assert run_cli("train", "--reference", *common, "--threads", "1", "--save", str(ref)).returncode == 0
    assert compare_checkpoints(save, ref) <= 1e-5
