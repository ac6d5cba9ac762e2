"""What a volunteer trusts (issue 16): the coordinator is pinned (the join command
carries its key; an outsider's coordinator record for the same run cannot capture a
pinned peer; an unpinned peer trusts on first use only when one coordinator claims
the run), and a peer imports no model code it did not opt in to."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from protocol.net.dhtstart import start_dht
from protocol.trust.identity import Identity, sign_record
from protocol.wire.messages import CoordinatorRecord, dht_key
from tests.conftest import ROOT
from tests.swarmproc import SMALL, Proc, Swarm, join_together


def _claim_the_run(swarm: Swarm, run: str) -> hivemind.DHT:
    """An outsider's DHT node that publishes its own, validly signed, coordinator record
    for the run (pointing at itself)."""
    initial = swarm.join_args[swarm.join_args.index("--initial-peers") + 1]
    dht = start_dht(initial_peers=[initial])
    outsider = Identity.generate()
    expires = get_dht_time() + 600
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    record = sign_record(outsider, CoordinatorRecord(dht.peer_id.to_base58(), maddrs, run, expires).header())
    # the swarm's nodes refuse it (signed by another key than the coordinator's); the outsider's keeps it
    dht.store(dht_key(run, "coordinator"), record, expires, subkey=outsider.public_hex)
    return dht


def _unpinned(join_args: list[str]) -> list[str]:
    i = join_args.index("--coordinator-key")
    return join_args[:i] + join_args[i + 2 :]


def test_an_outsiders_coordinator_record_does_not_capture_a_pinned_peer(tmp_path: Path) -> None:
    """(The unpinned peer and the two pinned ones start together: the outsider's claim
    is in the DHT before any of them looks.)"""
    args = ["--steps", "3", "--seed", "0", *SMALL, "--min-peers", "2", "--run-dir", str(tmp_path / "run")]
    swarm = Swarm(tmp_path, args, peers=0)
    outsider = None
    try:
        key = swarm.join_args[swarm.join_args.index("--coordinator-key") + 1]
        assert len(key) == 64
        outsider = _claim_the_run(swarm, "fusionllm")
        unpinned = Proc("join", *_unpinned(swarm.join_args), "--identity", str(tmp_path / "u.key"))
        swarm.procs.append(unpinned)
        join_together(swarm, [[], []])  # pinned: they find and train with the real one
        # every node of the swarm refuses the outsider's claim (RunRecords), only its own node holds it:
        # unpinned, the peer sees both claims and refuses to choose, or only the real one and trusts it
        if unpinned.wait(120) == 2:
            line = unpinned.wait_line(r"fusionllm: error: .*")
            assert "2 coordinators claim run 'fusionllm'" in line.group(0) and "--coordinator-key" in line.group(0)
        else:
            assert (
                unpinned.wait_line(r"trusting the coordinator of run 'fusionllm' on first use: key (\w+)").group(1)
                == key
            )
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        assert "Traceback" not in swarm.coord.output
    finally:
        if outsider is not None:
            outsider.shutdown()
        swarm.close()


def _model_args(tmp_path: Path, spec: str, peers: int = 2) -> list[str]:
    model = ["--model", spec, "--model-args", "n_layer=2,n_embd=64,n_head=4"]
    return ["--steps", "2", "--seed", "0", *model, "--min-peers", str(peers), "--run-dir", str(tmp_path / "run")]


def test_a_peer_trains_a_model_whose_code_it_cannot_import(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The model is a module on the coordinator's Python path only: the peers, which
    did not opt in to any code, get their stages as programs of ATen operators, say
    what they lend, and train; neither of them imports the module."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("FUSIONLLM_IMPORT_MARKER", str(marker))
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    swarm = Swarm(tmp_path, _model_args(tmp_path, "marker_model:build"), peers=0, env=env)
    try:
        join_together(swarm, [[], []])
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        assert not swarm.reap()
        for p in swarm.peers.values():
            assert re.search(r"stage \d: a program of \d+ calls to \d+ ATen operators, .* MiB of memory", p.output)
            assert re.search(r"coordinator key [0-9a-f]{16}", p.output)
        importers = {int(p) for p in marker.read_text().split()}
        assert swarm.coord.popen.pid in importers
        assert not importers & {p.popen.pid for p in swarm.peers.values()}, "a peer imported the model's module"
    finally:
        swarm.close()


def test_a_peer_imports_no_model_code_it_did_not_opt_in_to(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A model with data-dependent Python cannot travel as a program, so its stages
    are the model's code: a peer without --allow-code refuses the assignment (and
    never imports the file); a peer that opted in trains. (That peer joins unpinned:
    it trusts the run's only coordinator on first use. The two start together.)"""
    marker = tmp_path / "imported"
    monkeypatch.setenv("FUSIONLLM_IMPORT_MARKER", str(marker))
    spec = "tests/marker_model.py:build_checked"
    swarm = Swarm(tmp_path, _model_args(tmp_path, spec), peers=0)
    try:
        cautious = Proc("join", *swarm.join_args, "--threads", "1", "--identity", str(tmp_path / "c.key"))
        swarm.procs.append(cautious)
        key = swarm.join_args[swarm.join_args.index("--coordinator-key") + 1]
        willing_args = [*_unpinned(swarm.join_args), "--threads", "1", "--identity", str(tmp_path / "w.key")]
        willing_proc = Proc("join", *willing_args, "--allow-code", "tests/marker_model.py")
        swarm.procs.append(willing_proc)
        cautious.wait_line(r"joined run", 120)
        # unpinned, it trusts the only coordinator of the run on first use, and says so
        tofu = willing_proc.wait_line(r"trusting the coordinator of run 'fusionllm' on first use: key (\w+)", 120)
        assert tofu.group(1) == key
        willing = willing_proc.wait_line(r"joined run '.*' as (\w+)", 60).group(1)
        line = cautious.wait_line(r"refused the assignment: (.*)", 120).group(1)
        assert f"the run's model '{spec}' is code" in line and "--allow-code tests/marker_model.py" in line
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        assert "stages run the model's own Python on the peers: " in swarm.coord.output
        assert re.search(rf"stage 0 replica 0: peer {willing}", swarm.coord.output)
        importers = {int(p) for p in marker.read_text().split()}
        assert cautious.popen.pid not in importers, "the cautious peer imported the model's file"
        assert willing_proc.popen.pid in importers and swarm.coord.popen.pid in importers
    finally:
        swarm.close()


def test_a_program_calling_operators_outside_the_allowlist_is_refused(tmp_path: Path) -> None:
    """The model registers its own operator: a peer that allows only ATen refuses the
    stage program before it runs, in one line, and leaves; a peer that opted in to the
    model's code and the operator's namespace trains it. (The two start together.)"""
    model = ["--model", "tests/custom_op_model.py:build", "--data", "tests/custom_op_model.py:data"]
    swarm_args = ["--min-peers", "2", "--stages", "1", "--run-dir", str(tmp_path / "run")]
    args = ["--steps", "2", "--seed", "0", *model, *swarm_args]
    swarm = Swarm(tmp_path, args, peers=0)
    try:
        strict = Proc("join", *swarm.join_args, "--threads", "1", "--identity", str(tmp_path / "s.key"))
        swarm.procs.append(strict)
        join_together(swarm, [["--allow-code", "tests/custom_op_model.py", "--allow-ops", "fusiontest"]], first=1)
        strict.wait_line(r"joined run", 120)
        line = strict.wait_line(r"refused the stage: (.*)", 120).group(1)
        assert "fusiontest.scaled.default, outside the allowed operator namespaces (aten)" in line
        assert strict.wait(60) == 2 and "Traceback" not in strict.output
        assert _ended(swarm, 120) == 0, swarm.coord.output[-3000:]
    finally:
        swarm.close()


def _ended(swarm: Swarm, seconds: float) -> int:
    """The coordinator's exit code; if it does not end in ``seconds``, a failure that
    shows what it and every peer printed last (a CI run once hung here, after the strict
    peer's refusal, with no output to tell why)."""
    try:
        return swarm.coord.wait(seconds)
    except subprocess.TimeoutExpired:
        said = "\n".join(f"--- {' '.join(p.args[:2])}:\n{p.output[-2000:]}" for p in swarm.procs)
        raise AssertionError(f"the coordinator did not end within {seconds:.0f} s:\n{said}") from None


@pytest.fixture(scope="module")
def foreign_version(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, Proc]]:
    """A DHT whose coordinator record for run 'r' is signed but in another protocol
    version, and a peer of each kind started against it together (their start-ups and
    the unpinned one's join timeout overlap): pinned to the record's key (True), and
    unpinned (False)."""
    from protocol.wire.messages import PROTOCOL_VERSION

    tmp = tmp_path_factory.mktemp("foreign")
    dht = start_dht()
    peers: dict[bool, Proc] = {}
    try:
        other, expires = Identity.generate(), get_dht_time() + 600
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        record = CoordinatorRecord(dht.peer_id.to_base58(), maddrs, "r", expires)
        header = {**record.header(), "v": PROTOCOL_VERSION + 1}
        assert dht.store(dht_key("r", "coordinator"), sign_record(other, header), expires, subkey=other.public_hex)
        for pinned in (True, False):  # unpinned: 10 s, room for the DHT's own join on a loaded machine
            argv = ["--initial-peers", maddrs[0], "--run", "r"]
            argv += (
                ["--coordinator-key", other.public_hex, "--join-timeout", "300"] if pinned else ["--join-timeout", "10"]
            )
            peers[pinned] = Proc("join", *argv, "--identity", str(tmp / f"p{int(pinned)}.key"))
        yield peers
    finally:
        for peer in peers.values():
            peer.kill_all()
        dht.shutdown()


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-at-once", "unpinned-at-the-join-timeout"])
def test_a_coordinator_speaking_another_protocol_version_is_named(
    foreign_version: dict[bool, Proc], pinned: bool
) -> None:
    """The run's coordinator record is signed but in another protocol version: the peer
    says so in one line, not a generic 'no coordinator'. Pinned to that key, at once
    (only the key's owner signs with it); unpinned, when its join timeout ends (anyone
    may claim the run, the right coordinator may come later)."""
    from protocol.wire.messages import PROTOCOL_VERSION

    peer = foreign_version[pinned]
    assert peer.wait(120) == 2, peer.output[-2000:]
    line = peer.wait_line(r"fusionllm: error: .*").group(0)
    assert f"speaks protocol version {PROTOCOL_VERSION + 1}; this peer speaks {PROTOCOL_VERSION}" in line, line
    assert "Traceback" not in peer.output
