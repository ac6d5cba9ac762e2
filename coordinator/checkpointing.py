"""The coordinator driver's checkpoints: when to ask for one, taking each stage's
state as it arrives (checked against the plan), writing it to the run directory,
and each stage's part of it for a restore."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from coordinator import replan
from coordinator.checkpoint import CheckpointError
from coordinator.outcome import SwarmError
from coordinator.runstate import OPTIM_KEYS, OPTIM_PREFIX, DriverParts, owner
from protocol.model.graph import Cut, stage_modules
from protocol.net.tasks import log_failure
from protocol.net.transport import Inbound

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


class Checkpointing(DriverParts):
    """Mixed into :class:`coordinator.run.Driver`."""

    _names: dict[tuple[int, ...], list[set[str]]]
    _final_write: asyncio.Task[None] | None
    final: dict[str, torch.Tensor] | None
    init_state: dict[str, torch.Tensor] | None

    def _checkpoint_due(self, force: bool = False) -> bool:
        """Whether the step just committed is checkpointed (``replan.checkpoint_due``,
        or ``force``: a rebalance moves state through it); the last step always is
        (peers send it unasked)."""
        st = self.st
        if st.step >= self.job.steps:
            return False
        last = st.checkpoint.step if st.checkpoint else 0
        due = force or replan.checkpoint_due(
            st.step, last, self.cfg.checkpoint_every, st.trained_s - st.trained_at_checkpoint, st.checkpoint_cost_s
        )
        if due:
            st.trained_at_checkpoint, st.asked_at[st.step] = st.trained_s, time.perf_counter()
        return due

    def _take_part(self, inbound: Inbound) -> None:
        """A stage's checkpoint state arrived; write the checkpoint once every stage's has."""
        st, msg = self.st, inbound.message
        assert st.plan is not None
        k = st.plan.cut.num_stages
        if msg.epoch != st.epoch or not 0 <= msg.stage < k or inbound.sender != st.plan.stages[msg.stage][0]:
            return
        values = inbound.frame.values()
        problem = self._check_part(msg.stage, msg.names, values)
        if not problem and not all(bool(torch.isfinite(v).all()) for v in values if v.is_floating_point()):
            raise self._diverged(msg.stage, msg.step, inbound.sender)
        if problem:
            logger.warning("ignoring the checkpoint state of stage %d from %s: %s", msg.stage, inbound.sender, problem)
            return
        parts = st.parts.setdefault((msg.epoch, msg.step), {})
        parts[msg.stage] = dict(zip(msg.names, values, strict=True))
        if len(parts) == k:
            for key in [key for key in st.parts if key[1] <= msg.step]:  # older incomplete ones too
                del st.parts[key]
            stages = [parts[s] for s in range(k)]
            task = asyncio.create_task(self._write(msg.step, stages))
            task.add_done_callback(log_failure)
            st.writes.append(task)
            if msg.step >= self.job.steps:
                self._final_write = task

    def _check_part(self, stage: int, names: list[str], values: list[Any]) -> str:
        """Why a stage's checkpoint state does not fit the plan ('' if it does): its
        weights and optimizer entries, by name and shape, and nothing else."""
        assert self.st.plan is not None
        own = self._stage_names(self.st.plan.cut)[stage]
        shapes = {n: t.shape for n, t in self.model.state_dict().items()}
        if len(names) != len(values) or not all(isinstance(v, torch.Tensor) for v in values):
            return "names and tensors do not pair up"
        got = dict(zip(names, values, strict=True))
        if not own <= set(got):
            return f"missing {sorted(own - set(got))[:3]}"
        for name, t in got.items():
            weight, key = owner(name), name.rsplit("/", 1)[-1]
            if weight not in own or (name != weight and key not in OPTIM_KEYS):
                return f"'{name[:80]}' is not this stage's"
            want = shapes[weight] if name == weight or key in ("exp_avg", "exp_avg_sq") else torch.Size([])
            if t.shape != want:
                return f"'{name[:80]}' has shape {list(t.shape)}, expected {list(want)}"
        return ""

    def _diverged(self, stage: int, step: int, sender: str) -> Exception:
        """A stage's state after ``step`` steps is not finite (its inputs were: receivers
        check them): the run stops rather than save it; the last checkpoint stays."""

        last = self.st.checkpoint
        kept = (
            f"the last finite checkpoint (step {last.step}) is in {last.path}" if last else "no checkpoint was written"
        )
        return SwarmError(
            f"the weights of stage {stage} (peer {sender}) are not finite after step {step}: the training diverged "
            f"(try a lower --lr, --clip-grad-norm, or fp32); nothing non-finite was saved; {kept}"
        )

    async def _write(self, step: int, stages: list[dict[str, torch.Tensor]]) -> None:
        st, plan = self.st, self.st.plan
        assert plan is not None
        info = {"cut": plan.cut.to_list(), "stages": plan.stages, "codecs": [str(c) for c in st.codecs]}
        self._note_unaudited(step)  # type: ignore[attr-defined]  # before the save: a stop may cut it short
        t0 = time.perf_counter()
        saved = await asyncio.get_running_loop().run_in_executor(
            None, self.run_dir.save_checkpoint, step, st.epoch, stages, info
        )
        seconds = time.perf_counter() - t0
        st.checkpoint_s.append(seconds)
        asked = st.asked_at.pop(step, None)
        if asked is not None:  # what a checkpoint costs, from the commit that asked for it to written
            st.checkpoint_cost_s = time.perf_counter() - asked
        if st.checkpoint is None or saved.step >= st.checkpoint.step:
            st.checkpoint = saved
        self.coord.board.checkpoint(step, str(saved.path), seconds, saved.nbytes)
        if step >= self.job.steps:
            merged: dict[str, torch.Tensor] = {}
            for part in stages:
                merged.update({n: t for n, t in part.items() if not n.startswith(OPTIM_PREFIX)})
            self.final = merged

    async def _flush_writes(self) -> None:
        writes, self.st.writes = self.st.writes, []
        for t in writes:
            try:
                await t
            except Exception as exc:  # a failed write leaves the previous checkpoint in place
                logger.error("writing a checkpoint failed: %s", exc)
                self.on_event(f"writing a checkpoint failed: {exc}")

    def _stage_states(self, cut: Cut) -> list[dict[str, torch.Tensor]]:
        """Each stage's part of the last checkpoint (weights and optimizer state), or of
        the starting weights before the first."""

        names = self._stage_names(cut)
        if self.st.checkpoint is None:
            assert self.init_state is not None
            return [{n: t for n, t in self.init_state.items() if n in own} for own in names]
        try:
            merged = self.run_dir.load(self.st.checkpoint)
        except CheckpointError as exc:
            raise SwarmError(f"cannot read the checkpoint of step {self.st.checkpoint.step}: {exc}") from None
        return [{n: t for n, t in merged.items() if owner(n) in own} for own in names]

    def _stage_names(self, cut: Cut) -> list[set[str]]:
        if cut.boundaries not in self._names:
            _, modules = stage_modules(self.model, cut)
            self._names[cut.boundaries] = [set(m.state_dict()) for m in modules]
        return self._names[cut.boundaries]
