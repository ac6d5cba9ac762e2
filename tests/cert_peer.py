"""Hostile members of a private swarm, for integration tests.

``python -m tests.cert_peer MODE --token TOKEN --identity KEY [--go FILE]``

- ``forger``: holds the join token's public parts but not its secret. It forges an
  admission certificate (its own key standing in for the coordinator's, and a copy
  whose signer field names the coordinator), publishes its advert with it, says
  hello, and sends a control message (a heartbeat), a RAD message (activations) and
  a bandwidth probe to the coordinator and to every peer whose advert it reads;
  with ``--go``, only once that file exists (it starts with the swarm's peers, and
  the test reads the receivers' counts before it creates the file).
- ``lapsed``: joins with the whole token like ``fusionllm join``, trains, and when
  the host bans it (the coordinator says so, and stops renewing its certificate) it
  does not leave: once its certificate has expired it sends the same three kinds of
  message to the coordinator and to every peer of its last assignment, once the
  file ``--go`` names exists (the test reads its counts before it creates it).

Each prints ``<mode> <peer id> sent to <n> receivers: <ids>`` and exits 0; the test
reads every receiver's count or log."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer.config import JoinError, PeerConfig
from peer.node import PeerNode
from protocol.net.dhtstart import start_dht
from protocol.net.tasks import wait_until
from protocol.net.transport import PeerUnreachable, Transport
from protocol.trust.admission import issue_certificate, parse_token
from protocol.trust.identity import Identity, sign_record
from protocol.trust.run_records import record_subkey, shard_name, shard_of
from protocol.wire.gate import Gate
from protocol.wire.messages import (
    NOT_ADMITTED,
    PROTOCOL_VERSION,
    Activations,
    Advert,
    Beat,
    CoordinatorRecord,
    Hello,
    dht_key,
)


async def attack(kind: str, tp: Transport, run: str, receivers: dict[str, list[str]], coordinator: str) -> None:
    """A heartbeat, activations and a bandwidth probe to each receiver (failures are
    the receivers' refusals: the stream closed on us)."""
    for pid, maddrs in receivers.items():
        tp.learn(pid, maddrs)

    async def one(pid: str) -> None:
        for msg, values in ((Beat(run, 10**6), None), (Activations(run, 10**6, 0, 1), [torch.ones(64)])):
            try:
                await asyncio.wait_for(tp.send(pid, msg, values), 20)
            except (PeerUnreachable, asyncio.TimeoutError):
                pass
        try:
            await asyncio.wait_for(tp.measure_bandwidth(pid, 1 << 16), 30)
        except (PeerUnreachable, asyncio.TimeoutError):
            pass

    await asyncio.gather(*(one(p) for p in receivers))
    others = sorted(p for p in receivers if p != coordinator)
    print(f"{kind} {tp.peer_id} sent to {len(receivers)} receivers: {' '.join(others)}", flush=True)


def forged_certificates(me: Identity, run: str, peer_id: str, coordinator_key: str) -> list[dict[str, Any]]:
    """A certificate the forger signed itself, and one that claims the coordinator signed it."""
    own = issue_certificate(me, run, peer_id, me.public_hex, time.time())
    return [own, {**own, "pubkey": coordinator_key}]


async def forger(token: str, key_file: str, members: int, go: Path | None) -> None:
    t = parse_token(token)
    me = Identity.load_or_create(key_file)
    dht = start_dht(initial_peers=t.maddrs)
    tp = Transport(await dht.replicate_p2p(), me, Gate(t.run))
    await tp.start()
    try:
        if go is not None:  # nothing stored or sent before
            await _until_exists(go, 300.0)
        coordinator = await dht.get(dht_key(t.run, "coordinator"), latest=True, return_future=True)
        cid, cmaddrs, shards = _coordinator(coordinator, t.coordinator_key)
        receivers = await _members(dht, t.run, members, shards)
        receivers[cid] = cmaddrs
        for cert in forged_certificates(me, t.run, tp.peer_id, t.coordinator_key):
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            expires = get_dht_time() + 60
            claims = ("cpu", 1e12, 1 << 34, 1e4, 1e4, str(torch.__version__), PROTOCOL_VERSION, expires)
            ad = Advert(tp.peer_id, maddrs, *claims, run_id=t.run)
            record = sign_record(me, dataclasses.replace(ad, cert=cert).header())
            await dht.store(
                dht_key(t.run, shard_name("adverts", shard_of(tp.peer_id, shards))),
                record,
                expires,
                subkey=record_subkey("adverts", me.public_hex, tp.peer_id),
                return_future=True,
            )
        tp.learn(cid, cmaddrs)
        try:
            await tp.send(cid, Hello(t.run, me.public_hex, proof="", maddrs=[]))
        except PeerUnreachable:
            pass
        await attack("forger", tp, t.run, receivers, cid)
    finally:
        await tp.aclose()
        dht.shutdown()


async def _members(dht: hivemind.DHT, run: str, n: int, shards: int) -> dict[str, list[str]]:
    """The peer ids and addresses of the run's adverts (in its ``shards`` shards), once
    ``n`` are seen (or 30 s)."""
    seen: dict[str, list[str]] = {}
    keys = [dht_key(run, shard_name("adverts", i)) for i in range(shards)]

    async def enough() -> bool | None:
        found = [await dht.get(key, latest=True, return_future=True) for key in keys]
        seen.clear()
        seen.update({ad.peer_id: ad.maddrs for shard in found for ad in _adverts(shard)})
        return True if len(seen) >= n else None

    await wait_until(enough, 30.0)
    return seen


def _adverts(found: Any) -> list[Advert]:
    out = []
    for item in (found.value if found is not None and isinstance(found.value, dict) else {}).values():
        try:
            ad = Advert.from_header(item.value)
        except Exception:
            continue
        if isinstance(ad, Advert):
            out.append(ad)
    return out


def _coordinator(found: Any, key: str) -> tuple[str, list[str], int]:
    """The peer id, addresses and advert shard count in the coordinator record that ``key`` signed."""
    for item in found.value.values():
        if item.value.get("pubkey") == key:
            rec = CoordinatorRecord.from_header(item.value)
            assert isinstance(rec, CoordinatorRecord)
            return rec.peer_id, list(rec.maddrs), rec.shards
    raise SystemExit("no coordinator record signed by the token's key")


async def _until_exists(path: Path, within_s: float = 120.0) -> None:
    async def there() -> bool | None:
        return True if path.exists() else None

    if await wait_until(there, within_s, interval=0.1) is None:
        raise SystemExit(f"{path} did not appear within {within_s:.0f} s")


class Lapsed(PeerNode):
    """A peer that joins with the whole token and trains, but once banned (and told so)
    stays until its certificate has expired, then attacks its last assignment's peers
    and the coordinator once ``go`` exists."""

    def __init__(self, config: PeerConfig, go: Path) -> None:
        super().__init__(config)
        self.go = go
        self.last: Any = None  # its last assignment

    async def _control(self, kind: str, item: Any) -> int | None:
        if kind == "assign":
            self.last = item.message
        if kind == "abort" and item.message.reason.startswith(NOT_ADMITTED):  # banned, and told so: stays
            print(f"told: {item.message.reason}", flush=True)
            cert = self.credentials
            while cert.certificate is not None and cert.certificate["expires_at"] > time.time():
                await asyncio.sleep(0.2)
            kind, item = "revoked", "it expired"
        if kind != "revoked":
            return await super()._control(kind, item)
        assert self.transport is not None and self.link is not None and self.checks is not None
        await self._stop_epoch()
        self.checks.assign = None  # its heartbeats stop: what the receivers count from here is the attack
        print(f"certificate ran out: {item}", flush=True)
        a = self.last
        if a is None:
            raise SystemExit("lapsed: it was never assigned a stage, so it knows no peers to send to")
        receivers = {p: list(a.maddrs.get(p, [])) for p in a.keys if p != self.transport.peer_id}
        assert self.link.record is not None
        receivers[self.link.peer_id] = list(self.link.record.maddrs)
        await _until_exists(self.go)
        await attack("lapsed", self.transport, self.config.run_id, receivers, self.link.peer_id)
        return 0


async def lapsed(token: str, key_file: str, go: Path) -> None:
    t = parse_token(token)
    cfg = PeerConfig(t.maddrs, t.run, identity=key_file, coordinator_key=t.coordinator_key, swarm_secret=t.secret)
    node = Lapsed(cfg, go)
    try:
        await node.start()
        assert node.advert is not None
        print(f"joined run '{t.run}' as {node.advert.peer_id}", flush=True)
        await node.serve()
    except JoinError as exc:
        print(f"refused: {exc}", flush=True)
    finally:
        await node.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["forger", "lapsed"])
    ap.add_argument("--token", required=True)
    ap.add_argument("--identity", required=True)
    ap.add_argument("--members", type=int, default=3, help="forger: the adverts to wait for")
    ap.add_argument("--go", type=Path, help="send once this file exists (lapsed: once banned and expired too)")
    args = ap.parse_args()
    if args.mode == "forger":
        await forger(args.token, args.identity, args.members, args.go)
    else:
        await lapsed(args.token, args.identity, args.go)


if __name__ == "__main__":
    asyncio.run(main())
