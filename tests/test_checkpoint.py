"""Checkpoints and stage state: a run stopped, saved, restored (into the same or
another cut) and continued is bitwise the run that never stopped; a crash while
saving never costs the previous checkpoint."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import coordinator.checkpoint as ckpt_mod
from coordinator.checkpoint import CheckpointInfo, RunDir, default_run_dir
from fusionllm.local import _backward, _executors, _forward, pick_cut
from peer.executor import StageExecutor
from protocol.model.graph import Cut
from protocol.model.job import JobSpec, split_batch

JOB = JobSpec(
    model_args="n_layer=2,n_embd=64,n_head=4",
    data_args="batch_size=8,ctx=32,max_bytes=200000",
    micro_batches=2,
    lr=3e-3,
)
Batch = tuple[torch.Tensor, ...]


class Crash(BaseException):
    """A simulated kill: no ``except Exception`` cleanup runs."""


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return list(itertools.islice(JOB.batches(), 7))


@pytest.fixture(scope="module")
def cuts() -> dict[int, Cut]:
    model = JOB.build_model()
    return {k: pick_cut(JOB, model, k) for k in (2, 3)}


@pytest.fixture(scope="module")
def reference(batches: list[Batch], cuts: dict[int, Cut]) -> dict[str, torch.Tensor]:
    """Parameters after 7 uninterrupted steps of the 3-stage cut."""
    model = JOB.build_model()
    _train(_executors(model, cuts[3], JOB), batches)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(execs: list[StageExecutor], batches: list[Batch]) -> None:
    for batch in batches:
        mbs = split_batch(batch, JOB.micro_batches)
        for i, mb in enumerate(mbs):
            _forward(execs, i, mb)
        for i in range(len(mbs)):
            _backward(execs, i, JOB.micro_batches)
        for ex in execs:
            ex.step()


def _saved_after_four(tmp_path: Path, batches: list[Batch], cut: Cut) -> tuple[RunDir, CheckpointInfo]:
    execs = _executors(JOB.build_model(), cut, JOB)
    _train(execs, batches[:4])
    snaps = [ex.state_tensors() for ex in execs]
    params = dict(execs[1].module.named_parameters())
    assert all(v.data_ptr() != params[k].data_ptr() for k, v in snaps[1].items() if k in params)
    rd = RunDir(tmp_path / "run").open()
    peers = [[f"peer{s}"] for s in range(cut.num_stages)]
    info = rd.save_checkpoint(4, 1, snaps, {"cut": cut, "stages": peers, "codecs": {"0": "none"}})
    assert info.cut == cut.boundaries and info.stages == (("peer0",), ("peer1",), ("peer2",))
    assert info.nbytes == sum(f.stat().st_size for f in info.path.iterdir())
    return rd, info


def _assert_params(model: torch.nn.Module, reference: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == reference.keys()
    for name, p in params.items():
        ok = torch.equal(p, reference[name]) if atol == 0 else torch.allclose(p, reference[name], rtol=0, atol=atol)
        assert ok, name


def test_restore_continues_bitwise(tmp_path: Path, batches: list[Batch], cuts: dict[int, Cut], reference) -> None:
    rd, _ = _saved_after_four(tmp_path, batches, cuts[3])
    latest = rd.latest()
    assert latest is not None and latest.step == 4 and latest.epoch == 1 and latest.codecs == {"0": "none"}
    merged = rd.load(latest)
    assert any(k.startswith("optim/") and k.endswith("/step") for k in merged)
    whole = JOB.build_model()
    whole.load_state_dict({k: v for k, v in merged.items() if not k.startswith("optim/")}, strict=True)
    model = JOB.build_model()
    execs = _executors(model, cuts[3], JOB)
    for ex in execs:
        ex.load_state_tensors(merged, strict_extra=False, steps_done=latest.step)
    _train(execs, batches[4:])
    assert [ex.steps_done for ex in execs] == [7, 7, 7]
    _assert_params(model, reference)
    # the optimizer state matters: weights alone do not continue the same run
    weights_only = JOB.build_model()
    execs = _executors(weights_only, cuts[3], JOB)
    for ex in execs:
        ex.module.load_state_dict(ex.select({k: v for k, v in merged.items() if not k.startswith("optim/")}))
    _train(execs, batches[4:])
    assert not all(torch.equal(p, reference[n]) for n, p in weights_only.named_parameters())


def test_restore_into_another_cut(tmp_path: Path, batches: list[Batch], cuts: dict[int, Cut], reference) -> None:
    rd, info = _saved_after_four(tmp_path, batches, cuts[3])
    merged = rd.load(info)
    model = JOB.build_model()
    execs = _executors(model, cuts[2], JOB)
    for ex in execs:
        ex.load_state_tensors(ex.select(merged))
    _train(execs, batches[4:])
    _assert_params(model, reference)


@pytest.mark.parametrize("where", ["writer", "rename", "after-rename"])
def test_crash_while_saving_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    rd = RunDir(tmp_path / "run").open()
    rd.save_checkpoint(2, 0, [{"a": torch.ones(3)}, {"b": torch.zeros(2)}], {})
    real_save, real_fsync = ckpt_mod.save_file, ckpt_mod._fsync
    calls = itertools.count()

    def save_once(*args, **kwargs):
        if next(calls):
            raise Crash
        real_save(*args, **kwargs)

    def fsync(path: Path) -> None:
        if path == rd.checkpoints_dir:
            raise Crash
        real_fsync(path)

    if where == "writer":
        monkeypatch.setattr(ckpt_mod, "save_file", save_once)
    elif where == "rename":
        monkeypatch.setattr(ckpt_mod.os, "rename", lambda *a: (_ for _ in ()).throw(Crash()))
    else:
        monkeypatch.setattr(ckpt_mod, "_fsync", fsync)
    with pytest.raises(Crash):
        rd.save_checkpoint(4, 0, [{"a": torch.full((3,), 2.0)}, {"b": torch.ones(2)}], {})
    monkeypatch.undo()
    latest = rd.latest()
    assert latest is not None and latest.step == 2
    assert torch.equal(rd.load(latest)["a"], torch.ones(3))
    rd.close()
    stale = list(rd.checkpoints_dir.glob("*.tmp-*"))
    assert bool(stale) == (where != "after-rename")
    rd = RunDir(tmp_path / "run").open()
    assert not list(rd.checkpoints_dir.glob("*.tmp-*"))
    assert rd.latest() == latest
    rd.save_checkpoint(4, 0, [{"a": torch.zeros(3)}, {"b": torch.ones(2)}], {})
    assert sorted(d.name for d in rd.checkpoints_dir.iterdir()) == [latest.path.name, rd.latest().path.name]


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd = RunDir(tmp_path / "run").open()
    monkeypatch.setattr(ckpt_mod, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        rd.save_checkpoint(1, 0, [{"a": torch.ones(1)}], {})
    assert not list(rd.checkpoints_dir.iterdir()) and rd.latest() is None


def test_pruning_resaving_and_rollback(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run", keep=2).open()
    for step in (1, 2, 3):
        rd.save_checkpoint(step, 0, [{"w": torch.full((2,), float(step))}], {"cut": [], "stages": [["p"]]})
    assert [c.step for c in rd.checkpoints()] == [3, 2]
    assert len(list(rd.checkpoints_dir.iterdir())) == 2
    again = rd.save_checkpoint(3, 1, [{"w": torch.full((2,), 30.0)}], {})  # after a rollback
    assert rd.latest() == again and again.epoch == 1
    assert torch.equal(rd.load(again)["w"], torch.full((2,), 30.0))
    assert len(list(rd.checkpoints_dir.iterdir())) == 2
    rd.save_checkpoint(2, 2, [{"w": torch.full((2,), 20.0)}], {})  # re-saving an older step keeps the newer
    assert [(c.step, c.epoch) for c in rd.checkpoints()] == [(3, 1), (2, 2)]
    assert len(list(rd.checkpoints_dir.iterdir())) == 2


def test_checkpoints_after_an_untrusted_step_are_dropped_for_rollback_and_resume(tmp_path: Path) -> None:
    """A spot check of a committed step failed: checkpoints that hold its update go,
    from the database and the disk, so neither a rollback nor a resume uses them."""
    rd = RunDir(tmp_path / "run", keep=2).open()
    for step in (4, 8):
        rd.save_checkpoint(step, 0, [{"w": torch.full((2,), float(step))}], {"cut": [], "stages": [["p"]]})
    rd.drop_after(7)  # step 7 was not trusted: the state after 8 steps holds it
    assert rd.latest() is not None and rd.latest().step == 4
    assert [d.name for d in rd.checkpoints_dir.iterdir()] == [rd.latest().path.name]
    rd.drop_after(3)
    assert rd.latest() is None and not list(rd.checkpoints_dir.iterdir())


def test_concurrent_saves(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run", keep=3).open()
    with ThreadPoolExecutor(4) as pool:
        saved = list(pool.map(lambda s: rd.save_checkpoint(s, 0, [{"w": torch.full((64,), float(s))}], {}), range(8)))
    assert [c.step for c in rd.checkpoints()] == [7, 6, 5] and rd.latest() == saved[7]
    assert sorted(d.name for d in rd.checkpoints_dir.iterdir()) == [f"step-{s:08d}" for s in (5, 6, 7)]
    assert all(torch.equal(rd.load(c)["w"], torch.full((64,), float(c.step))) for c in rd.checkpoints())


def test_latest_skips_incomplete_and_load_reports_corruption(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").open()
    rd.save_checkpoint(1, 0, [{"w": torch.ones(4)}], {})
    info = rd.save_checkpoint(2, 0, [{"w": torch.ones(4)}, {"v": torch.ones(4)}], {})
    (info.path / "stage-1.safetensors").unlink()
    assert rd.latest() is not None and rd.latest().step == 1
    (info.path / "stage-1.safetensors").write_bytes(b"\x00" * info.files[1][1])
    with pytest.raises(ckpt_mod.CheckpointError) as err:
        rd.load(info)
    assert "stage-1.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_losses_meta_events(tmp_path: Path) -> None:
    now = iter(range(100, 200))
    with RunDir(tmp_path / "run", clock=lambda: float(next(now))) as rd:
        for step in range(5):
            rd.record_loss(step, 5.0 - step)
        rd.record_loss(2, 9.0)
        assert rd.losses() == [5.0, 4.0, 9.0, 2.0, 1.0]
        rd.truncate_losses(after_step=2)
        assert rd.losses() == [5.0, 4.0, 9.0]
        job = {"model": "gpt", "steps": 10, "lr": 0.003}
        rd.set_meta("job", job)
        rd.set_meta("peers", ["/ip4/1.2.3.4/tcp/1"])
        for i in range(3):
            rd.add_event("join", f"peer {i}")
    with RunDir(tmp_path / "run") as rd:
        assert rd.get_meta("job") == job and rd.get_meta("peers") == ["/ip4/1.2.3.4/tcp/1"]
        assert rd.get_meta("absent", 7) == 7
        assert rd.events(limit=2) == [
            {"t": 101.0, "kind": "join", "text": "peer 1"},
            {"t": 102.0, "kind": "join", "text": "peer 2"},
        ]
        assert rd.losses() == [5.0, 4.0, 9.0]


def test_default_run_dir_is_safe() -> None:
    assert default_run_dir("run-1").parts[-3:] == (".fusionllm", "runs", "run-1")
    odd = default_run_dir("../../etc/passwd x")
    assert odd.parent == default_run_dir("a").parent and "/" not in odd.name and not odd.name.startswith(".")
    assert default_run_dir("a/b") != default_run_dir("a_b")


def test_load_errors_are_one_line_and_change_nothing(batches: list[Batch], cuts: dict[int, Cut]) -> None:
    execs = _executors(JOB.build_model(), cuts[3], JOB)
    _train(execs, batches[:1])
    ex = execs[1]
    good = ex.state_tensors()
    before = {k: v.clone() for k, v in ex.module.state_dict().items()}
    names = [k for k in good if not k.startswith("optim/")]
    missing, bent = names[0], names[1]
    bad = {k: v + 1 for k, v in good.items() if k != missing}
    bad[bent] = torch.zeros(3)
    bad["optim/nowhere.weight/step"] = torch.tensor(1.0)
    with pytest.raises(ValueError) as err:
        ex.load_state_tensors(bad)
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400
    assert f"missing {missing}" in msg and f"mis-shaped {bent} [3]" in msg and "unexpected optim/nowhere" in msg
    assert all(torch.equal(v, before[k]) for k, v in ex.module.state_dict().items())
    many = {k: v for k, v in good.items() if k.startswith("optim/")}
    with pytest.raises(ValueError, match=r"missing .* and \d+ more$"):
        ex.load_state_tensors(many)
    ex.load_state_tensors(good, steps_done=1)  # its own snapshot loads


def test_shown_weights_load_in_place_and_a_mismatch_changes_nothing(batches: list[Batch], cuts: dict[int, Cut]) -> None:
    """An arbiter loads a suspect's shown weights into its rebuilt stage in place (not
    through the optimizer's state: a spot check's fixed cost); the stage then holds
    exactly the shown tensors, and a wrong set of weights is refused in one line."""
    trained = _executors(JOB.build_model(), cuts[3], JOB)
    _train(trained, batches[:1])
    shown = trained[1].snapshot()
    arbiter = _executors(JOB.build_model(), cuts[3], JOB)[1]
    arbiter.load_weights(shown)
    assert all(torch.equal(v, shown[k]) for k, v in arbiter.module.state_dict().items())
    before = {k: v.clone() for k, v in arbiter.module.state_dict().items()}
    first, second = list(shown)[:2]
    bad = {k: v + 1 for k, v in shown.items() if k != first}
    bad.update({second: torch.zeros(3), "elsewhere.weight": torch.ones(1)})
    with pytest.raises(ValueError) as err:
        arbiter.load_weights(bad)
    msg = str(err.value)
    assert "\n" not in msg and f"missing {first}" in msg and f"mis-shaped {second} [3]" in msg
    assert "unexpected elsewhere.weight" in msg
    assert all(torch.equal(v, before[k]) for k, v in arbiter.module.state_dict().items())


def test_discard_step_then_redo_equals_clean_step(batches: list[Batch], cuts: dict[int, Cut]) -> None:
    clean = JOB.build_model()
    _train(_executors(clean, cuts[3], JOB), batches[:2])
    model = JOB.build_model()
    execs = _executors(model, cuts[3], JOB)
    _train(execs, batches[:1])
    mbs = split_batch(batches[1], JOB.micro_batches)
    _forward(execs, 0, mbs[0])
    _backward(execs, 0, JOB.micro_batches)
    _forward(execs, 1, mbs[1])  # half a step: one micro-batch back, one only forward
    assert any(p.grad is not None for p in model.parameters())
    for ex in execs:
        ex.discard_step()
    assert all(ex.pending == 0 for ex in execs) and all(p.grad is None for p in model.parameters())
    _train(execs, batches[1:2])
    _assert_params(model, {k: v.detach() for k, v in clean.named_parameters()})
    assert [ex.steps_done for ex in execs] == [2, 2, 2]


def test_a_stored_job_equals_the_same_job_on_resume(tmp_path: Path) -> None:
    """--resume compares the job the run directory stored (JSON) with the flags given
    again: tuples (the recipe's betas) must compare equal after the round trip."""
    from coordinator.config import CoordinatorConfig

    cfg = CoordinatorConfig(job=JobSpec(betas=(0.9, 0.95), lr_schedule="cosine"), run_id="r")
    run_dir = RunDir(tmp_path / "run").open()
    run_dir.set_meta("job", cfg.job_fields())
    assert run_dir.get_meta("job") == cfg.job_fields()
    assert JobSpec(**cfg.job_fields()).recipe() == cfg.job.recipe(), "what travels rebuilds the same recipe"
