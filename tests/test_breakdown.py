"""Where a step's time goes: the peer's timeline cut into parts (peer.timing), the
field that carries them (StepDone.breakdown), the coordinator's table and summary
lines (coordinator.breakdown), and a real 3-peer swarm whose parts add up to its step
and whose weights still equal the reference's."""

from __future__ import annotations

import re
from pathlib import Path

from coordinator.breakdown import StepBreakdown, accepted, breakdown_lines
from fusionllm.local import compare_checkpoints
from peer.timing import StepTimes, covered
from protocol.wire.messages import Message, StepDone
from protocol.wire.step_parts import BREAKDOWN_V, STEP_PARTS
from tests.conftest import run_cli


class Ticks:
    """A clock that a test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_parts_tile_the_window_and_other_is_the_rest() -> None:
    clock = Ticks()
    times = StepTimes(clock)
    times.start()
    t0 = clock()
    clock.t += 0.030
    times.since("forward", t0)
    t0 = clock()
    clock.t += 0.050
    times.waited(t0, wire_s=0.010)  # 40 ms before the message's first byte: the neighbour's
    clock.t += 0.005  # nothing measured this
    parts = times.report()
    assert parts["forward"] == 0.03 and parts["wire"] == 0.01 and parts["bubble"] == 0.04
    assert abs(parts["other"] - 0.005) < 1e-9 and abs(parts["step"] - 0.085) < 1e-9
    assert abs(sum(v for k, v in parts.items() if k != "step") - parts["step"]) < 1e-9
    assert abs(covered(parts) - 0.08 / 0.085) < 1e-6
    # the next window opens where this one closed, with every part back at zero
    clock.t += 0.002
    after = times.report()
    assert abs(after["step"] - 0.002) < 1e-9 and after["forward"] == 0.0


def test_a_wait_shorter_than_the_message_s_transfer_is_all_wire() -> None:
    clock = Ticks()
    times = StepTimes(clock)
    times.start()
    t0 = clock()
    clock.t += 0.004
    times.waited(t0, wire_s=0.020)  # it was on its way before the wait began
    parts = times.report()
    assert parts["wire"] == 0.004 and parts["bubble"] == 0.0


def test_a_wait_on_the_compute_thread_is_spot_checks_only_while_a_check_held_it() -> None:
    times = StepTimes(Ticks())
    times.start()
    times.thread_wait(0.004, checking=0.0)  # spot checks off: handing the work over and back
    times.thread_wait(0.010, checking=0.007)  # a check held the thread for 7 ms of the 10
    times.thread_wait(0.002, checking=0.050)  # a check that began before the wait
    parts = times.report()
    assert abs(parts["spot_checks"] - 0.009) < 1e-9 and abs(parts["handoff"] - 0.007) < 1e-9


def _done(**kw: object) -> StepDone:
    return StepDone("r", 3, 1, 0, **kw)  # type: ignore[arg-type]


def test_the_breakdown_travels_in_step_done_and_older_peers_still_decode() -> None:
    parts = {p: 0.001 for p in STEP_PARTS} | {"step": 0.011}
    msg = _done(breakdown=parts, breakdown_v=BREAKDOWN_V)
    back = Message.from_header(msg.header())
    assert back == msg and accepted(back) == parts
    old = msg.header()
    del old["breakdown"], old["breakdown_v"]  # a peer of before the field
    assert accepted(Message.from_header(old)) is None  # type: ignore[arg-type]


def test_a_breakdown_is_read_tolerantly_and_checked_strictly() -> None:
    good = {"forward": 0.01, "step": 0.02}
    assert accepted(_done(breakdown={**good, "gpu_fans": 9.0}, breakdown_v=BREAKDOWN_V)) == {
        **dict.fromkeys(STEP_PARTS, 0.0),
        **good,
    }  # a newer peer's part is ignored, a missing one is 0
    assert accepted(_done(breakdown=good, breakdown_v=BREAKDOWN_V + 1)) is None  # another layout
    for bad in (-1.0, float("nan"), float("inf"), 7200.0):
        assert accepted(_done(breakdown={**good, "wire": bad}, breakdown_v=BREAKDOWN_V)) is None
    assert accepted(_done(breakdown={"step": 0.0}, breakdown_v=BREAKDOWN_V)) is None


def test_the_table_puts_the_estimator_beside_the_medians() -> None:
    book = StepBreakdown()
    for forward in (0.010, 0.012, 0.050):
        book.record(0, _done(breakdown={"forward": forward, "step": 0.1}, breakdown_v=BREAKDOWN_V))
    rows = book.table(stage_s=[0.002], link_s=[0.001], iteration_s=0.09, mbs=4)
    assert rows[0]["measured_ms"]["forward"] == 24.0 and rows[0]["measured_ms"]["step"] == 100.0
    assert rows[0]["predicted_ms"] == {"compute": 8.0, "wire": 4.0, "step": 90.0}
    (line,) = breakdown_lines(rows)
    assert line.startswith("  stage 0 step 100.0 ms (predicted 90.0): forward 24.0")
    assert "wire 0.0 (predicted 4.0)" in line


def test_a_new_plan_epoch_starts_the_breakdown_again() -> None:
    """A rebalance from four stages to two left stages 2 and 3's windows of the old plan
    in the demo's summary, and their few windows set the steps the coordinator's mean
    covered: a new cut starts the breakdown again, and so does a replica fewer on the
    same cut (each replica's calls and bytes change: the fitted fixed costs read the
    windows against the new plan); a new epoch of the same shape keeps it. Every new
    epoch starts the peers' compute per step again."""
    from coordinator.assign import Assignment
    from coordinator.runstate import RunState
    from protocol.model.graph import Cut

    st = RunState()
    for stage in range(4):
        st.breakdown.record(stage, _done(breakdown={"forward": 0.01, "step": 0.1}, breakdown_v=BREAKDOWN_V))
    st.compute = {"a": [0.03], "b": [0.02]}
    st.next_epoch(Assignment(Cut((3,)), [["a"], ["b", "c"]]))
    st.breakdown.record(0, _done(breakdown={"forward": 0.02, "step": 0.1}, breakdown_v=BREAKDOWN_V))
    assert list(st.breakdown.means_ms()) == [0] and st.breakdown.means_ms()[0]["forward"] == 20.0
    assert st.compute == {}  # a peer's compute per step was of its old stage
    st.compute = {"a": [0.03]}
    st.next_epoch(Assignment(Cut((3,)), [["a"], ["c", "d"]]))  # the same cut and replica counts
    assert list(st.breakdown.means_ms()) == [0] and st.compute == {}
    st.next_epoch(Assignment(Cut((3,)), [["a"], ["c"]]))  # a recovery: the same cut, a replica fewer
    assert list(st.breakdown.means_ms()) == []


def _stage_lines(out: str) -> dict[int, tuple[float, float]]:
    """Per stage of the summary's breakdown: (step ms, the named parts' sum in ms)."""
    found = {}
    for m in re.finditer(r"^  stage (\d+) step ([\d.]+) ms[^:]*: (.*) ms$", out, re.M):
        parts = dict(re.findall(r"(\w+) ([\d.]+)", re.sub(r"\([^)]*\)", "", m.group(3))))
        assert set(parts) <= set(STEP_PARTS), parts
        named = sum(float(v) for k, v in parts.items() if k != "other")
        found[int(m.group(1))] = (float(m.group(2)), named)
    return found


def test_a_peers_compute_is_kept_for_its_latest_steps_only() -> None:
    """The coordinator kept every step's compute of every peer for the epoch: 32 bytes a
    peer a step, gigabytes over a long run of a large swarm. The latest ``COMPUTE_KEEP``
    are kept, and the summary's per-micro-batch median reads them."""
    from coordinator.assign import Assignment
    from coordinator.runstate import COMPUTE_KEEP, RunState
    from coordinator.summary import per_micro_batch
    from protocol.model.graph import Cut

    st = RunState()
    for i in range(3 * COMPUTE_KEEP):
        st.record_compute("a", 1.0 if i < 2 * COMPUTE_KEEP else 0.04)
    assert len(st.compute["a"]) == COMPUTE_KEEP and set(st.compute["a"]) == {0.04}
    assert per_micro_batch(Assignment(Cut(()), [["a"]]), st.compute, 4) == {"a": 0.01}


def test_three_peers_breakdown_adds_up_and_weights_equal_reference(tmp_path: Path) -> None:
    """Spot checks on (a replicated stage, checked often), compression off. 40 steps: the
    first step's warm-up (programs loading, the first sends) is a part of the mean that
    the peers' first window and the coordinator's first step measure from different
    starts; over 12 steps it alone made them differ by 11% on a loaded machine."""
    common = ["--steps", "40", "--seed", "0", "--model-args", "n_layer=2,n_embd=64,n_head=4"]
    ckpt, ref = tmp_path / "swarm.safetensors", tmp_path / "reference.safetensors"
    flags = ["--peers", "3", "--stages", "2", "--spot-check", "0.5", "--compression", "none"]
    r = run_cli("demo", *flags, *common, "--save", str(ckpt), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(re.search(r"(\d+) spot checks", r.stdout).group(1)) > 0, r.stdout  # type: ignore[union-attr]
    stages = _stage_lines(r.stdout)
    assert sorted(stages) == [0, 1], r.stdout
    coordinator_ms = float(re.search(r"the coordinator's over the same steps: ([\d.]+)\)", r.stdout).group(1))  # type: ignore[union-attr]
    for step_ms, named_ms in stages.values():
        assert abs(named_ms - coordinator_ms) <= 0.1 * coordinator_ms, r.stdout  # the parts: the measured step
        assert named_ms >= 0.9 * step_ms, r.stdout  # what no part names (other) is under a tenth
    done = run_cli("train", "--reference", *common, "--threads", "1", "--save", str(ref))
    assert done.returncode == 0, done.stdout + done.stderr
    assert compare_checkpoints(ckpt, ref) <= 1e-5


def test_the_coordinators_mean_covers_the_steps_the_windows_cover() -> None:
    """The summary compares the peers' windows with the coordinator's mean over the same
    (last) steps: a stage that reported fewer windows (joined late, or the book's cap)
    sets how many; with none, every step counts."""
    from types import SimpleNamespace

    from coordinator.summary import _with_breakdown

    book = StepBreakdown()
    parts = {p: 0.001 for p in STEP_PARTS} | {"step": 0.011}
    for stage, windows in ((0, 3), (1, 5)):
        for _ in range(windows):
            book.record(stage, _done(breakdown=parts, breakdown_v=BREAKDOWN_V))
    assert book.windows_per_stage() == 3 and StepBreakdown().windows_per_stage() == 0
    st = SimpleNamespace(step_seconds=[9.0, 1.0, 1.0, 1.0], breakdown=book, plan=None, predicted=lambda: None)
    assert _with_breakdown({"x": 1}, st, 4)["mean_step_s"] == 1.0  # type: ignore[arg-type]
    st.breakdown = StepBreakdown()
    assert _with_breakdown({"x": 1}, st, 4)["mean_step_s"] == 3.0  # type: ignore[arg-type]
