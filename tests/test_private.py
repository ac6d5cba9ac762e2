"""Private swarms (issue 16, item 2): the coordinator admits only peers whose hello
proves the swarm's secret from its join token; the host bans peers and rotates the
token from the run directory while the run goes on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.private import Admission, write_secret
from protocol.admission import Token, TokenError, hello_proof, new_secret, parse_token
from protocol.identity import Identity
from tests.conftest import run_cli
from tests.swarmproc import SMALL, Proc, Swarm, api, wait_for


def test_tokens_round_trip_and_damaged_ones_are_one_line() -> None:
    token = Token("run", Identity.generate().public_hex, new_secret(), ["/ip4/1.2.3.4/tcp/5/p2p/Qm"])
    assert parse_token(token.encode()) == token
    for bad in ("hello", token.encode()[:-7], "flt1.!!!!"):
        with pytest.raises(TokenError) as err:
            parse_token(bad)
        assert "\n" not in str(err.value)


def test_admission_needs_the_current_secret_and_refuses_the_banned(tmp_path: Path) -> None:
    adm = Admission(tmp_path, "run", private=True)
    key = Identity.generate().public_hex
    hello = {"pubkey": key, "proof": hello_proof(adm.secret(), "run", "QmA", key)}
    assert adm.check("QmA", hello) == ""
    assert "does not prove" in adm.check("QmB", hello), "bound to the peer id"
    assert "does not prove" in adm.check("QmA", {"pubkey": key})
    write_secret(tmp_path)  # rotated: the old token admits no one new
    assert "does not prove" in adm.check("QmA", hello)
    (tmp_path / "banned.txt").write_text("QmA  # a note\n")
    assert "banned" in adm.check("QmA", {"pubkey": key, "proof": hello_proof(adm.secret(), "run", "QmA", key)})
    assert Admission(tmp_path, "run", private=False).check("QmC", {}) == "", "public swarms need no proof"


def _refused(swarm: Swarm, tmp_path: Path, name: str, *join: str) -> str:
    p = Proc("join", *join, "--identity", str(tmp_path / f"{name}.key"), "--join-timeout", "20")
    swarm.procs.append(p)
    assert p.wait(120) == 2, p.output[-2000:]
    return p.wait_line(r"fusionllm: error: (.*)").group(1)


def test_a_private_swarm_admits_token_holders_and_drops_a_banned_peer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--private", "--steps", "200", "--seed", "0", *SMALL, "--min-peers", "2", "--run-dir", str(run_dir)]
    swarm = Swarm(tmp_path, args, peers=0)
    try:
        assert swarm.join_args[0] == "--token"
        token = parse_token(swarm.join_args[1])
        bare = ["--initial-peers", *token.maddrs, "--coordinator-key", token.coordinator_key]
        why = _refused(swarm, tmp_path, "outsider", *bare)
        assert "did not admit this peer" in why and "--token" in why
        forged = Token(token.run, token.coordinator_key, new_secret(), token.maddrs).encode()
        assert "did not admit this peer" in _refused(swarm, tmp_path, "forger", "--token", forged)
        assert api(swarm.url)["rejected"].get("not_admitted", 0) >= 2, "both hellos counted as rejects"
        members = [swarm.add_peer(i) for i in range(2)]
        wait_for(swarm.url, lambda s: s["training"]["step"] >= 5, 120)
        r = run_cli("ban", members[1], "--run-dir", str(run_dir))
        assert r.returncode == 0, r.stderr
        swarm.coord.wait_line(rf"peer {members[1]} .*failed: excluded: banned by the swarm's host", 60)
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        out = swarm.coord.output
        assert re.findall(r"stage \d replica \d: peer (\w+)", out) == [members[0]]
        assert "does not prove the swarm's secret" in out, "the coordinator's log says why"
        new = run_cli("token", "--run-dir", str(run_dir), "--rotate")
        assert new.returncode == 0 and parse_token(new.stdout.split()[-1]).secret != token.secret
    finally:
        swarm.close()


def test_a_damaged_secret_admits_nobody_and_never_raises(tmp_path: Path) -> None:
    adm = Admission(tmp_path, "run", private=True)
    for damaged in ("", "not hex", "ab" * 8):
        (tmp_path / "swarm.secret").write_text(damaged)
        assert "is damaged" in adm.check("QmA", {"pubkey": "x", "proof": hello_proof("00" * 32, "run", "QmA", "x")})


def test_a_token_and_conflicting_flags_are_refused_in_one_line() -> None:
    token = Token("run", Identity.generate().public_hex, new_secret(), ["/ip4/127.0.0.1/tcp/5"]).encode()
    r = run_cli("join", "--token", token, "--coordinator-key", Identity.generate().public_hex)
    assert r.returncode == 2 and "leave out --run and --coordinator-key" in r.stderr and r.stderr.count("\n") == 1
