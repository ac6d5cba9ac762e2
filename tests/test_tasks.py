"""The shared periodic loop, bounded wait and fake clock (protocol.net)."""

from __future__ import annotations

import asyncio
import logging

from protocol.net.clock import FakeClock
from protocol.net.tasks import every, unless_set, wait_until


def test_every_ticks_once_a_period_survives_a_failing_tick_and_stops_when_told() -> None:
    async def main() -> list[float]:
        clock, seen = FakeClock(), []

        async def tick() -> bool:
            seen.append(clock.now())
            if len(seen) == 2:
                raise ConnectionError("a failing tick is logged, not fatal")
            return len(seen) == 4

        loop = asyncio.create_task(every(2.0, tick, what="test loop", clock=clock, first=0.5))
        await clock.advance(10.0)
        assert loop.done() and loop.exception() is None
        return seen

    assert asyncio.run(main()) == [0.5, 2.5, 4.5, 6.5]


def test_wait_until_returns_what_the_probe_found_or_none_at_its_deadline() -> None:
    async def main() -> tuple[object, object, float]:
        clock, asked = FakeClock(), []

        async def probe_found_third_time() -> str | None:
            asked.append(clock.now())
            return "found" if len(asked) == 3 else None

        async def probe_never() -> None:
            return None

        found = asyncio.create_task(wait_until(probe_found_third_time, 30.0, interval=1.0, clock=clock))
        await clock.advance(5.0)
        never = asyncio.create_task(wait_until(probe_never, 3.5, interval=1.0, clock=clock))
        await clock.advance(10.0)
        return found.result(), never.result(), asked[-1]

    found, never, last = asyncio.run(main())
    assert (found, never, last) == ("found", None, 2.0)


def test_a_cancel_ends_every_even_inside_a_failing_tick() -> None:
    async def main() -> bool:
        clock = FakeClock()

        async def tick() -> None:
            raise OSError("down")

        loop = asyncio.create_task(every(1.0, tick, what="test loop", clock=clock))
        await clock.advance(3.0)
        loop.cancel()
        await asyncio.sleep(0)
        return loop.cancelled()

    assert asyncio.run(main())


def test_every_says_a_failing_tick_at_the_level_asked(caplog) -> None:
    async def main() -> None:
        clock = FakeClock()

        async def tick() -> None:
            raise OSError("the DHT hiccuped")

        loop = asyncio.create_task(every(1.0, tick, what="advert refresh", clock=clock, level=logging.WARNING))
        await clock.advance(1.0)
        loop.cancel()

    with caplog.at_level(logging.DEBUG, logger="protocol.net.tasks"):
        asyncio.run(main())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "protocol.net.tasks"]
    assert said == [(logging.WARNING, "advert refresh failed: the DHT hiccuped")]


def test_unless_set_gives_the_wait_its_answer_or_cancels_it_once_the_event_is_set() -> None:
    async def main() -> tuple[object, object, bool]:
        clock, event = FakeClock(), asyncio.Event()

        async def answer(after: float) -> str:
            await clock.sleep(after)
            return "answered"

        first = asyncio.create_task(unless_set(answer(1.0), event, 1.0))
        await clock.advance(2.0)
        long = asyncio.ensure_future(answer(100.0))
        second = asyncio.create_task(unless_set(long, event, 1.0))
        await clock.advance(5.0)
        assert not second.done()
        event.set()
        return await first, await second, long.cancelled()

    assert asyncio.run(main()) == ("answered", None, True)
