"""The coordinator is pinned (issue 16, item 1): the join command carries its key, and
a pinned peer cannot be captured by an outsider's coordinator record for the same
run; an unpinned peer trusts on first use only when one coordinator claims the run."""

from __future__ import annotations

from pathlib import Path

import hivemind
from hivemind.utils import get_dht_time

from protocol.identity import Identity, sign_record
from protocol.messages import CoordinatorRecord, dht_key
from tests.swarmproc import SMALL, Proc, Swarm


def _claim_the_run(swarm: Swarm, run: str) -> hivemind.DHT:
    """An outsider's DHT node that publishes its own, validly signed, coordinator record
    for the run (pointing at itself)."""
    initial = swarm.join_args[swarm.join_args.index("--initial-peers") + 1]
    dht = hivemind.DHT(initial_peers=[initial], start=True)
    outsider = Identity.generate()
    expires = get_dht_time() + 600
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    record = sign_record(outsider, CoordinatorRecord(dht.peer_id.to_base58(), maddrs, run, expires).header())
    assert dht.store(dht_key(run, "coordinator"), record, expires, subkey=outsider.public_hex)
    return dht


def _unpinned(join_args: list[str]) -> list[str]:
    i = join_args.index("--coordinator-key")
    return join_args[:i] + join_args[i + 2 :]


def test_an_outsiders_coordinator_record_does_not_capture_a_pinned_peer(tmp_path: Path) -> None:
    args = ["--steps", "3", "--seed", "0", *SMALL, "--min-peers", "2", "--run-dir", str(tmp_path / "run")]
    swarm = Swarm(tmp_path, args, peers=0)
    outsider = None
    try:
        key = swarm.join_args[swarm.join_args.index("--coordinator-key") + 1]
        assert len(key) == 64
        outsider = _claim_the_run(swarm, "fusionllm")
        unpinned = Proc("join", *_unpinned(swarm.join_args), "--identity", str(tmp_path / "u.key"))
        swarm.procs.append(unpinned)
        assert unpinned.wait(120) == 2
        line = unpinned.wait_line(r"fusionllm: error: .*")
        assert "2 coordinators claim run 'fusionllm'" in line.group(0) and "--coordinator-key" in line.group(0)
        for i in range(2):  # pinned: they find and train with the real one
            swarm.add_peer(i)
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        assert "Traceback" not in swarm.coord.output
    finally:
        if outsider is not None:
            outsider.shutdown()
        swarm.close()


def test_an_unpinned_peer_says_it_trusts_on_first_use(tmp_path: Path) -> None:
    args = ["--steps", "2", "--seed", "0", *SMALL, "--min-peers", "1", "--run-dir", str(tmp_path / "run")]
    swarm = Swarm(tmp_path, args, peers=0)
    try:
        key = swarm.join_args[swarm.join_args.index("--coordinator-key") + 1]
        peer = Proc("join", *_unpinned(swarm.join_args), "--identity", str(tmp_path / "p.key"))
        swarm.procs.append(peer)
        line = peer.wait_line(r"trusting the coordinator of run 'fusionllm' on first use: key (\w+)", 120)
        assert line.group(1) == key
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
    finally:
        swarm.close()
