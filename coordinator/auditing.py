"""The coordinator's spot checks (``protocol.trust.spotcheck``), as a run schedules
them: each micro-batch of a stage is re-executed with probability ``spot_check``:
by another replica of a replicated stage, or (a stage served by one peer) by peers
of other stages, from the weights the suspect shows. ``coordinator.spotchecks``
runs one step's checks; :class:`Auditor` decides which, runs them beside the
training, and says what they found.

The checks of a step run while the next step trains: its ``Commit`` tells the
peers of the checked stages to keep a copy of their weights as they were
(``Commit.audit``), and every peer keeps the frames it received in the last
committed step. The next step's commit waits for them; so does a change of plan
(a lost peer, a rebalance), at most ``AUDIT_GRACE_S``. The last step's checks run
before its commit, so the run's result is never left unchecked.

The coordinator asks the peers around the checked one (the *suspect*) for the
signed frames they received (``Audit``), checks that each is what its signer sent
for that micro-batch, and sends them to a replica (``Recheck``), which runs the
micro-batch from the same inputs with the same weights and compares with the
suspect's signed outputs, its parameter gradients and (last stage) its loss.

On a mismatch more peers re-execute it (``SpotChecker.settle``): other replicas, or
else peers of another stage, which rebuild the stage from the job with the weights
both replicas show (they must be the same, bit for bit). A disagreeing checker says
what it computed (a fingerprint): the suspect is excluded when two checkers computed
the same and not what it showed; checkers who disputed work that another re-executed
the same are excluded. The signed frames are kept in the run directory
(``evidence/``) and named on the status page. When no two re-executions agree (or
no one else can re-execute it) all of them leave the plan, none excluded (they may
come back as standby peers). A peer that cannot show the frames it received, or
shows frames their signers did not send, is excluded. Whatever a check of a
committed step finds, or a check that cannot finish, rolls the run back to the
last checkpoint before that step (newer ones are dropped), and the steps since are
redone without the peers it found out."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from coordinator.checkpoint import RunDir
from coordinator.messaging import Mailbox
from coordinator.runstate import PeerLost, RunState
from coordinator.spotchecks import Check, SpotChecker
from protocol.net.clock import Clock
from protocol.net.tasks import cancel_and_wait
from protocol.trust.spotcheck import BACKWARD_SHARE, lone_draw

#: how long spot checks under way may still take when the plan must change (then they are given up)
AUDIT_GRACE_S = 10.0
#: the run directory's record of checkpoints written while an earlier step's spot checks were
#: under way: {checkpoint step: the checked step}, each cleared when its checks pass
UNAUDITED = "unaudited"

logger = logging.getLogger(__name__)


def sample_checks(stages: list[list[str]], rate: float, micro_batches: int, rng: random.Random) -> list[Check]:
    """The (stage, micro-batch, backward too) of a step to re-execute: each micro-batch
    of a replicated stage with the ``rate`` chance; those of a stage of one peer as
    many on average, drawn together (``lone_draw``); the backward with
    ``BACKWARD_SHARE`` of that (none where one peer serves the only stage)."""
    if rate <= 0 or (len(stages) < 2 and len(stages[0]) < 2):
        return []
    drawn: list[tuple[int, int]] = []
    for s, group in enumerate(stages):
        if len(group) > 1:
            drawn += [(s, mb) for mb in range(micro_batches) if rng.random() < rate]
            continue
        chance, k = lone_draw(rate, micro_batches)
        if rng.random() < chance:
            drawn += [(s, mb) for mb in sorted(rng.sample(range(micro_batches), k))]
    return [(s, mb, rng.random() < BACKWARD_SHARE) for s, mb in drawn]


class Auditor:
    """Which micro-batches a step checks, the checks under way, and the run
    directory's record of checkpoints written before they passed."""

    def __init__(
        self,
        st: RunState,
        rate: float,
        micro_batches: int,
        checker: SpotChecker,
        mailbox: Mailbox,
        run_dir: RunDir,
        clock: Clock,
        on_event: Callable[[str], None],
    ) -> None:
        self.st = st
        self.rate = rate
        self.micro_batches = micro_batches
        self.checker = checker
        self.mailbox = mailbox
        self.run_dir = run_dir
        self.clock = clock
        self.on_event = on_event
        self._audit: tuple[int, asyncio.Task[None]] | None = None  # the committed step whose checks are under way
        self._marked = False  # whether the run directory records a checkpoint written while checks were under way

    @property
    def under_way(self) -> bool:
        return self._audit is not None

    def sample(self) -> list[Check]:
        """This step's checks (``sample_checks`` on the plan)."""
        assert self.st.plan is not None
        return sample_checks(self.st.plan.stages, self.rate, self.micro_batches, self.checker.rng)

    async def check_now(self, step: int, checks: list[Check], losses: dict[str, float]) -> None:
        """Check ``step`` before its commit (``PeerLost`` on what the checks find)."""
        await self.checker.run(step, checks, losses)

    def start(self, step: int, checks: list[Check], losses: dict[str, float]) -> None:
        """Spot-check committed ``step`` while the next one trains (its peers hold what
        it needs: ``Commit.audit``); ``outcome`` raises what it found."""
        task = asyncio.get_running_loop().create_task(self.checker.run(step, checks, dict(losses)))
        self._audit = (step, task)

    def outcome(self) -> None:
        """If the audit under way has ended: forget it, and raise ``PeerLost`` (with a
        rollback to before its step) if it found a peer out."""
        if self._audit is None or not self._audit[1].done():
            return
        step, task = self._audit
        self._audit = None
        exc = task.exception()
        if exc is None:  # passed: the checkpoints written meanwhile are trusted
            self.unmark(lambda _, checked: checked == step)
        if isinstance(exc, PeerLost):
            raise PeerLost(exc.lost, rollback_to=step)
        if exc is not None:
            raise exc

    async def settled(self, grace: float | None = None) -> None:
        """Wait for the audit under way (within ``grace`` seconds: then it is given up,
        and the run rolls back to before its step); raises what it found."""
        if self._audit is None:
            return
        step, task = self._audit
        nap = asyncio.ensure_future(self.clock.sleep(grace)) if grace is not None else None
        try:
            await asyncio.wait({task} if nap is None else {task, nap}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if nap is not None:
                nap.cancel()
        if not task.done():
            await self.drop()
            raise PeerLost({}, rollback_to=step)
        self.outcome()

    async def drop(self) -> None:
        """Cancel the audit under way and wait until it has ended (what it was sending
        must not outlive the transport, nor fail unobserved)."""
        if self._audit is None:
            return
        task = self._audit[1]
        self._audit = None
        await cancel_and_wait(task, AUDIT_GRACE_S)

    async def before_recovery(self, lost: dict[str, str], rollback_to: int | None) -> tuple[dict[str, str], int | None]:
        """The plan changes: the spot checks under way end first (at once where they wait
        for a lost peer, at most ``AUDIT_GRACE_S``); what they find is lost too, and one
        that fails or cannot finish rolls the run back to before its step."""
        for p, why in lost.items():
            self.mailbox.fail(p, why)
        try:
            await self.settled(AUDIT_GRACE_S)
        except PeerLost as exc:
            return {**exc.lost, **lost}, exc.rollback_to
        return lost, rollback_to

    # ------------------------------------------------------------------ the run directory's record
    def note_unaudited(self, checkpoint_step: int) -> None:
        """A checkpoint was written while the spot checks of an earlier step (whose update
        it holds) are under way: a resume must not start from it unless they pass."""
        if self._audit is None or self._audit[0] >= checkpoint_step:
            return
        marks = {**self.run_dir.get_meta(UNAUDITED, {}), str(checkpoint_step): self._audit[0]}
        self.run_dir.set_meta(UNAUDITED, marks)
        self._marked = True

    def unmark(self, settled: Callable[[int, int], bool]) -> None:
        """Forget the records (checkpoint step, checked step) that ``settled``: their
        checks passed, or a rollback dropped their checkpoints."""
        if not self._marked:  # nothing recorded (the common case: no read)
            return
        marks = self.run_dir.get_meta(UNAUDITED, {})
        left = {c: s for c, s in marks.items() if not settled(int(c), s)}
        self.run_dir.set_meta(UNAUDITED, left)
        self._marked = bool(left)

    def drop_unaudited(self) -> None:
        """On resume: checkpoints written while spot checks were under way that never
        finished (the coordinator stopped) hold an update no one verified: dropped, so
        the run resumes from before the checked step."""
        marks = self.run_dir.get_meta(UNAUDITED, {})
        if not marks:
            return
        step = min(marks.values())
        self.run_dir.drop_after(step)
        self.run_dir.set_meta(UNAUDITED, {})
        self.on_event(
            f"the spot checks of step {step} had not passed when the coordinator stopped: "
            f"the checkpoints written since are dropped"
        )
