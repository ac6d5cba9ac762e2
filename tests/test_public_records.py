"""Every run's DHT records are checked on every node, public or private (issue 35,
items 1 and 2): the rule (``RunRecords``) refuses each kind of bad record under each
of the run's keys; refusals are said once per sender and period; a read is bounded;
and a public swarm forms and trains with an outsider's plain value and junk stored
under each of its keys before the peers join."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from protocol.net.clock import FakeClock
from protocol.net.records import _read
from protocol.trust.admission import issue_certificate
from protocol.trust.identity import Identity, sign_record
from protocol.trust.run_records import (
    MAX_RECORD_BYTES,
    MAX_SHARDS,
    RULES,
    SHARDED,
    RunRecords,
    Tally,
    record_subkey,
    shard_name,
)
from protocol.wire.messages import dht_key

RUN = "run"


def _validates(rule: RunRecords, name: str, value: Any, subkey: Any, run: str = RUN) -> bool:
    key = DHTID.generate(source=dht_key(run, name)).to_bytes()
    return rule.validate(DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), 0.0))


def _sub(who: Identity, peer_id: str = "peer-1") -> str:
    """The subkey an advert of ``peer_id`` signed by ``who`` is stored under."""
    return record_subkey("adverts", who.public_hex, peer_id)


def _plain(rule: RunRecords, name: str, value: Any) -> bool:
    """A regular (non-dictionary) value under the key, as hivemind stores one."""
    key = DHTID.generate(source=dht_key(RUN, name)).to_bytes()
    return rule.validate(DHTRecord(key, MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(value), 0.0))


def _wrongly_signed(record: dict[str, Any]) -> dict[str, Any]:
    sig = record["sig"]
    return {**record, "sig": ("0" if sig[0] != "0" else "1") + sig[1:]}


class _People:
    def __init__(self) -> None:
        self.coordinator, self.peer, self.outsider = Identity.generate(), Identity.generate(), Identity.generate()
        self.cert = issue_certificate(self.coordinator, RUN, "peer-1", self.peer.public_hex, now=0.0)

    def advert(self, who: Identity | None = None, **extra: Any) -> dict[str, Any]:
        body = {"kind": "advert", "peer_id": "peer-1", "run_id": RUN, "cert": self.cert, **extra}
        return sign_record(who or self.peer, body)

    def record(self, who: Identity | None = None, **extra: Any) -> dict[str, Any]:
        return sign_record(who or self.coordinator, {"kind": "coordinator", "run_id": RUN, **extra})


def _refusals(p: _People) -> list[tuple[str, str, Any, Any]]:
    """(why, key name, value, subkey): every record the rule must refuse, public or private."""
    ad, rec = p.advert(), p.record()
    return [
        ("unsigned advert", "adverts", {k: v for k, v in ad.items() if k != "sig"}, _sub(p.peer)),
        ("wrongly signed advert", "adverts", _wrongly_signed(ad), _sub(p.peer)),
        ("advert under another's subkey", "adverts", ad, _sub(p.outsider)),
        ("advert under its peer id", "adverts", ad, "peer-1"),
        ("advert under its signer's bare key", "adverts", ad, p.peer.public_hex),
        ("advert under another peer id", "adverts", ad, _sub(p.peer, "peer-2")),
        ("another run's advert", "adverts", p.advert(run_id="other"), _sub(p.peer)),
        ("advert naming no peer", "adverts", p.advert(peer_id=None), _sub(p.peer)),
        ("coordinator record among adverts", "adverts", p.record(p.peer), _sub(p.peer)),
        ("junk advert", "adverts", {"junk": 1}, _sub(p.peer)),
        ("oversized advert", "adverts", p.advert(pad="x" * MAX_RECORD_BYTES), _sub(p.peer)),
        ("unsigned record", "coordinator", {k: v for k, v in rec.items() if k != "sig"}, p.coordinator.public_hex),
        ("wrongly signed record", "coordinator", _wrongly_signed(rec), p.coordinator.public_hex),
        ("an outsider's claim", "coordinator", p.record(p.outsider), p.outsider.public_hex),
        ("a record under another's subkey", "coordinator", rec, p.outsider.public_hex),
        ("another run's record", "coordinator", p.record(run_id="other"), p.coordinator.public_hex),
        ("an unreadable subkey", "coordinator", rec, b"\xc1"),
    ]


@pytest.mark.parametrize("private", [False, True], ids=["public", "private"])
def test_the_run_rule_refuses_every_bad_record_public_or_private(private: bool) -> None:
    p = _People()
    rule = RunRecords(RUN, p.coordinator.public_hex, private=private)
    assert _validates(rule, "adverts", p.advert(), _sub(p.peer))
    assert _validates(rule, "coordinator", p.record(), p.coordinator.public_hex)
    for name in RULES:
        for value in ({"kind": "advert"}, "plain", b"x" * 62):
            assert not _plain(rule, name, value), (name, value)
    refused = _refusals(p)
    for why, name, value, subkey in refused:
        assert not _validates(rule, name, value, subkey), why
    assert rule.dropped == len(refused) + 3 * len(RULES)
    other = DHTRecord(b"other key", b"", b"\xc1", 0.0)
    assert rule.validate(other), "other keys' records are not this rule's business"


@pytest.mark.parametrize("private", [False, True], ids=["public", "private"])
def test_every_shard_of_a_sharded_key_is_ruled_as_its_key(private: bool) -> None:
    """An outsider's record under any shard a run may use is refused, as under the key itself."""
    p = _People()
    rule = RunRecords(RUN, p.coordinator.public_hex, private=private)
    outsider_ad = p.advert(p.outsider) if private else p.record(p.outsider)  # no cert of theirs / wrong kind
    for name in sorted(SHARDED):
        for shard in (0, 1, MAX_SHARDS - 1):
            where = shard_name(name, shard)
            assert _validates(rule, where, p.advert(), record_subkey(where, p.peer.public_hex, "peer-1"))
            assert not _validates(rule, where, outsider_ad, record_subkey(where, p.outsider.public_hex, "peer-1"))
            assert not _validates(rule, where, p.advert(), _sub(p.outsider))
            assert not _plain(rule, where, "plain")
    assert rule.dropped == 3 * 3 * len(SHARDED)
    for bad in (-1, MAX_SHARDS):
        with pytest.raises(ValueError, match="no shard"):
            shard_name("adverts", bad)
    with pytest.raises(ValueError, match="no shard"):
        shard_name("coordinator", 0)


def test_a_private_rule_also_wants_the_coordinators_certificate() -> None:
    p = _People()
    public, private = RunRecords(RUN, p.coordinator.public_hex), RunRecords(RUN, p.coordinator.public_hex, True)
    forged = issue_certificate(p.outsider, RUN, "peer-1", p.outsider.public_hex, now=0.0)
    others = issue_certificate(p.coordinator, RUN, "peer-2", p.outsider.public_hex, now=0.0)
    cases = [
        (p.advert(cert={}), _sub(p.peer)),  # none
        (p.advert(p.outsider, cert=forged), _sub(p.outsider)),  # not the coordinator's
        (p.advert(p.outsider), _sub(p.outsider)),  # someone else's certificate
        (p.advert(p.outsider, cert=others), _sub(p.outsider)),  # for another peer id
    ]
    for value, subkey in cases:
        assert _validates(public, "adverts", value, subkey)  # a public run admits by hello, not here
        assert not _validates(private, "adverts", value, subkey)
    with pytest.raises(ValueError, match="needs the coordinator's key"):
        RunRecords(RUN, None, private=True)


def test_an_unpinned_peer_takes_each_claim_under_its_own_key_only() -> None:
    """A peer trusting on first use keeps every signed claim of the run, each under its
    signer's key (so no claim hides another); still no plain value, forgery or theft."""
    p = _People()
    rule = RunRecords(RUN, None)
    assert _validates(rule, "coordinator", p.record(), p.coordinator.public_hex)
    assert _validates(rule, "coordinator", p.record(p.outsider), p.outsider.public_hex)
    assert not _validates(rule, "coordinator", p.record(p.outsider), p.coordinator.public_hex)
    assert not _validates(rule, "coordinator", _wrongly_signed(p.record()), p.coordinator.public_hex)
    assert not _plain(rule, "coordinator", "plain")


def test_refusals_are_said_once_per_key_and_period(caplog: pytest.LogCaptureFixture) -> None:
    p, clock = _People(), FakeClock()
    rule = RunRecords(RUN, p.coordinator.public_hex, clock=clock)
    with caplog.at_level(logging.WARNING, logger="protocol.trust.run_records"):
        for _ in range(5000):
            _validates(rule, "adverts", {"junk": 1}, "x")
            _plain(rule, "coordinator", "plain")
        assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
        asyncio.run(clock.advance(61.0))
        _validates(rule, "adverts", {"junk": 1}, "x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "refused 5000 DHT record(s) under fusionllm:run:adverts" in lines[2], lines
    assert "not a record of kind 'advert'" in lines[2] and rule.dropped == 10001


def test_a_tally_says_each_sender_once_per_period_and_bounds_its_memory() -> None:
    clock = FakeClock()
    tally = Tally(60.0, clock)
    assert tally.note("a") == 1 and tally.note("a") is None and tally.note("b") == 1
    assert [tally.note(f"s{i}") for i in range(5000)].count(None) < 5000
    assert len(tally._said) <= 1024 + 1
    asyncio.run(clock.advance(60.0))
    assert tally.note("a") == 2 and tally.total == 5004


def test_a_read_hands_back_only_the_wanted_subkeys_and_at_most_its_limit() -> None:
    """One lookup of every shard: a subkey under two shards (a peer that moved at a
    re-shard) is taken where it expires last, and at most ``limit`` records in all."""
    keys = [dht_key(RUN, shard_name("adverts", i)) for i in range(3)]
    shard0 = {f"k{i}": SimpleNamespace(value={"n": i}, expiration_time=10.0) for i in range(5000)}
    shard1 = {"k7": SimpleNamespace(value={"n": "moved"}, expiration_time=20.0)}
    shard1["k9"] = SimpleNamespace(value={"n": "older"}, expiration_time=5.0)

    calls: list[list[str]] = []

    class Node:
        async def get_many(self, asked: list[str], sufficient_expiration_time: float, num_workers: int = 4) -> Any:
            assert sufficient_expiration_time == float("inf")  # the latest of each
            calls.append(asked)
            found = {keys[0]: SimpleNamespace(value=shard0), keys[1]: SimpleNamespace(value=shard1), keys[2]: None}
            return {k: found[k] for k in asked}

    class Plain:
        async def get_many(self, asked: list[str], sufficient_expiration_time: float, num_workers: int = 4) -> Any:
            return {k: SimpleNamespace(value=b"62 bytes of someone else's") for k in asked}

    async def main() -> tuple[dict[str, Any], ...]:
        return (
            await _read(keys, frozenset({"k7", "k9", "nobody"}), 1024, None, Node()),
            await _read(keys, None, 100, None, Node()),
            await _read(keys, None, 100, None, Plain()),
            await _read([], None, 100, None, Plain()),
        )

    wanted, limited, plain, none = asyncio.run(main())
    assert calls[:2] == [keys, [keys[2]]], "a shard found empty is asked once more"
    assert wanted == {"k7": {"n": "moved"}, "k9": {"n": 9}}
    assert len(limited) == 100 and plain == {} and none == {}


def test_a_public_swarm_trains_past_a_shadowing_store_and_junk_under_each_key(tmp_path: Path) -> None:
    """An outsider's DHT node stores one regular value under each of the run's keys, and
    junk and wrongly signed subkeys beside, before any peer joins: the peers find the
    coordinator, it finds their adverts, and the run trains to its end; every node
    refused the records (said in a line per key, not per record)."""
    from tests.dht_attacks import LIVE_KEYS, Outsider
    from tests.swarmproc import SMALL, Swarm, join_together

    args = ["--steps", "3", "--seed", "0", *SMALL, "--min-peers", "2", "--run-dir", str(tmp_path / "run")]
    swarm = Swarm(tmp_path, args, peers=0)
    outsider = None
    try:
        outsider = Outsider(swarm.join_args, "fusionllm")
        assert outsider.shadow() == dict.fromkeys(LIVE_KEYS, True), "the outsider's own node took them"
        outsider.junk(200, 200, names=LIVE_KEYS)
        join_together(swarm, [[], []])
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        out = swarm.coord.output
        assert "Traceback" not in out
        refusals = [line for line in out.splitlines() if "DHT record(s) under" in line]
        assert 1 <= len(refusals) <= 4, refusals
    finally:
        if outsider is not None:
            outsider.close()
        swarm.close()


def _signed_advert(who: Identity, peer_id: str, expires: float) -> dict[str, Any]:
    from protocol.wire.messages import PROTOCOL_VERSION, Advert

    ad = Advert(
        peer_id, ["/ip4/127.0.0.1/tcp/4001"], "cpu", 1e12, 1 << 30, 100.0, 100.0, "2", PROTOCOL_VERSION, expires
    )
    return sign_record(who, {**ad.header(), "run_id": RUN})


class _FakeDHT:
    """Answers reads from ``found`` (None: the read fails), as the DHT's process would."""

    def __init__(self) -> None:
        self.found: dict[str, Any] | None = {}  # under every key read
        self.asked: list[list[str]] = []  # the keys of each read

    def run_coroutine(self, read: Any, return_future: bool) -> Any:
        found, asked = self.found, self.asked

        class Node:
            async def get_many(self, keys: list[str], sufficient_expiration_time: float, num_workers: int = 4) -> Any:
                asked.append(list(keys))
                if found is None:
                    raise TimeoutError("the DHT did not answer")
                value = {k: SimpleNamespace(value=v, expiration_time=1.0) for k, v in found.items()}
                return dict.fromkeys(keys, SimpleNamespace(value=value))

        return asyncio.ensure_future(read(None, Node()))


def test_a_poll_that_fails_or_finds_junk_drops_no_planned_peer_and_says_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The coordinator's advert book reads only its admitted peers' keys; a failed poll
    and one that finds only a bad advert keep the planned peer (on the status board
    too), and the bad advert is said once per signer and period, not per poll."""
    from hivemind.utils import get_dht_time

    from coordinator.adverts import AdvertBook
    from coordinator.status import StatusBoard
    from protocol.wire.gate import Gate

    peer, outsider, clock = Identity.generate(), Identity.generate(), FakeClock()
    gate, board, dht = Gate(RUN), StatusBoard(RUN, 10), _FakeDHT()
    gate.admit("peer-1", peer.public_key)
    book = AdvertBook(RUN, gate, SimpleNamespace(reached={"peer-1": True}), board, SimpleNamespace(dht=dht), clock)
    good = _signed_advert(peer, "peer-1", get_dht_time() + 60)
    dht.found = {_sub(peer): good, _sub(outsider): _signed_advert(outsider, "peer-1", 1e12)}

    async def poll() -> dict[str, Any]:
        live = await book.live()
        book.keep(live, {"peer-1"})
        return live

    assert set(asyncio.run(poll())) == {"peer-1"}, "the outsider's advert is not even read"
    assert dht.asked == [[dht_key(RUN, shard_name("adverts", 0))]], "a small swarm's one shard, in one read"
    with caplog.at_level(logging.WARNING, logger="coordinator.adverts"):
        dht.found = None
        assert asyncio.run(poll()) == {} and set(book.adverts) == {"peer-1"}
        dht.found = {_sub(peer): {**good, "sig": "00" * 64}}
        for _ in range(50):  # the junk is not taken; the last good advert counts until it expires
            assert asyncio.run(poll())["peer-1"].sig == good["sig"] and set(book.adverts) == {"peer-1"}
    assert board.peers["peer-1"]["health"] != "left"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "reading the adverts from the DHT failed" in lines[0] and "1 bad advert(s) of peer-1" in lines[1]


def test_two_peers_sharing_an_identity_each_keep_their_advert() -> None:
    """``join``'s default key file is one per machine, so several peers of one host sign
    with one key: each advert is stored under the key and its peer id, and the
    coordinator reads both (under the signer's key alone, the second hid the first:
    3 peers on one machine never made a run of 3)."""
    from hivemind.utils import get_dht_time

    from coordinator.adverts import AdvertBook
    from coordinator.status import StatusBoard
    from protocol.wire.gate import Gate

    shared = Identity.generate()
    gate, board, dht = Gate(RUN), StatusBoard(RUN, 10), _FakeDHT()
    reached = {"peer-1": True, "peer-2": True}
    book = AdvertBook(RUN, gate, SimpleNamespace(reached=reached), board, SimpleNamespace(dht=dht), FakeClock())
    rule = RunRecords(RUN, None)
    for peer in reached:
        gate.admit(peer, shared.public_key)
        ad = _signed_advert(shared, peer, get_dht_time() + 60)
        assert _validates(rule, "adverts", ad, _sub(shared, peer))
        dht.found = {**(dht.found or {}), _sub(shared, peer): ad}
    assert set(asyncio.run(book.live())) == {"peer-1", "peer-2"}
