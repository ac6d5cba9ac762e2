"""An outsider's attacks on a public run's DHT keys (issue 35), and what they cost a
training swarm; ``benchmarks/adversary.py`` prints the figures.

:class:`Outsider` is a DHT node of its own, with no rule for the run, that stores
under the run's keys what an attacker would: one regular value under each (which,
in hivemind, stops every subkey store on a node that took it), junk subkeys, and
records that claim a signer whose signature they do not carry.
:func:`public_shadow_store_trains` and :func:`public_junk_flood` run a public swarm
against them."""

from __future__ import annotations

import functools
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from protocol.net.dhtstart import start_dht
from protocol.trust.run_records import RULES, record_subkey, rule_of, shard_name
from protocol.wire.messages import dht_key

#: the outsider's records expire this long after they are stored
LIFETIME_S = 3600.0
#: where a small swarm's adverts live (its one shard: the coordinator's record says 1)
ADVERTS = shard_name("adverts", 0)
#: the run's keys a small swarm uses
LIVE_KEYS = ("coordinator", ADVERTS)
#: the junk flood's records: junk subkeys, and subkeys wrongly signed (each under a key of its own)
FLOOD_JUNK, FLOOD_WRONG = 10_000, 10_000
#: the coordinator's lines that say a refused record, its DHT node's and its advert book's
_REFUSAL = re.compile(r"DHT record\(s\) under|bad advert\(s\)|the DHT refused")


async def _store_junk(name: str, run: str, junk: int, wrong: int, _dht: Any, node: Any) -> int:
    """(In the outsider's DHT process: hivemind's pipe into it takes only small calls)
    store ``junk`` random subkeys of random bytes and ``wrong`` records whose signature
    does not verify, each under the key it claims, under ``key``: how many the nodes took."""
    key, kind = dht_key(run, name), RULES[rule_of(name)][0]
    subkeys: list[Any] = [secrets.token_hex(8) for _ in range(junk)]
    values: list[Any] = [secrets.token_bytes(16) for _ in range(junk)]
    for _ in range(wrong):
        claimed = secrets.token_hex(32)
        record = {"kind": kind, "run_id": run, "peer_id": "Qm" + claimed[:44], "pubkey": claimed}
        subkeys.append(record_subkey(name, claimed, record["peer_id"]))  # as its own: only the signature is wrong
        values.append({**record, "sig": secrets.token_hex(64)})
    done = await node.store_many([key] * len(values), values, get_dht_time() + LIFETIME_S, subkeys=subkeys)
    return sum(bool(ok) for ok in done.values())


async def _holds_plain(key: str, _dht: Any, node: Any) -> bool:
    """(In the outsider's DHT process) whether its own storage holds a regular value under ``key``."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return found is not None and isinstance(found.value, bytes)


class Outsider:
    """A DHT node in the run's swarm (bootstrapped from a join line's ``--initial-peers``)
    that obeys no rule of the run."""

    def __init__(self, join_args: list[str], run: str) -> None:
        initial = join_args[join_args.index("--initial-peers") + 1]
        self.run = run
        self.dht = start_dht(initial_peers=[initial])

    def shadow(self) -> dict[str, bool]:
        """One regular 62-byte value under each of the run's keys; by name, whether the
        outsider's own node holds it (the swarm's nodes refuse it)."""
        expires = get_dht_time() + LIFETIME_S
        for name in LIVE_KEYS:
            self.dht.store(dht_key(self.run, name), b"s" * 62, expires)
        return {
            name: self.dht.run_coroutine(functools.partial(_holds_plain, dht_key(self.run, name))) for name in LIVE_KEYS
        }

    def junk(self, junk: int, wrong: int, names: tuple[str, ...] = (ADVERTS,)) -> int:
        """``junk`` subkeys of random bytes and ``wrong`` records whose signature does not
        verify (each under the key it claims), under each of ``names``; how many stores
        some node took (the outsider's own node takes its own)."""
        taken = 0
        for name in names:
            store = functools.partial(_store_junk, name, self.run, junk, wrong)
            taken += self.dht.run_coroutine(store)
        return taken

    def close(self) -> None:
        self.dht.shutdown()


def public_shadow_store_trains(short: bool) -> bool:
    """Whether a public run trains (to its end, exit 0) with the outsider's regular value
    under each of its DHT keys, stored after the coordinator started and before the
    peers join."""
    from tests.swarmproc import SMALL, Swarm, join_together

    steps = 3 if short else 20
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = ["--run-dir", str(Path(tmp) / "run")]
        swarm = Swarm(Path(tmp), ["--steps", str(steps), "--seed", "0", *SMALL, "--min-peers", "2", *run_dir], 0)
        outsider = None
        try:
            outsider = Outsider(swarm.join_args, "fusionllm")
            if not all(outsider.shadow().values()):
                return False
            join_together(swarm, [[], []])
            return swarm.coord.wait(300) == 0
        finally:
            if outsider is not None:
                outsider.close()
            swarm.close()


def _rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def public_junk_flood(short: bool, target: Any = None) -> dict[str, float]:
    """A public 2-peer swarm (``target``, a :class:`tests.flooder.FloodTarget`, or one of
    its own) trains; an outsider (on its own CPU) stores ``FLOOD_JUNK``
    junk and ``FLOOD_WRONG`` wrongly signed subkeys under the adverts key. Steps/s in
    the window from the flood's start over that of the clean windows before and after
    (goal >= 0.9), the coordinator's RSS growth over its clean value (goal <= 50 MB),
    and the coordinator's lines about refused records, per minute of flood (goal: at
    most one per sender and minute; here the refusing node knows no sender, so one
    per key)."""
    from tests.flooder import FLOOD_S, _clean, _Window, on_own_target

    if target is None:
        return on_own_target(lambda own: public_junk_flood(short, own))
    seconds = FLOOD_S / 4 if short else 3 * FLOOD_S
    outsider = None
    try:
        coord = target.swarm.coord
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, set(target.flood_cpus))  # its DHT process inherits it
        try:
            outsider = Outsider(target.swarm.join_args, "fusionllm")
        finally:
            os.sched_setaffinity(0, mine)
        before = _clean(seconds)
        rss0, lines0 = _rss_mb(coord.popen.pid), len(coord.lines)
        window, peak = _Window(), rss0
        outsider.junk(FLOOD_JUNK, FLOOD_WRONG)
        while time.monotonic() < window.start + seconds:
            peak = max(peak, _rss_mb(coord.popen.pid))
            time.sleep(0.25)
        window.end()
        refusals = sum(1 for line in coord.lines[lines0:] if _REFUSAL.search(line))
        after = _clean(seconds)
        lines, times = list(coord.lines), list(coord.times)
        clean = (before.rate(lines, times) + after.rate(lines, times)) / 2
        flood_s = window.stop - window.start
        return {
            "public_junk_flood_ratio": round(window.rate(lines, times) / clean, 3),
            "public_junk_flood_rss_growth_mb": round(max(0.0, peak - rss0), 1),
            "public_junk_flood_log_lines_per_min": round(refusals * 60.0 / max(flood_s, 60.0), 2),
        }
    finally:
        if outsider is not None:
            outsider.close()
