"""The per-destination delay table the emulated testbed uses for latency."""

from __future__ import annotations

import asyncio

import pytest

from protocol.net.delay import ENV_VAR, DelayTable, parse_delays


def test_parse_delays_reads_hosts_and_milliseconds() -> None:
    assert parse_delays("10.77.0.2=40, 10.77.0.3=2.5,") == {
        "10.77.0.2": 0.04,
        "10.77.0.3": 0.0025,
    }
    assert parse_delays("") == {}


@pytest.mark.parametrize("bad", ["10.0.0.2", "=40", "10.0.0.2=x", "10.0.0.2=-1", "h=1e9"])
def test_parse_delays_refuses_bad_entries_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError, match=ENV_VAR) as err:
        parse_delays(bad)
    assert "\n" not in str(err.value)


def test_wait_sleeps_only_for_listed_hosts() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    table = DelayTable({"10.77.0.2": 0.04}, sleep=fake_sleep)
    asyncio.run(table.wait("10.77.0.2"))
    asyncio.run(table.wait("10.77.0.9"))
    assert slept == [0.04]


def test_from_env_reads_the_variable() -> None:
    table = DelayTable.from_env({ENV_VAR: "10.77.0.5=20"})
    assert table.delay_s("10.77.0.5") == pytest.approx(0.02)
    assert DelayTable.from_env({}).delay_s("10.77.0.5") == 0.0
