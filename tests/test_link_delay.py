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


def test_a_peer_is_delayed_by_the_first_listed_host_of_its_addresses() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    table = DelayTable({"10.78.0.3": 0.03}, sleep=fake_sleep)
    addrs = ["/ip4/127.0.0.1/tcp/4001/p2p/Qm", "/ip4/10.78.0.3/tcp/4001"]
    assert table.delay_for(addrs) == pytest.approx(0.03)
    asyncio.run(table.wait_addrs(addrs))
    asyncio.run(table.wait_addrs(["/ip4/10.78.0.9/tcp/1"]))  # not listed: no wait
    asyncio.run(table.wait_addrs([]))
    assert slept == [0.03]
    assert not DelayTable() and table


def test_the_transport_waits_the_delay_of_the_destination_it_learnt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The send path's hook: ``Transport.transmit`` waits the table's delay for the
    addresses it learnt for the destination, before anything is written."""
    from protocol.net import transport as tp_mod
    from protocol.net.outgoing import Outgoing

    order: list[str] = []

    async def fake_sleep(seconds: float) -> None:
        order.append(f"sleep {seconds:g}")

    async def fake_write(key: str, peer_id: str, protocol: str, buffers: list[bytes]) -> int:
        order.append(f"write {peer_id}")
        return sum(len(b) for b in buffers)

    tp = tp_mod.Transport.__new__(tp_mod.Transport)  # no p2p daemon: only the send path's state
    tp.pacer = tp_mod.Pacer()
    tp.delays = DelayTable({"10.78.0.3": 0.04}, sleep=fake_sleep)
    tp._known = {"peerB": ["/ip4/10.78.0.3/tcp/5"]}
    tp.forward_via = {}
    tp.bytes_sent, tp.raw_sent = {"peerB": 0}, {"peerB": 0}
    monkeypatch.setattr(tp, "_write", fake_write)
    asyncio.run(tp.transmit(Outgoing("peerB", b"head", [memoryview(b"xy")], 2)))
    assert order == ["sleep 0.04", "write peerB"]
