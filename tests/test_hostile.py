"""Hostile volunteers (issue 14): what a peer claims or sends cannot crash the
coordinator, stall the honest peers or corrupt the model."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionllm.local import compare_checkpoints
from protocol.trust.advert_check import MAX_FLOPS, advert_problem
from protocol.wire.messages import PROTOCOL_VERSION, Advert
from tests.conftest import run_cli
from tests.swarmproc import SMALL, Swarm, joined

STEPS = 4  # every swarm here trains as long: one clean run is their reference
COMMON = ["--steps", str(STEPS), "--seed", "0", *SMALL]


def _advert(**kw: object) -> Advert:
    base = dict(
        peer_id="QmPeer",
        maddrs=["/ip4/127.0.0.1/tcp/4001"],
        device="cpu",
        flops=1e12,
        memory_bytes=1 << 30,
        up_mbps=100.0,
        down_mbps=100.0,
        torch_version="2",
        protocol_version=PROTOCOL_VERSION,
        expires_at=1.0,
    )
    return Advert(**{**base, **kw})  # type: ignore[arg-type]


def _train_reference(common: list[str], save: Path) -> Path:
    r = run_cli("train", "--reference", "--threads", "1", *common, "--save", str(save))  # as the peers train
    assert r.returncode == 0, r.stderr[-3000:]
    return save


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[list[str]], Future[Path]]]:
    """The weights of a clean run of ``common``: trained once for the module, on the
    side (it trains while the first swarm that asks for it starts)."""
    runs: dict[tuple[str, ...], Future[Path]] = {}
    with ThreadPoolExecutor() as pool:

        def clean(common: list[str]) -> Future[Path]:
            if tuple(common) not in runs:
                save = tmp_path_factory.mktemp("reference") / "ref.safetensors"
                runs[tuple(common)] = pool.submit(_train_reference, common, save)
            return runs[tuple(common)]

        yield clean


def _equals_reference(save: Path, ref: Future[Path]) -> None:
    assert compare_checkpoints(save, ref.result(timeout=240)) <= 1e-5


@pytest.mark.parametrize(
    "claim, says",
    [
        ({"flops": float("nan")}, "FLOP/s nan is not a finite number"),
        ({"flops": float("inf")}, "FLOP/s inf"),
        ({"flops": 0.0}, "FLOP/s 0.0"),
        ({"flops": -5.0}, "FLOP/s -5.0"),
        ({"flops": MAX_FLOPS * 10}, "FLOP/s 1e+19"),
        ({"up_mbps": float("nan")}, "upload Mbit/s nan"),
        ({"down_mbps": -1.0}, "download Mbit/s -1.0"),
        ({"memory_bytes": -1}, "memory -1 bytes"),
        ({"maddrs": ["garbage"]}, "the address 'garbage' is not a multiaddr"),
        ({"maddrs": []}, "0 addresses"),
        ({"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 17}, "17 addresses"),
        ({"device": "x" * 1000}, "a device name of 1000 characters"),
        ({"reach": "\x1b[2Jeverywhere"}, "reachability '\\x1b[2Jeverywhere' is not one of"),
    ],
)
def test_an_advert_with_a_bad_claim_is_refused_in_one_line(claim: dict, says: str) -> None:
    problem = advert_problem(_advert(**claim))
    assert says in problem and "\n" not in problem
    assert advert_problem(_advert()) == ""


def test_hostile_peers_are_left_out_and_the_run_ends_equal_to_a_clean_one(
    tmp_path: Path, reference: Callable[[list[str]], Future[Path]]
) -> None:
    """One swarm, every kind of hostile peer met so far, next to three honest ones:
    adverts claiming NaN or negative FLOP/s or an address that does not parse (each
    named once, never planned); a peer whose every activation, loss and gradient is
    NaN (its receivers refuse the values, the coordinator checks its signed frame and
    excludes it); and a peer that reports an honest sender's finite values as poison
    (the signed frame it must attach shows no NaN: it is the one excluded). The run
    redoes the poisoned steps without them and ends finite and equal to a clean run."""
    ref = reference(COMMON)
    save = tmp_path / "swarm.safetensors"
    args = [*COMMON, "--min-peers", "5", "--stages", "5", "--save", str(save), "--run-dir", str(tmp_path / "run")]
    swarm = Swarm(tmp_path, args, peers=0)
    try:
        modes = ("nan", "negative", "maddr", "poison", "framer")
        started = {mode: swarm.start_hostile(mode, f"h{i}.key") for i, mode in enumerate(modes)}
        hostile = {mode: joined(p) for mode, p in started.items()}  # all before the first honest peer
        honest = {joined(p, 90) for p in [swarm.start_peer(i) for i in range(3)]}
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        out = swarm.coord.output
        said = {
            m: re.findall(rf"ignoring the advert of {hostile[m]}: (.*)$", out, re.M)
            for m in ("nan", "negative", "maddr")
        }
        assert [len(r) for r in said.values()] == [1, 1, 1], "each bad advert named once"
        assert "FLOP/s nan is not a finite number" in said["nan"][0]
        assert "FLOP/s -1000000000000.0" in said["negative"][0] and "is not a multiaddr" in said["maddr"][0]
        assert re.search(rf"peer {hostile['poison']} .*failed: excluded: .*(non_finite|non-finite)", out), out[-3000:]
        assert re.search(rf"peer {hostile['framer']} .*failed: excluded: ", out), out[-3000:]
        assert not any(re.search(rf"peer {h} .*failed", out) for h in honest), "no honest peer was blamed"
        assert set(re.findall(r"stage \d replica \d: peer (\w+)", out)) == honest
        assert "Traceback" not in out and "\x1b" not in out
    finally:
        swarm.close()
    state = load_file(str(save))
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    _equals_reference(save, ref)


def test_wrong_but_finite_work_is_caught_by_re_execution(
    tmp_path: Path, reference: Callable[[list[str]], Future[Path]]
) -> None:
    """Accountable compute: one stage served by five replicas, three of them cheats:
    one adds (finite) noise to what it computes, one reports a fake loss while
    computing honestly, one computes honestly but shows tampered frames as evidence.
    Every micro-batch is re-executed by another replica (``--spot-check 1``): each
    cheat is excluded (by the majority, or as its frames' signatures fail), the
    disputed frames are kept as evidence, no honest peer is blamed, and the run ends
    equal to a clean one."""
    ref = reference(COMMON)
    save, run_dir = tmp_path / "swarm.safetensors", tmp_path / "run"
    args = [*COMMON, "--min-peers", "5", "--stages", "1", "--spot-check", "1", "--save", str(save)]
    swarm = Swarm(tmp_path, [*args, "--run-dir", str(run_dir)], peers=0)
    try:
        modes = ("noisy", "fakeloss", "liar")
        started = {mode: swarm.start_hostile(mode, f"c{i}.key") for i, mode in enumerate(modes)}
        peers = [swarm.start_peer(i) for i in range(2)]  # the plan waits for all five: they start together
        cheats = {mode: joined(p) for mode, p in started.items()}
        honest = {joined(p, 90) for p in peers}
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        out = swarm.coord.output
        for mode, pid in cheats.items():
            assert re.search(rf"peer {pid} .*failed: excluded: ", out), (mode, out[-3000:])
        assert re.search(rf"peer {cheats['liar']} .*excluded: it could not show the input frame", out), out[-3000:]
        named = re.search(r"\b0\.0(099\d*|1)\b", out)
        assert named, ("the fake loss is named (as reported, or as its own re-execution gave it)", out[-4000:])
        assert not any(re.search(rf"peer {h} .*failed", out) for h in honest), "no honest peer was blamed"
        assert set(re.findall(r"stage \d replica \d: peer (\w+)", out)) == honest
        assert re.search(r"(\d+) spot checks", out) and int(re.search(r"(\d+) spot checks", out).group(1)) >= 4 * STEPS
        assert list((run_dir / "evidence").glob("*.safetensors")), "the disputed frames are kept"
        assert "Traceback" not in out
    finally:
        swarm.close()
    _equals_reference(save, ref)


@pytest.mark.parametrize(
    "stages, claim",
    [(2, {"FUSIONLLM_CLAIM_FLOPS": "1e9"}), (3, {})],
    ids=["replicas-arbitrated-by-another-stage", "one-peer-stages-checked-by-other-stages"],
)
def test_a_cheat_is_caught_by_peers_of_another_stage(
    tmp_path: Path, stages: int, claim: dict[str, str], reference: Callable[[list[str]], Future[Path]]
) -> None:
    """A noisy cheat among three peers, every micro-batch spot-checked.
    Two stages: the cheat (claiming a low FLOP/s, so that OP-Fence pairs it with an
    honest replica) and its honest twin disagree, and a peer of the other stage
    rebuilds their stage with the weights both show and sides with the honest one.
    Three stages of one peer each (the demo's plan): peers of other stages rebuild
    the cheat's stage with the weights it shows and both say it is wrong (or, checking
    another's stage with its noise, it disputes honest work and a second checker
    exposes it). Either way the cheat is excluded, no honest peer is blamed, and the
    run ends equal to a clean one."""
    ref = reference(COMMON)
    save = tmp_path / "swarm.safetensors"
    args = [*COMMON, "--min-peers", "3", "--stages", str(stages), "--spot-check", "1", "--save", str(save)]
    swarm = Swarm(tmp_path, [*args, "--run-dir", str(tmp_path / "run")], peers=0)
    try:
        started = swarm.start_hostile("noisy", "c.key", claim)
        peers = [swarm.start_peer(i) for i in range(2)]  # the plan waits for all three: they start together
        cheat = joined(started)
        honest = {joined(p, 90) for p in peers}
        assert swarm.coord.wait(300) == 0, swarm.coord.output[-3000:]
        out = swarm.coord.output
        assert re.search(rf"peer {cheat} .*failed: excluded: .*re-executed", out), out[-3000:]
        assert not any(re.search(rf"peer {h} .*failed", out) for h in honest), "no honest peer was blamed"
        # step 0 was checked while step 1 trained: its update is undone, the steps since redone (with three
        # stages the lost stage needs a re-plan, which rolls back anyway)
        undone = "a committed step was not trusted" if stages == 2 else "re-planned the remaining peers"
        assert re.search(rf"{undone}; rolling back to the initial weights", out), out[-3000:]
        assert "Traceback" not in out
    finally:
        swarm.close()
    _equals_reference(save, ref)


def test_a_flood_of_rejects_is_counted_but_logged_a_few_lines_without_escapes(caplog: pytest.LogCaptureFixture) -> None:
    from protocol.wire.gate import LOG_BURST, Gate
    from protocol.wire.reject import Reject, Rejected

    gate = Gate("r")
    with caplog.at_level("WARNING", logger="protocol.wire.gate"):
        for i in range(1000):
            gate.reject("\x1b[2Jflooder", Rejected(Reject.WRONG_RUN, f"run \x1b[31mevil{i}"))
    assert gate.counts[Reject.WRONG_RUN] == 1000
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == LOG_BURST and not any("\x1b" in line for line in lines)


def test_a_number_beyond_any_float_is_a_bad_message_not_a_crash() -> None:
    from protocol.wire.messages import PROTOCOL_VERSION, Message
    from protocol.wire.schema import MessageError

    header = {
        "kind": "done",
        "v": PROTOCOL_VERSION,
        "run_id": "r",
        "step": 0,
        "stage": 0,
        "replica": 0,
        "grad_norms": {"w": 10**400},
    }
    with pytest.raises(MessageError, match="out of range"):
        Message.from_header(header)


def test_non_finite_losses_exclude_the_peer_except_under_fp16_loss_scaling() -> None:
    from coordinator.pipeline import finite_losses
    from coordinator.runstate import EXCLUDED, PeerLost

    with pytest.raises(PeerLost) as lost:
        finite_losses("peer", {"0": 1.0, "1": float("nan")})
    assert lost.value.lost["peer"].startswith(EXCLUDED)
    assert finite_losses("peer", {"0": float("inf")}, overflow_ok=True) == {"0": float("inf")}


def test_forged_overflows_cannot_drive_the_loss_scale_to_zero() -> None:
    from protocol.model.recipe import LOSS_SCALE_MIN, LossScale

    scale = LossScale()
    for _ in range(2000):
        scale = scale.after(True)
    assert scale.scale == LOSS_SCALE_MIN > 0


def test_fp16_codecs_saturate_so_a_finite_value_never_arrives_as_poison() -> None:
    from protocol.wire.codecs import FP16_MAX, Codec
    from protocol.wire.encoding import Frame, Link, all_finite, encode_values

    x = torch.tensor([1e6, -1e9, 3.0, float("nan")])
    descs, chunks = encode_values([x[:3]], Link(Codec.parse("fp16")))
    got = Frame({"values": descs}, memoryview(b"".join(bytes(c) for c in chunks))).values()[0]
    assert all_finite(got) and got.tolist() == [FP16_MAX, -FP16_MAX, 3.0]
    descs, chunks = encode_values([x], Link(Codec.parse("fp16")))
    assert not all_finite(Frame({"values": descs}, memoryview(b"".join(bytes(c) for c in chunks))).values()[0])


LATE = ["--model", "tests/models.py:late", "--data", "tests/models.py:late_data", "--steps", "6"]


@pytest.mark.parametrize("how", [["--reference"], ["--stages", "2"]])
def test_a_model_that_raises_in_training_is_one_line_with_its_file_and_line(how: list[str]) -> None:
    r = run_cli("train", *how, *LATE)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: the model fails at " in r.stderr and "models.py:" in r.stderr and "late failure" in r.stderr


def test_a_swarm_stops_on_a_model_failure_two_peers_report(tmp_path: Path) -> None:
    """One peer saying the model raised is dropped (it may lie); when a second peer
    running the same stage says the same, the run stops with that one line."""
    r = run_cli("demo", "--peers", "2", *LATE, "--save", str(tmp_path / "m.safetensors"), timeout=240)
    assert r.returncode != 0
    said = [line for line in r.stdout.splitlines() + r.stderr.splitlines() if line.startswith("fusionllm: run failed")]
    assert len(said) == 1 and "the model fails at " in said[0] and "(reported by 2 peers)" in said[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr
