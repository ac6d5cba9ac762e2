"""The training driver of a swarm run: phases (plan, dispatch, step, collect,
recover) over an explicit :class:`RunState`, keyed on the plan epoch, carried out by
components that each own their part of the run:

- ``messaging.Mailbox``: sends, the inbox loop every phase waits in, peers' health;
- ``planning.Planner``: OP-Fence over the peers, the standby pool;
- ``dispatch.Dispatcher``: setting a plan epoch up, and telling peers the run is over;
- ``pipeline.StepPipeline``: one training step, its commit, the validation passes;
- ``checkpointing.Checkpoints``: when to checkpoint, taking and writing them;
- ``auditing.Auditor`` (with ``spotchecks.SpotChecker``): spot checks;
- ``rebalancing.Rebalancer``: measured speeds and moves to a faster plan;
- ``recovery.Recovery``: a new epoch without lost peers, with or without a rollback;
- ``scaling.LossScales``: the loss scale across steps; ``stages.Stages``: the model.

A step is two-phase: peers run their forward and backward passes and report
``StepDone``; only when every planned peer has, the coordinator counts the step
and sends ``Commit``, and only then do peers apply the optimizer update. So when
a peer is lost mid-step, no survivor has applied that step, and it can be redone
exactly. A new plan epoch keeps the survivors' state when every stage kept a
peer (replicas), and otherwise rolls every stage back to the last checkpoint and
replays the deterministic data stream from there.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import torch

from coordinator.auditing import AUDIT_GRACE_S, Auditor
from coordinator.checkpoint import RunDir
from coordinator.checkpointing import Checkpoints
from coordinator.dispatch import Dispatcher
from coordinator.host import Host
from coordinator.link_asking import LinkAsker
from coordinator.messaging import Mailbox
from coordinator.outcome import StepReport, SwarmError
from coordinator.pipeline import StepPipeline
from coordinator.planning import Planner
from coordinator.rebalancing import Rebalancer
from coordinator.recovery import Recovery
from coordinator.runstate import PeerLost, RunState
from coordinator.scaling import LossScales
from coordinator.spotchecks import SpotChecker
from coordinator.stages import Stages
from protocol.net.clock import SYSTEM_CLOCK, Clock
from protocol.net.transport import Inbound

logger = logging.getLogger(__name__)


class Driver:
    """Runs one job on a started coordinator (its :class:`Host` side) through plan epochs."""

    def __init__(
        self,
        host: Host,
        stages: Stages,
        run_dir: RunDir,
        on_step: Callable[[StepReport], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host = host
        self.cfg = host.config
        self.stages = stages
        self.run_dir = run_dir
        self.on_event = on_event or (lambda text: None)
        self.st = RunState()
        host.board.stages_as = "program" if stages.as_programs else "code"
        #: the most a peer's payload to the coordinator may take (the host's gate reads it)
        self.max_payload_bytes = stages.max_payload_bytes
        self._build(clock, on_step)

    def _build(self, clock: Clock, on_step: Callable[[StepReport], None] | None) -> None:
        """The components, each given the narrow parts of the others it uses."""
        host, st, stages, run_dir, say, job = self.host, self.st, self.stages, self.run_dir, self._say, self.stages.job
        mailbox = Mailbox(host, st, clock, say)
        scales = LossScales(stages.recipe, run_dir)
        self.asker = LinkAsker(host, clock, self.cfg.ask_links_s) if self.cfg.ask_links_s > 0 else None
        planner = Planner(host, st, stages.dag, job.micro_batches, self.asker, say)
        #: seeded from the OS: peers cannot predict which micro-batch is checked
        checker = SpotChecker(host, st, stages, mailbox, run_dir, random.Random(), clock, say)
        auditor = Auditor(st, self.cfg.spot_check, job.micro_batches, checker, mailbox, run_dir, clock, say)
        every = self.cfg.checkpoint_every
        checkpoints = Checkpoints(st, stages, run_dir, host.board, every, clock, auditor.note_unaudited, say)
        rebalancer = Rebalancer(host, st, stages.dag, job, planner, checkpoints, mailbox, auditor, clock, say)
        self.dispatcher = Dispatcher(host, st, stages, planner, checkpoints, scales, mailbox, run_dir, clock, say)
        self.pipeline = StepPipeline(
            host, st, stages, mailbox, auditor, checkpoints, rebalancer, scales, run_dir, clock, on_step, say
        )
        self.recovery = Recovery(
            host, st, stages, planner, mailbox, auditor, checkpoints, rebalancer, scales, run_dir, say
        )
        self.mailbox, self.scales, self.planner, self.auditor = mailbox, scales, planner, auditor
        self.checkpoints, self.rebalancer = checkpoints, rebalancer
        self.mailbox.on_wait(self.auditor.outcome)
        self.mailbox.on_part(self.checkpoints.take_part)
        #: peers asked for spot-check evidence (the host's gate expects their payloads)
        self.auditing = checker.asked

    @classmethod
    def open(
        cls,
        host: Host,
        model: torch.nn.Module,
        run_dir: RunDir,
        on_step: Callable[[StepReport], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> Driver:
        """A driver for ``model``'s job: traces it, reads ``--init`` and tries the export
        to ATen programs (``Stages.load``; SwarmError if ``--init`` does not fit)."""
        say = on_event or (lambda text: None)
        return cls(host, Stages.load(model, host.config.job, host.config, say), run_dir, on_step, on_event, clock)

    def _say(self, text: str) -> None:
        self.on_event(text)

    @property
    def final(self) -> dict[str, torch.Tensor] | None:
        """The trained weights, once the last step's checkpoint is written."""
        return self.checkpoints.final

    def fail(self, peer: str, why: str) -> None:
        """Drop a planned peer at the next health check (as if its link had died)."""
        self.mailbox.fail(peer, why)

    def take_answer(self, inbound: Inbound) -> None:
        """A spot-check answer from a planned peer (the host sets them apart)."""
        self.auditor.checker.take_answer(inbound)

    def take_probe(self, inbound: Inbound) -> None:
        """A peer's result of a probe the planner asked for (the host sets them apart)."""
        if self.asker is not None:
            self.asker.take(inbound)

    # ------------------------------------------------------------------ the run
    async def run(self, resume: bool, on_peers: Callable[[int], None] | None = None) -> RunState:
        """Train to the job's last step; returns the final state (``self.final`` holds
        the trained weights). Raises SwarmError when no plan fits the peers left."""
        await (self.resume if resume else self.begin)(on_peers)
        self.host.gate.listeners.append(self.mailbox.on_reject)
        watcher = asyncio.create_task(self.mailbox.watch_links())
        try:
            while self.final is None:
                try:
                    await self.phase()
                except PeerLost as exc:
                    await self.recovery.recover(exc.lost, exc.rollback_to)
        finally:
            watcher.cancel()
            self.rebalancer.stop()
            await self.auditor.drop()
            await self.mailbox.close(AUDIT_GRACE_S)
        await self.dispatcher.release()
        return self.st

    async def phase(self) -> None:
        """The phase the run is in: set the epoch up, train a step, or collect the result."""
        if not self.st.dispatched:
            await self.dispatcher.dispatch()
        elif self.st.step < self.stages.job.steps:
            await self.pipeline.step()
        else:
            await self.collect()

    async def begin(self, on_peers: Callable[[int], None] | None) -> None:
        """A new run: the first plan, once enough peers have joined."""
        adverts = await self.host.wait_for_peers(on_peers)
        self.st.plan = await self.planner.plan_asking(list(adverts.values()), keep_out=self.cfg.standby)
        self.st.restore = self.stages.restore_at(0)
        self.run_dir.set_meta("job", self.cfg.job_fields())

    async def resume(self, on_peers: Callable[[int], None] | None) -> None:
        """A restarted coordinator: from the run directory's last trusted checkpoint."""
        st, run_dir = self.st, self.run_dir
        self.auditor.drop_unaudited()
        info = run_dir.latest()
        self.checkpoints.latest = info
        st.step = info.step if info else 0
        st.losses = run_dir.losses()[: st.step]
        st.epoch = int(run_dir.get_meta("epoch", -1)) + 1
        st.restore, st.reason = self.stages.restore_at(st.step), "the coordinator restarted"
        self.scales.resume(st.step)
        st.val_losses = [(int(n), float(v)) for n, v in run_dir.get_meta("val_losses", []) if n <= st.step]
        self.host.board.resumed(st.step, str(run_dir.path))
        self.host.board.restore_losses(st.losses)
        self.on_event(f"resuming run '{self.cfg.run_id}' from the checkpoint of step {st.step} in {run_dir.path}")
        adverts = await self.host.wait_for_peers(on_peers)
        st.plan = await self.planner.plan_asking(list(adverts.values()), keep_out=self.cfg.standby)

    async def collect(self) -> None:
        """Wait for the last step's checkpoint (every stage's replica 0 sends it) and
        write it; its weights are the run's result."""
        ckpts = self.checkpoints
        await self.mailbox.next((), set(), until=lambda: ckpts.final_write is not None)
        assert ckpts.final_write is not None
        try:
            await ckpts.final_write
        except Exception as exc:
            raise SwarmError(f"writing the final checkpoint failed: {exc}") from None
