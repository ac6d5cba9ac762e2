"""What the coordinator does between a step's last ``StepDone`` and the next step's first
forward (issue 31). It sends a step's micro-batches while the step before drains: the
data of step N+1 reaches the first stage before step N's commit, and the commits (the
first stage's first) go once the other stages have reported, where the first stage's
report cannot change the update; a step that fails takes its fed-ahead data with it.
The step's loss goes on the record without a disk sync there (a sync took 8.6 ms);
checkpoints are still written synced.

The pipeline's tests run on the driver of ``tests/test_coordinator_inbox.py`` (fake
host, transport and clock)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from unittest.mock import patch

import pytest

from coordinator.checkpoint import RunDir
from coordinator.run import Driver
from coordinator.runstate import PeerLost
from protocol.wire.messages import Activations, PeerFailure, StepDone
from tests.test_coordinator_inbox import JOB, _after, _driver, _host, _inbound, _put

MBS = {str(m): 2.5 for m in range(JOB.micro_batches)}


def _sent(driver: object) -> list[tuple[str, str, int]]:
    """(peer, kind, step) of every message the driver sent, in order."""
    return [(p, m.KIND, m.step) for p, m, _ in _host(driver).transport.sent]  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_plan_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake driver dispatched no plan, so it has no value specs to check the data against."""
    monkeypatch.setattr("coordinator.pipeline.match_values", lambda *args: None)


def _plain_driver(tmp_path: Path) -> Driver:
    """Two stages, p1 then p0, no spot checks."""
    driver = _driver(tmp_path, [["p1"], ["p0"]], spot_check=0.0)
    driver.st.specs = [None, None]  # type: ignore[list-item]
    return driver


def test_the_next_steps_data_and_the_commits_go_once_the_first_stage_alone_works(tmp_path: Path) -> None:
    """The first stage's ``StepDone`` cannot change a plain step's update: its commit
    (first) and everyone's go once the other stages have reported, after the next
    step's data, and its ``StepDone`` is awaited after them."""

    async def go() -> None:
        driver = _plain_driver(tmp_path)  # the first stage's peer, p1, sorts after the last's
        step = asyncio.ensure_future(driver.pipeline.step())
        await _put(driver, _inbound("p0", StepDone("r", 0, 1, 0, MBS)))  # the last stage first, as it drains
        for _ in range(50):
            await asyncio.sleep(0)
        mbs = JOB.micro_batches
        # step 0's data, step 1's, then the commits while p1 (the first stage) still works
        assert _sent(driver) == [("p1", "act", 0)] * mbs + [("p1", "act", 1)] * mbs + [
            ("p1", "commit", 0),
            ("p0", "commit", 0),
        ]
        assert not step.done() and driver.st.step == 1
        await _put(driver, _inbound("p1", StepDone("r", 0, 0, 0, compute_s=0.01)))
        await step
        assert list(driver.st.compute["p1"]) == [0.01]  # its report is still counted
        # step 1 uses what was fed: the same micro-batches, not sent again
        step = asyncio.ensure_future(driver.pipeline.step())
        for _ in range(50):
            await asyncio.sleep(0)
        assert not [s for s in _sent(driver)[2 * mbs + 2 :] if s[1] == "act" and s[2] == 1]
        step.cancel()

    asyncio.run(go())


@pytest.mark.parametrize("case", ["replicas", "last step"])
def test_the_first_stages_commit_waits_for_it_where_its_report_matters(tmp_path: Path, case: str) -> None:
    """With replicas (which average their gradients before they report) or on the last
    step (checked before its commit), the commit waits for the first stage."""

    async def go() -> None:
        first = ["p1", "p2"] if case == "replicas" else ["p1"]
        driver = _driver(tmp_path, [first, ["p0"]], spot_check=0.0)
        driver.st.specs = [None, None]  # type: ignore[list-item]
        if case == "last step":
            driver.st.step = JOB.steps - 1
        step = asyncio.ensure_future(driver.pipeline.step())
        await _put(driver, _inbound("p0", StepDone("r", driver.st.step, 1, 0, MBS)))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not [s for s in _sent(driver) if s[1] == "commit"]
        await _put(driver, *(_inbound(p, StepDone("r", driver.st.step, 0, r)) for r, p in enumerate(first)))
        await step
        assert {p for p, kind, _ in _sent(driver) if kind == "commit"} == {*first, "p0"}

    asyncio.run(go())


def test_a_peer_lost_after_an_early_commit_rolls_back(tmp_path: Path) -> None:
    """The first stage may be anywhere in the step once its commit is out: a peer lost
    before its ``StepDone`` comes rolls the swarm back to the last checkpoint."""

    async def go() -> None:
        driver = _plain_driver(tmp_path)
        driver.mailbox.heard_all({"p0", "p1"})
        step = asyncio.ensure_future(driver.pipeline.step())
        await _put(
            driver,
            _inbound("p0", StepDone("r", 0, 1, 0, MBS)),
            _inbound("p0", PeerFailure("r", 0, "stream to peer p1 broke", 0, "p1")),
        )
        with pytest.raises(PeerLost) as lost:
            await _after(driver, 3.0, step)  # past the blame's wait
        assert list(lost.value.lost) == ["p1"] and lost.value.rollback_to == 0
        assert ("p1", "commit", 0) in _sent(driver) and driver.st.step == 1

    asyncio.run(go())


def test_a_failed_step_drops_its_fed_ahead_data(tmp_path: Path) -> None:
    async def go() -> None:
        driver = _driver(tmp_path, [["p1"], ["p2"], ["p0"]], spot_check=0.0)
        driver.st.specs = [None, None, None]  # type: ignore[list-item]
        step = asyncio.ensure_future(driver.pipeline.step())
        await _put(driver, _inbound("p0", StepDone("r", 0, 2, 0, MBS)))  # the last stage: the feed-ahead starts
        for _ in range(50):
            await asyncio.sleep(0)
        step.cancel()  # as a lost peer (p2) ends the step: the next one is fed anew
        try:
            await step
        except asyncio.CancelledError:
            pass
        driver.st.epoch += 1  # the recovery's new epoch redoes step 0
        sent = len(_sent(driver))
        step = asyncio.ensure_future(driver.pipeline.step())
        for _ in range(50):
            await asyncio.sleep(0)
        assert _sent(driver)[sent:] == [("p1", "act", 0)] * JOB.micro_batches
        acts = [m for _, m, _ in _host(driver).transport.sent[sent:]]
        assert all(isinstance(m, Activations) and m.epoch == driver.st.epoch for m in acts)
        step.cancel()

    asyncio.run(go())


@pytest.mark.parametrize("commit_fails", [False, True])
def test_the_loss_is_recorded_after_the_commits_even_when_one_fails(tmp_path: Path, commit_fails: bool) -> None:
    """The loss's write, the page and ``on_step`` wait until the commits are out (they
    took 0.55 ms between the step's last ``StepDone`` and the first stage's commit); a
    commit that fails still leaves the counted step on the record."""

    async def go() -> None:
        driver = _plain_driver(tmp_path)
        pipe = driver.pipeline
        commits_then: list[int] = []

        def record(step: int, loss: float) -> None:
            commits_then.append(sum(kind == "commit" for _, kind, _ in _sent(driver)))

        reports: list[int] = []
        pipe.on_step = lambda report: reports.append(report.step)
        commit = pipe._commit
        failing = AssertionError("the commit failed")

        async def commit_then_fail(*args: object) -> None:
            await commit(*args)  # type: ignore[arg-type]
            if commit_fails:
                raise failing

        with patch.object(pipe.run_dir, "record_loss", record), patch.object(pipe, "_commit", commit_then_fail):
            step = asyncio.ensure_future(pipe.step())
            await _put(driver, _inbound("p0", StepDone("r", 0, 1, 0, MBS)))
            await _put(driver, _inbound("p1", StepDone("r", 0, 0, 0)))
            if commit_fails:
                with pytest.raises(AssertionError) as raised:
                    await step
                assert raised.value is failing
            else:
                await step
        assert commits_then == [2] and reports == [0] and driver.st.step == 1

    asyncio.run(go())


def test_losses_are_recorded_unsynced_and_kept_and_the_rest_stays_synced(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").open()
    for step in range(3):
        run_dir.record_loss(step, 1.5 + step)
    assert run_dir.db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL, for checkpoints and metadata
    run_dir.close()
    again = RunDir(tmp_path / "run").open()
    assert again.losses() == [1.5, 2.5, 3.5]
    again.close()


def test_the_steps_of_an_epoch_tile_the_runs_time(tmp_path: Path) -> None:
    """Each step's seconds run from the previous step's count (its commit, a rebalance
    check or an evaluation after it are in the next step's time, as a pipelining loop's
    iterations follow each other), so tokens/s is over the time the run took."""

    async def go() -> list[float]:
        driver = _plain_driver(tmp_path)
        clock = driver.pipeline.clock
        real_commit = driver.pipeline._commit

        async def slow_commit(*args: object) -> None:
            await real_commit(*args)  # type: ignore[arg-type]
            clock._now += 0.25  # type: ignore[attr-defined]  # what follows the count took a quarter second

        driver.pipeline._commit = slow_commit  # type: ignore[method-assign]
        for step in range(2):
            task = asyncio.ensure_future(driver.pipeline.step())
            for _ in range(50):
                await asyncio.sleep(0)
            clock._now += 0.5  # type: ignore[attr-defined]  # the step's own compute
            await _put(driver, _inbound("p0", StepDone("r", step, 1, 0, MBS)))
            await _put(driver, _inbound("p1", StepDone("r", step, 0, 0)))
            await task
        return driver.st.step_seconds

    assert asyncio.run(go()) == pytest.approx([0.5, 0.75])


def test_an_evaluation_is_not_in_the_steps_time(tmp_path: Path) -> None:
    """Validation is not training: in the next step's seconds it made one step look
    slow, and a rebalance judged on the steps around it could be undone for nothing."""

    async def go() -> list[float]:
        driver = _plain_driver(tmp_path)
        pipe, clock = driver.pipeline, driver.pipeline.clock
        pipe.job = dataclasses.replace(pipe.job, eval_every=1)

        async def evaluate(step: int) -> None:
            clock._now += 1.0  # type: ignore[attr-defined]  # a validation pass of a second

        pipe.evaluate = evaluate  # type: ignore[method-assign]
        with patch.object(driver.stages, "eval_micro_batches", lambda specs: [None]):
            for step in range(2):
                task = asyncio.ensure_future(pipe.step())
                for _ in range(50):
                    await asyncio.sleep(0)
                clock._now += 0.5  # type: ignore[attr-defined]
                await _put(driver, _inbound("p0", StepDone("r", step, 1, 0, MBS)))
                await _put(driver, _inbound("p1", StepDone("r", step, 0, 0)))
                await task
        return driver.st.step_seconds

    assert asyncio.run(go()) == pytest.approx([0.5, 0.5])
