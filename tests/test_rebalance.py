"""Slow peers are rebalanced on measured speeds, and the run stays exact: real
processes on loopback, compression off. The run with a peer joining mid-run and
another slowed down goes to its end, and its final weights are compared with
``fusionllm train --reference``; the others stop once what they check is seen (their
runs are long only so that a move pays for itself)."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from fusionllm.local import compare_checkpoints
from tests.conftest import run_cli
from tests.swarmproc import SMALL, Swarm, api, join_together, wait_for

pytestmark = pytest.mark.timeout(420)
EVERY = 20


#: the demo's model (its defaults)
DEMO: list[str] = []


def _equal_to_reference(tmp_path: Path, steps: int, model: list[str] = SMALL) -> bool:
    ref = tmp_path / "reference.safetensors"
    r = run_cli(
        "train", "--reference", "--threads", "1", "--steps", str(steps), "--seed", "0", *model, "--save", str(ref)
    )
    assert r.returncode == 0, r.stderr
    gap = compare_checkpoints(tmp_path / "swarm.safetensors", ref)
    assert gap <= 1e-5, f"the swarm ended {gap:.3g} off the reference"
    return True


def _ops(state: dict, peer: str) -> int:
    """Operators of the stage ``peer`` serves (0 on standby)."""
    for stage in state["plan"]["stages"]:
        if peer in stage["peers"]:
            return stage["last_op"] - stage["first_op"] + 1
    return 0


def test_a_peer_slowed_down_gets_less_work(tmp_path: Path) -> None:
    """(a) 4 peers; after some steps the busiest one is throttled to 0.05: within two
    rebalance periods the coordinator moves work off it, and the run goes on. (Long
    enough that the move pays for itself also on a loaded machine: the rule wants
    twice the move's cost back over the remaining steps.
    A twentieth, not a quarter: this small model's attention ops are a large share
    of a stage each, so a quarter-speed peer costs a 4-micro-batch pipeline under the
    20% a move must gain, as the estimator predicts it since it counts attention.)"""
    steps = 600
    # four pipeline stages: the planner's replicas model (a share of each micro-batch by
    # FLOP/s) does not see a slow replica as the straggler it is
    args = [*_args(tmp_path, steps, 4), "--stages", "4"]
    swarm = Swarm(tmp_path, args, peers=0)
    try:
        files = {}
        for i in range(4):
            f = tmp_path / f"throttle{i}"
            files[swarm.add_peer(i, "--throttle-file", str(f))] = f
        state = wait_for(swarm.url, lambda s: s["training"]["step"] >= 2 * EVERY + 5 and s["phase"] == "training", 300)
        slow = max(files, key=lambda p: _ops(state, p))
        before = _ops(state, slow)
        # counted before the slow-down: a rebalance right after it is not missed (CI once missed one)
        at, seen = state["training"]["step"], len(swarm.coord.lines)
        files[slow].write_text("0.05\n")
        swarm.peers[slow].wait_line(r"throttle: 0\.05", 10)
        line, checks = _moved(swarm, seen)
        told = [x for x in swarm.coord.lines if "rebalance" in x] + checks
        assert int(line.group(1)) <= at + 3 * EVERY, f"re-planned within two periods (one to measure): {told}"
        epoch = state["training"]["epoch"] + 1
        after = wait_for(swarm.url, lambda s: s["training"]["epoch"] > epoch - 1 and s["phase"] == "training", 60)
        assert _ops(after, slow) < before, f"the slowed peer still has {_ops(after, slow)} of {before} ops: {told}"
        # the peers kept their stages' neighbours: each was told only what changed (issue 33)
        swarm.coord.wait_line(r"4 of 4 peers told only what changed in their assignment \(\d+\.\d kB\)", 5, after=seen)
        _still_training(swarm)
    finally:
        swarm.close()


def _moved(swarm: Swarm, seen: int, timeout: float = 300.0) -> tuple[re.Match[str], list[str]]:
    """The coordinator's first line after line ``seen`` saying it rebalanced, and what
    every rebalance check said on the page meanwhile (a check that did not plan says
    why there only, and the page goes with the run: read while it runs)."""
    checks: dict[tuple[float, str], None] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and swarm.coord.popen.poll() is None:
        for line in swarm.coord.lines[seen:]:
            if m := re.search(r"rebalanced at step \d+: checked at step (\d+): ", line):
                return m, [text for _, text in checks]
        try:
            checks.update({(e["t"], e["text"]): None for e in api(swarm.url)["events"] if e["kind"] == "check"})
        except OSError:
            pass
        time.sleep(0.5)
    said = "\n".join(text for _, text in checks)
    raise AssertionError(f"no rebalance within {timeout:.0f} s; the checks said:\n{said}\n{swarm.coord.output[-3000:]}")


def _still_training(swarm: Swarm) -> None:
    """The run goes on after what a test checked (its end, and the weights equal to
    the reference, are checked by ``test_a_peer_joining_mid_run_is_put_to_work``: the
    rest of a run this long would add about a minute to each test)."""
    assert swarm.coord.popen.poll() is None, swarm.coord.output[-3000:]
    assert api(swarm.url)["phase"] in ("training", "planning")  # (a move may be under way)
    assert "Traceback" not in swarm.coord.output


def _finish(swarm: Swarm, tmp_path: Path, steps: int, model: list[str] = SMALL) -> str:
    swarm.note_children()
    assert swarm.coord.wait(400) == 0, swarm.coord.output[-3000:]
    assert not swarm.reap(), "processes left behind"
    assert "Traceback" not in swarm.coord.output
    assert _equal_to_reference(tmp_path, steps, model)
    return swarm.coord.output


def _args(tmp_path: Path, steps: int, peers: int, model: list[str] = SMALL) -> list[str]:
    # spot checks off: peers re-executing other stages' micro-batches add noise to the speeds measured here
    run = ["--steps", str(steps), "--seed", "0", *model, "--min-peers", str(peers), "--rebalance-every", str(EVERY)]
    files = ["--save", str(tmp_path / "swarm.safetensors"), "--run-dir", str(tmp_path / "run")]
    return [*run, *files, "--spot-check", "0"]


def test_a_lying_peer_is_corrected_at_the_first_check(tmp_path: Path) -> None:
    """(b) a slow peer (computing at 0.4 of the machine's speed) advertising 1000x that
    speed gets most of the model at first; the first rebalance check, on measured
    speeds, takes that work off it. (Slow, not only lying: three peers sharing two
    cores, an honest-speed liar's stage is priced only 1.4-1.7x the best plan's, and CI
    once read 1.2 at step 20 with another test busy beside it and declined. The demo's
    model, not the smallest: there each attention op is so large a share of a stage
    that the claim wins the liar only about half of the model, and the predicted gain
    of undoing that is under the 20% a move needs. The run is long enough that the
    better plan pays twice for the move: 600 steps, as at 300 a 4 s move on a busy
    machine came within 20% of what the new plan saves, and CI once saw the check at
    step 20 decline. The peers join one after another, each measuring its speed and
    link while the others wait: started together on CI, the liar once got the least
    work, 33 operators to 83, most likely because links measured in contention let
    its send time, not its compute, set its stage's pace.)"""
    steps = 600
    swarm = Swarm(tmp_path, _args(tmp_path, steps, 3, DEMO), peers=0)
    try:
        honest = [swarm.add_peer(i) for i in range(2)]
        liar = swarm.add_peer(2, "--advertise-flops", "1e15", "--throttle", "0.4")
        state = wait_for(swarm.url, lambda s: s["training"]["step"] >= 1, 300)
        before = _ops(state, liar)
        assert before > max(_ops(state, p) for p in honest), "the claim won it the most work"
        line = swarm.coord.wait_line(r"rebalanced at step \d+: checked at step (\d+): ", 300)
        checks = [e["text"] for e in api(swarm.url)["events"] if e["kind"] == "check"]
        assert int(line.group(1)) == EVERY, ("corrected at the first check", checks, line.group(0))
        after = wait_for(swarm.url, lambda s: s["training"]["epoch"] >= 1 and s["phase"] == "training", 60)
        speeds = {p["id"]: (p["flops"], p.get("measured_flops")) for p in after["peers"]}
        claimed, measured = speeds[liar]
        assert measured is not None and measured < claimed / 100, "its measured speed replaced its claim"
        assert after["plan"] != state["plan"], "the plan moved off the claim"
        _still_training(swarm)
    finally:
        swarm.close()


def test_a_peer_joining_mid_run_is_put_to_work(tmp_path: Path) -> None:
    """(c) two peers; one slows down to a tenth, and a third joins mid-run: it waits
    as standby and is taken in at a rebalance. (The first peer lends 0.3 of its speed,
    so the newcomer is the better choice even if an earlier check has already dropped
    to one peer, as it may on a 2-core machine where one process beats a pipeline.
    The run must outlast the newcomer's join: the first two start together at a
    hundredth of their speed (from their files, so their adverts say so) until the
    newcomer waits as standby. At full speed CI once finished the 400 steps in 15 s
    before the newcomer was standby, at 0.3 once too, after the first check had
    dropped to one peer (24 steps a second), and at 0.05 a loaded run (21 steps a
    second: this model's compute is a few ms a step). The newcomer comes once the
    run is under way (its first step done: at a hundredth each step takes over a
    second, and the first check is at step 20 whenever it comes), and the run after the take-in is
    short (it ran at 30 steps a second; the check is that it ends equal to the reference).)"""
    steps = 250
    swarm = Swarm(tmp_path, _args(tmp_path, steps, 2), peers=0)
    try:
        first_file, slow_file = tmp_path / "throttle0", tmp_path / "throttle1"
        for f in (first_file, slow_file):
            f.write_text("0.01")
        join_together(swarm, [["--throttle-file", str(first_file)], ["--throttle-file", str(slow_file)]])
        wait_for(swarm.url, lambda s: s["training"]["step"] >= 1, 300)
        late = swarm.add_peer(2)
        wait_for(swarm.url, lambda s: any(p["id"] == late and p.get("state") == "standby" for p in s["peers"]), 60)
        # the speeds the test is about, only once the newcomer waits as standby: the rebalance the
        # second peer's slow-down causes can take it in (set first, a busy machine could let that
        # rebalance come before the join and drop to one peer)
        first_file.write_text("0.3")
        slow_file.write_text("0.1")
        swarm.coord.wait_line(rf"rebalanced at step \d+: .*taken in: .*{late}", 300)
        slow_file.write_text("1")  # taken in: the rest of the run need not crawl (the plan may move again)
        out = _finish(swarm, tmp_path, steps)
    finally:
        swarm.close()
    assert re.search(r"[1-9]\d* rebalances", out)


@pytest.mark.parametrize("seconds", [30, pytest.param(60, marks=pytest.mark.slow)], ids=["30s", "minute"])
def test_random_speed_changes_do_not_make_the_plan_flap(tmp_path: Path, seconds: int) -> None:
    """(d) every second one of 3 peers gets a random speed (1, 0.6 or 0.35 of its own),
    for a minute (half a minute in the default suite, with the same bound). A peer whose
    speed changed level twice in the last 10 checks is planned at its long-run
    throughput, not at its latest speed; a move must be predicted 20%
    faster (more after a move that did not deliver) and pay for itself twice; a move that
    made things slower is undone once. Bound chosen: at most 3 plan changes in that
    minute, at most one of them an undo (we saw 2: the first check's correction of the
    advertised speeds, and one standby swap; the cool-down alone would allow about 15).
    Three stages, one peer each: on this 2-core machine three peers share two cores,
    which no planner can see, so plans that swap a stage for a replica or leave a
    peer out are predicted gains the machine cannot deliver (undone, and tried again
    as speeds change); what is checked here is that the cut does not flap."""
    steps = 1500
    swarm = Swarm(tmp_path, [*_args(tmp_path, steps, 3), "--stages", "3"], peers=0)
    rng = random.Random(7)
    try:
        files = [tmp_path / f"throttle{i}" for i in range(3)]
        for i, f in enumerate(files):
            swarm.add_peer(i, "--throttle-file", str(f))
        wait_for(swarm.url, lambda s: s["training"]["step"] >= EVERY, 300)
        seen, start, changes = len(swarm.coord.lines), time.monotonic(), 0
        while time.monotonic() - start < seconds and api(swarm.url)["training"]["step"] < steps - 2 * EVERY:
            rng.choice(files).write_text(f"{rng.choice([1.0, 0.6, 0.35])}\n")
            changes += 1
            time.sleep(1.0)
        for f in files:
            f.write_text("1\n")
        moves = [line for line in swarm.coord.lines[seen:] if re.search(r"rebalanced at step \d+", line)]
        _still_training(swarm)
    finally:
        swarm.close()
    assert changes >= seconds // 2, f"only {changes} speed changes before the run neared its end"
    assert len(moves) <= 3, "\n".join(moves)
    assert sum("undoing the move" in m for m in moves) <= 1, "\n".join(moves)
