"""Where the coordinator and a peer listen and what the join line names (issue 30):
the address choice and ``--announce`` without a network, the one-line errors of
``--port`` and ``--announce``, and what a join that reaches no one says."""

from __future__ import annotations

import argparse
import asyncio
import socket

import pytest
from conftest import run_cli

from fusionllm.addresses import listen_options, reach_lines, status_lines
from fusionllm.usage import UsageError
from protocol.net.hostaddrs import (
    COORDINATOR_PORT,
    AddressError,
    JoinAddrs,
    announce_maddr,
    join_addrs,
    listen_maddrs,
)
from protocol.net.reach import why_unreachable

ID = "/p2p/12D3KooWF5BnuwaDnG1A9wAczUgZ8KkdwnR62QYywM4NsqxYgRFU"
#: what the p2p daemon reports listening on 0.0.0.0 and :: at 31337 on a host with a LAN
#: address, a link-local one, a Docker bridge, and a public address its peers observed
VISIBLE = [
    f"/ip4/127.0.0.1/tcp/31337{ID}",
    f"/ip4/192.168.1.5/tcp/31337{ID}",
    f"/ip4/169.254.3.3/tcp/31337{ID}",
    f"/ip4/172.17.0.1/tcp/31337{ID}",
    f"/ip6/::1/tcp/31337{ID}",
    f"/ip6/fe80::1/tcp/31337{ID}",
    f"/ip6/2001:db8::5/tcp/31337{ID}",
    f"/ip4/203.0.113.7/tcp/31337{ID}",
]
LOCAL = {"127.0.0.1", "192.168.1.5", "169.254.3.3", "172.17.0.1", "::1", "fe80::1", "2001:db8::5"}


def test_the_join_line_names_what_another_machine_can_dial_observed_first() -> None:
    got = join_addrs(VISIBLE, LOCAL)
    assert [m.split("/")[2] for m in got.maddrs] == ["203.0.113.7", "192.168.1.5", "172.17.0.1", "2001:db8::5"]
    assert got.observed == ["203.0.113.7"] and not got.loopback_only
    unknown = join_addrs(VISIBLE, None)  # interfaces not listed: the daemon's order, nothing observed
    assert unknown.observed == [] and unknown.maddrs[0].startswith("/ip4/192.168.1.5/")
    relayed = join_addrs([*VISIBLE[:2], f"/ip4/203.0.113.9/tcp/4001{ID}/p2p-circuit{ID}"], LOCAL)
    assert [m.split("/")[2] for m in relayed.maddrs] == ["192.168.1.5"]


def test_a_host_with_only_loopback_keeps_it_and_says_so() -> None:
    only = [f"/ip4/127.0.0.1/tcp/31337{ID}", f"/ip6/::1/tcp/31337{ID}", f"/ip6/fe80::2/tcp/31337{ID}"]
    got = join_addrs(only, {"127.0.0.1", "::1", "fe80::2"})
    assert got.loopback_only and got.maddrs == only
    [line] = reach_lines(got, [31337], False, listen_maddrs(31337))
    assert "no address other machines can reach" in line and "works here only" in line
    assert reach_lines(got, [5], False, ["/ip4/127.0.0.1/tcp/0"]) == [], "loopback asked for (the demo): no news"


def test_announce_replaces_the_addresses_and_the_port_line_says_so() -> None:
    announced = [f"/ip4/127.0.0.1/tcp/4242{ID}"]  # even loopback, when that is what the user announced
    got = join_addrs(announced, LOCAL, announced=True)
    assert got == JoinAddrs(announced, [], False)
    [line] = reach_lines(got, [31337], True, listen_maddrs(31337))
    assert "--announce address" in line and "TCP port 31337" in line
    [line] = reach_lines(got, [], True, listen_maddrs(0))
    assert "any free port: fix one with --port" in line
    [line] = reach_lines(join_addrs(VISIBLE, LOCAL), [31337], False, listen_maddrs(31337))
    assert line.startswith("other machines must reach TCP port 31337 here") and "203.0.113.7" in line


@pytest.mark.parametrize(
    ("value", "port", "maddr"),
    [
        ("203.0.113.7", 31337, "/ip4/203.0.113.7/tcp/31337"),
        ("203.0.113.7:4000", 0, "/ip4/203.0.113.7/tcp/4000"),
        ("2001:db8::1", 9, "/ip6/2001:db8::1/tcp/9"),
        ("[2001:db8::1]:4000", 0, "/ip6/2001:db8::1/tcp/4000"),
        ("swarm.example.org:4000", 0, "/dns/swarm.example.org/tcp/4000"),
        ("/ip4/203.0.113.7/tcp/4000", 0, "/ip4/203.0.113.7/tcp/4000"),
    ],
)
def test_announce_takes_an_ip_a_host_and_port_or_a_multiaddr(value: str, port: int, maddr: str) -> None:
    assert announce_maddr(value, port) == maddr


@pytest.mark.parametrize(
    ("value", "port", "needle"),
    [
        ("203.0.113.7", 0, "no port"),
        ("203.0.113.7:0", 0, "not a port"),
        ("203.0.113.7:http", 0, "not a port"),
        ("0.0.0.0", 31337, "not an address another machine can dial"),
        ("not a host:80", 0, "neither an IP address nor a host name"),
        ("/ip4/203.0.113.7/udp/4000", 0, "/tcp/PORT"),
        ("/nonsense", 0, "not a valid multiaddr"),
        ("[2001:db8::1]4000", 0, "[ADDRESS]:PORT"),
    ],
)
def test_announce_refuses_what_cannot_be_dialled(value: str, port: int, needle: str) -> None:
    with pytest.raises(AddressError, match=needle.replace("[", r"\[")):
        announce_maddr(value, port)


def test_listen_options_port_host_maddrs_and_announce() -> None:
    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"port": None, "host_maddrs": None, "announce": [], **kw})

    assert listen_options(args(port=0), COORDINATOR_PORT) == (listen_maddrs(0), [])
    host, announce = listen_options(args(port=0, announce=["203.0.113.7:4000"]), COORDINATOR_PORT)
    assert announce == ["/ip4/203.0.113.7/tcp/4000"]
    loop = listen_options(args(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), COORDINATOR_PORT)
    assert loop == (["/ip4/127.0.0.1/tcp/0"], [])
    with pytest.raises(UsageError, match="give one"):
        listen_options(args(port=5, host_maddrs=["/ip4/127.0.0.1/tcp/0"]), COORDINATOR_PORT)
    with pytest.raises(UsageError, match="--announce '1.2.3.4': no port"):
        listen_options(args(port=0, announce=["1.2.3.4"]), COORDINATOR_PORT)


def test_the_status_page_line_says_how_to_reach_it_from_elsewhere() -> None:
    join = join_addrs(VISIBLE, LOCAL)
    url, hint = status_lines("http://127.0.0.1:8470/", join)
    assert url == "status page: http://127.0.0.1:8470/"
    assert "ssh -L 8470:127.0.0.1:8470 <you>@203.0.113.7" in hint and "--status-host 0.0.0.0" in hint
    assert "http://203.0.113.7:9000/" in status_lines("http://0.0.0.0:9000/", join)[1]
    assert status_lines("http://192.168.1.5:8470/", join) == ["status page: http://192.168.1.5:8470/"]


def test_why_unreachable_tells_refused_from_open() -> None:
    async def main() -> tuple[str, str]:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = server.sockets[0].getsockname()[1]
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        try:
            return (
                await why_unreachable([f"/ip4/127.0.0.1/tcp/{closed}{ID}"], timeout=2),
                await why_unreachable([f"/ip4/127.0.0.1/tcp/{open_port}{ID}", f"/ip4/127.0.0.1/tcp/{closed}"], 2),
            )
        finally:
            server.close()

    refused, opened = asyncio.run(main())
    assert "(refused)" in refused and "the coordinator is no longer running" in refused
    assert "(open)" in opened and "wrong port or peer id" in opened
    assert "with a TCP port" in asyncio.run(why_unreachable(["/dns/x/udp/5"]))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9{ID}", "--port", "70000"], "--port: 70000 is not a port"),
        (["coordinator", "--port", "-1"], "--port: -1 is not a port"),
        (["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9{ID}", "--announce", "1.2.3.4"], "no port"),
        (["coordinator", "--announce", "nope nope:1"], "neither an IP address nor a host name"),
        (["coordinator", "--port", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "give one"),
    ],
    ids=["join-port", "coordinator-port", "join-announce", "coordinator-announce", "both"],
)
def test_bad_port_and_announce_values_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = run_cli(*args, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_a_taken_port_and_an_unreachable_coordinator_are_one_line_each(tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli("coordinator", "--port", str(port), "--identity", str(tmp_path / "c.key"), timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"port {port} on 0.0.0.0 is taken" in lines[0], r.stderr
    r = run_cli("join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}{ID}", "--identity", str(tmp_path / "p.key"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"could not reach any initial peer: 127.0.0.1:{port} (refused): nothing listens there" in lines[0]
