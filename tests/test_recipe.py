"""The optimizer recipe (issue 17, item 2): the schedule is a pure function of the step,
decoupled weight decay skips biases and norms, and the stages and a swarm apply it
exactly as the whole model does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fusionllm.local import compare_checkpoints
from peer.executor import make_optimizer
from protocol.job import JobSpec, SpecError
from protocol.recipe import Recipe, RecipeError, parse_betas
from tests.conftest import run_cli
from tests.swarmproc import SMALL
from tests.test_swarm import _reference

RECIPE = ["--lr-schedule", "cosine", "--warmup", "3", "--min-lr", "3e-4", "--weight-decay", "0.1",
          "--betas", "0.9,0.95"]  # fmt: skip


def test_schedules_are_pure_functions_of_the_step() -> None:
    warm = Recipe(lr=1.0, lr_schedule="cosine", warmup=4, min_lr=0.1, steps=14)
    assert [warm.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warm.lr_at(4) == 1.0 and warm.lr_at(13) == pytest.approx(0.1) and warm.lr_at(99) == pytest.approx(0.1)
    assert warm.lr_at(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    linear = Recipe(lr=1.0, lr_schedule="linear", min_lr=0.0, steps=11)
    assert [round(linear.lr_at(s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert Recipe(lr=2.0, steps=5).lr_at(4) == 2.0
    assert Recipe(lr=1.0, lr_schedule="cosine", steps=1).lr_at(0) == 1.0, "a one-step run trains at the peak"


def test_weight_decay_skips_biases_and_norms_unless_asked() -> None:
    layer, norm = torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)
    params = [*layer.parameters(), *norm.parameters()]
    groups = make_optimizer(params, Recipe(weight_decay=0.1, betas=(0.8, 0.9))).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (3, 0.0)]
    assert groups[0]["betas"] == (0.8, 0.9)
    every = make_optimizer(params, Recipe(weight_decay=0.1, decay_all=True)).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in every] == [(4, 0.1)]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"lr_schedule": "step"}, "lr schedule 'step'"),
        ({"lr": float("nan")}, "learning rate nan"),
        ({"min_lr": 1.0}, "min lr 1.0 is not between 0"),
        ({"weight_decay": float("inf")}, "weight decay inf"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"warmup": -1}, "warmup -1"),
    ],
)
def test_recipes_that_cannot_train_are_refused(bad: dict, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        Recipe(**bad)


def test_a_job_from_a_stranger_with_a_bad_recipe_is_one_line() -> None:
    with pytest.raises(SpecError, match="optimizer recipe: betas"):
        JobSpec(betas=["x", 1]).recipe()  # type: ignore[arg-type]
    assert JobSpec(betas=[0.9, 0.95]).recipe().betas == (0.9, 0.95), "betas arrive as a JSON list"  # type: ignore[arg-type]
    assert parse_betas(" 0.9, 0.95") == (0.9, 0.95)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--min-lr", "1"], "min lr 1.0 is not between 0 and the learning rate"),
        (["--betas", "1.5,0.9"], "betas '1.5,0.9' are not two numbers in [0, 1)"),
        (["--lr-schedule", "step"], "invalid choice: 'step'"),
        (["--weight-decay", "-1"], "-1.0 is not a non-negative, finite number"),
        (["--lr", "nan"], "nan is not a positive, finite number"),
    ],
)
def test_bad_recipe_flags_are_one_line(flags: list[str], says: str) -> None:
    r = run_cli("train", "--reference", "--steps", "2", *flags)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_stages_and_swarm_follow_the_recipe_exactly(tmp_path: Path) -> None:
    common = ["--steps", "8", "--seed", "0", *SMALL, *RECIPE]
    ref = _reference(tmp_path, common)
    staged = tmp_path / "staged.safetensors"
    r = run_cli("train", "--stages", "3", *common, "--save", str(staged))
    assert r.returncode == 0, r.stderr
    assert compare_checkpoints(staged, ref) <= 1e-5
    swarm = tmp_path / "swarm.safetensors"
    r = run_cli("demo", "--peers", "3", *common, "--save", str(swarm), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert compare_checkpoints(swarm, ref) <= 1e-5
    (tmp_path / "plain").mkdir()
    plain = _reference(tmp_path / "plain", ["--steps", "8", "--seed", "0", *SMALL])
    assert compare_checkpoints(plain, ref) > 1e-3, "the recipe changed the training"
