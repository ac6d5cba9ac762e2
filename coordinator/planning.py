"""Plans for a run: OP-Fence over the peers' adverts (or their measured speeds), with
the peers behind a NAT and the links probed so far; before the run's first plan is
committed, the guessed links that decide it probed on request (``link_asking``); and
the standby pool (admitted peers outside the plan)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator import pinned
from coordinator.assign import Assignment, assign, network_from_adverts
from coordinator.host import Host
from coordinator.link_asking import LinkAsker, asked_line
from coordinator.opdag import OpDag
from coordinator.outcome import SwarmError
from coordinator.runstate import RunState
from protocol.wire.messages import Advert

logger = logging.getLogger(__name__)


class Planner:
    def __init__(
        self,
        host: Host,
        st: RunState,
        dag: OpDag,
        micro_batches: int,
        asker: LinkAsker | None = None,
        say: Callable[[str], None] = lambda text: None,
    ) -> None:
        self.host = host
        self.st = st
        self.dag = dag
        self.micro_batches = micro_batches
        self.asker = asker  # None: plans are committed on the guesses
        self.say = say

    def plan(
        self,
        adverts: list[Advert],
        keep_out: int = 0,
        leave_out: bool = False,
        links: dict[tuple[str, str], float] | None = None,
        nat: set[str] | None = None,
    ) -> Assignment:
        """OP-Fence over ``adverts``; the ``keep_out`` slowest wait as standby, and with
        ``leave_out`` OP-Fence may leave more out where that is faster. ``links`` and
        ``nat``: the links probed so far and the peers behind NATs as given (a copy,
        for a plan made on another thread), else as the run knows them now."""
        try:
            testbed = pinned.from_env()  # the emulated testbed runs the plan it made
            if testbed is not None:
                return testbed.assignment(adverts)
        except ValueError as exc:
            raise SwarmError(f"cannot plan the run: {exc}") from None
        ranked = sorted(adverts, key=lambda a: -a.flops)
        use = ranked[: max(len(ranked) - keep_out, 1)]
        stages = self.host.config.num_stages
        k = min(stages, len(use)) if stages else None if leave_out else len(use)
        try:
            nat = self.behind_nat() if nat is None else nat
            links = self.st.link_mbps if links is None else links
            mode = self.host.config.compression  # under auto, the plan's priced codecs are the ones that run
            rank = self.host.config.lowrank_rank
            plan = assign(self.dag, use, k, self.micro_batches, leave_out, links, nat=nat, compression=mode, rank=rank)
        except ValueError as exc:
            raise SwarmError(f"cannot plan the run: {exc}") from None
        if plan.deciding:  # asked by plan_asking (the first plan); later, the epochs' own probes answer them
            shown = ", ".join(f"{a[:8]}-{b[:8]}" for a, b in plan.deciding)
            logger.info(
                "the plan rests on %d guessed links that decide between its finalists: %s", len(plan.deciding), shown
            )
        return plan

    async def plan_asking(self, adverts: list[Advert], keep_out: int = 0) -> Assignment:
        """``plan``; when it rests on guessed links that decide between its finalists,
        those are probed (at most ``asker.wait_s``), what was measured joins the links
        probed so far, and the run is planned once more (no second round). The run's
        events say which links were probed, what they measured against the guess, and
        whether the plan changed."""
        plan = self.plan(adverts, keep_out=keep_out)
        if not plan.deciding or self.asker is None:
            return plan
        nat = self.behind_nat()
        guessed = network_from_adverts(adverts, self.st.link_mbps, nat)
        readings = await self.asker.ask(plan.deciding, {a.peer_id: a for a in adverts}, nat)
        for r in readings:
            if r.mbps is not None:
                self.st.learn_links(r.prober, {r.target: r.mbps})
        again = self.plan(adverts, keep_out=keep_out) if any(r.mbps is not None for r in readings) else plan
        if readings:
            self.say(asked_line(readings, guessed, plan.stages, again.stages))
        return again

    def behind_nat(self) -> set[str]:
        """Admitted peers that could not be dialled back."""
        return {p for p, direct in self.host.reached.items() if not direct}

    def standby(self) -> list[str]:
        """Admitted peers with a live advert outside the plan and not lost, fastest first."""
        planned = self.st.planned
        pool = [a for p, a in self.host.adverts.items() if p not in planned and p not in self.st.lost]
        return [a.peer_id for a in sorted(pool, key=lambda a: -a.flops)]

    async def refresh_adverts(self) -> None:
        """Read the live adverts again (planned peers keep theirs through a DHT hiccup)."""
        self.host.keep_adverts(await self.host.live_adverts(), self.st.planned)
