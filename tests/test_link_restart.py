"""A peer whose coordinator restarted (``--resume``: the same libp2p node, which admits
nobody yet) says hello again on the next read of its record, rather than having its
frames refused as not admitted until it gives up."""

from __future__ import annotations

import asyncio

from hivemind.utils import get_dht_time

from protocol.net.clock import FakeClock
from protocol.trust.identity import Identity
from protocol.wire.messages import CoordinatorRecord
from tests.test_discovery_layout import RUN, _link


def test_a_new_start_of_the_coordinator_is_taken_as_lost_and_a_stale_copy_is_not() -> None:
    coordinator, clock = Identity.generate(), FakeClock()
    expires = get_dht_time() + 60
    link, answers = _link(CoordinatorRecord("coord", [], RUN, expires, 1, "first"), coordinator, clock)
    told: list[str] = []
    answers.append(CoordinatorRecord("coord", [], RUN, expires + 10, 1, "first"))  # a refresh of the same start
    asyncio.run(link.follow(told.append))
    assert told == [] and not link.reattaching and link.record is not None and link.record.expires_at == expires + 10
    answers.append(CoordinatorRecord("coord", [], RUN, expires - 30, 1, "before"))  # a stale copy of an earlier start
    asyncio.run(link.follow(told.append))
    assert told == [] and not link.reattaching
    answers.append(CoordinatorRecord("coord", [], RUN, expires + 20, 1, "second"))  # restarted with --resume
    asyncio.run(link.follow(told.append))
    assert len(told) == 1 and "restarted" in told[0] and link.reattaching
    asyncio.run(link.follow(told.append))  # reattaching: reattach takes the record and says hello
    assert len(told) == 1
