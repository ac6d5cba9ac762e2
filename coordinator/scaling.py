"""The loss scale across committed steps (fp16's dynamic scaling; ``NO_SCALE``
otherwise): the scale of the next step, each step's for a rollback, how the last
step was committed, and the scale a checkpoint recorded for a resume."""

from __future__ import annotations

from coordinator.checkpoint import RunDir
from protocol.model.recipe import LossScale, Recipe, Update, initial_scale


class LossScales:
    def __init__(self, recipe: Recipe, run_dir: RunDir) -> None:
        self.recipe = recipe
        self.run_dir = run_dir
        self.scale: LossScale = initial_scale(recipe)  # the scale of the next step
        self.at: dict[int, LossScale] = {}  # steps done -> the scale then (for a rollback)
        self.last = Update()  # how the last committed step was committed (its update, still pending)

    def saved(self, step: int) -> LossScale:
        """The scale a checkpoint of ``step`` recorded (the initial one at step 0)."""
        saved = self.run_dir.get_meta(f"loss_scale@{step}", None) if step else None
        if isinstance(saved, list) and len(saved) == 2:
            return LossScale(float(saved[0]), int(saved[1]))
        return initial_scale(self.recipe)

    def resume(self, step: int) -> None:
        """A restarted coordinator goes on from the checkpoint of ``step``."""
        self.scale = self.saved(step)
        self.at[step] = self.scale

    def commit(self, steps_done: int, update: Update) -> None:
        """A step was committed with ``update``; ``steps_done`` steps are now done."""
        self.scale, self.last = update.scale, update
        self.at[steps_done] = update.scale

    def rollback(self, to: int) -> None:
        """Back to the state after ``to`` steps: its scale, nothing pending."""
        self.scale, self.last = self.at.get(to) or self.saved(to), Update()

    def record(self, steps_done: int) -> None:
        """A checkpoint of ``steps_done`` steps is asked for: its scale goes with it."""
        if self.recipe.scales_loss:
            self.run_dir.set_meta(f"loss_scale@{steps_done}", [self.scale.scale, self.scale.good])
