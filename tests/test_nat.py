"""Across NATs (issue 15), on a small internet of network namespaces
(``tests/netlab.py``: a public side, and home routers doing source NAT with
nftables masquerade, one host behind each). The coordinator dials each peer back
to find out whether others can reach it; a peer behind a NAT dials out to the
peers it works with, and two such peers exchange their signed frames through the
coordinator. The swarm ends equal to one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_cli
from netlab import PUBLIC_IP, NatLab, missing
from swarmproc import SMALL, Proc

from fusionllm.local import compare_checkpoints

WHY = missing()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "")


def _peer_line(out: str, peer: str) -> re.Match[str] | None:
    return re.search(rf"stage (\d) replica (\d): peer {peer}", out)


@pytest.mark.parametrize("direct", [0, 1], ids=["two-peers-behind-nats", "with-a-direct-peer"])
def test_peers_behind_nats_train_equal_to_one_process(tmp_path: Path, direct: int) -> None:
    """Two peers behind two home routers (and, in the second case, one peer on the
    public side), public links shaped to 200 Mbit/s: the coordinator finds who is
    behind a NAT, those dial out, and two stages put the two NAT'd peers on one
    boundary (or, with the direct peer, make them replicas or neighbours), so their
    frames are forwarded. Compression off: the weights equal ``train --reference``'s."""
    steps, save, stages = 6, tmp_path / "swarm.safetensors", 2
    common = ["--steps", str(steps), "--seed", "0", *SMALL]
    lab = NatLab(routers=2, mbps=200)
    procs: list[Proc] = []
    try:
        stage_args = ["--min-peers", str(2 + direct), "--stages", str(stages)]
        key = str(tmp_path / "c.key")
        net_args = ["--host-maddrs", f"/ip4/{PUBLIC_IP}/tcp/0", "--identity", key, "--status-port", "0"]
        run_args = ["--compression", "none", "--save", str(save), "--run-dir", str(tmp_path / "run")]
        coord = Proc("coordinator", *common, *stage_args, *net_args, *run_args, netns=lab.pub)
        procs.append(coord)
        join = coord.wait_line(r"^\s+fusionllm join (.*)$").group(1).split()
        where = [(lab.hosts[r], lab.host_ip(r + 1)) for r in range(2)] + [(lab.pub, PUBLIC_IP)] * direct
        for i, (ns, ip) in enumerate(where):
            peer_args = ["--identity", str(tmp_path / f"p{i}.key"), "--host-maddrs", f"/ip4/{ip}/tcp/0"]
            procs.append(Proc("join", *join, "--threads", "1", *peer_args, netns=ns))
        ids = [p.wait_line(r"joined run '.*' as (\w+)", 120).group(1) for p in procs[1:]]
        for p in procs[1:3]:
            p.wait_line(r"behind a NAT: the coordinator could not dial back 10\.77\.\d\.2:\d+", 60)
        if direct:
            procs[3].wait_line(r"reachable: the coordinator dialled back at 10\.77\.0\.1:\d+", 60)
        assert coord.wait(300) == 0, coord.output[-3000:]
        out = coord.output
        for p in procs[1:]:
            p.wait(60)
    finally:
        for p in procs:
            p.kill_all()
        lab.close()
    assert not lab.leftovers(), "the lab's namespaces were removed"
    assert "Traceback" not in out and all(_peer_line(out, p) for p in ids), out[-3000:]
    if not direct:
        natted = {int(_peer_line(out, p).group(1)) for p in ids}  # type: ignore[union-attr]
        assert natted == {0, 1}, "one NAT'd peer per stage: their boundary is forwarded"
    else:
        assert re.search(rf"peer {ids[2]} \(.*, direct\)", out), out[-2000:]
    assert all(re.search(rf"peer {p} \(.*, forwarded\)", out) for p in ids[:2]), out[-2000:]
    forwarded = re.search(r"forwarded ([\d.]+) MB between peers behind NATs", out)
    assert forwarded and float(forwarded.group(1)) > 0, out[-2000:]
    for p in procs[1:3]:
        assert re.search(r"dialled out to (\d+) of its \1 reachable neighbours", p.output), p.output[-2000:]
        assert "Traceback" not in p.output and p.popen.returncode == 0, p.output[-2000:]
    ref = tmp_path / "ref.safetensors"
    assert run_cli("train", "--reference", *common, "--threads", "1", "--save", str(ref)).returncode == 0
    assert compare_checkpoints(save, ref) <= 1e-5


def test_the_nat_benchmark_stopped_by_sigterm_removes_its_namespaces() -> None:
    """``kill PID`` of ``benchmarks/nat.py`` mid-run unwinds it: its lab's namespaces go
    with its processes (it used to leave them for the next run to remove)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    bench = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "nat.py"), "--short"], cwd=ROOT)
    mine = re.compile(rf"fl(?:pub|r\d+x|h\d+x){bench.pid % 100000}")  # tests/netlab.py's names
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_namespaces(mine)) < 5:
            time.sleep(0.1)
        assert len(_namespaces(mine)) == 5, "the benchmark never built its lab"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) != 0
        assert _namespaces(mine) == [], "namespaces left behind"
    finally:
        bench.kill()
        bench.wait()


def _namespaces(mine: re.Pattern[str]) -> list[str]:
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in listed if mine.fullmatch(n)]
