"""Signed envelopes: every tampering, replay, wrong run/step/stage and oversized
frame is rejected with its code; a hypothesis fuzz pushes >= 1,000 generated and
mutated frames through the receiver's checks (>= 10,000 under ``-m slow``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings

from peer.checks import PlanChecks
from protocol.trust.identity import Identity, IdentityError, check_record, sign_record, verify
from protocol.wire.codecs import Codec
from protocol.wire.encoding import Frame, Link, encode_values
from protocol.wire.envelope import HEAD, Sealer, head_length
from protocol.wire.expect import describe
from protocol.wire.gate import Gate
from protocol.wire.messages import Activations, Assign, Gradients, LinkPlan, Ready, StepDone
from protocol.wire.reject import Reject, Rejected

RUN = "run-1"
ALICE, BOB, COORD = "peer-alice", "peer-bob", "coordinator"
KEY_A, KEY_B, KEY_C = Identity.generate(), Identity.generate(), Identity.generate()


def _frame(sealer: Sealer, message: object, values: list | None = None, link: Link | None = None) -> bytes:
    descs, chunks = encode_values(values or [], link)
    head, _ = sealer.seal(message, descs, chunks, str(link.codec) if link else "none")  # type: ignore[arg-type]
    return head + b"".join(bytes(c) for c in chunks)


def _gate() -> Gate:
    gate = Gate(RUN, max_payload=1 << 20)
    gate.admit(ALICE, KEY_A.public_key)
    gate.admit(COORD, KEY_C.public_key)
    return gate


def _code(gate: Gate, frame: bytes, sender: str = ALICE) -> Reject | None:
    try:
        gate.open(frame, sender)
    except Rejected as exc:
        return exc.code
    return None


def test_a_signed_message_opens_and_its_values_decode() -> None:
    x = torch.randn(2, 3)
    opened = _gate().open(_frame(Sealer(KEY_A, ALICE), Activations(RUN, 3, 1, 2), [x, 7]), ALICE)
    assert opened.message == Activations(RUN, 3, 1, 2)
    assert opened.envelope.seq > 0 and opened.envelope.digest
    frame = _frame(Sealer(KEY_A, ALICE), Activations(RUN, 3, 1, 2), [x, 7])
    values = Frame({"values": opened.envelope.values}, memoryview(bytearray(frame[head_length(frame) :]))).values()
    assert torch.equal(values[0], x) and values[1] == 7


def test_flipping_any_byte_is_rejected() -> None:
    frame = _frame(Sealer(KEY_A, ALICE), Gradients(RUN, 1, 0, 0), [torch.randn(5), (torch.ones(2),)])
    gate = _gate()
    head = head_length(frame)
    for i in range(len(frame)):
        bad = bytearray(frame)
        bad[i] ^= 0x01
        code = _code(gate, bytes(bad))
        assert code is not None, f"byte {i} flipped and accepted"
        if i >= head:
            assert code is Reject.BAD_DIGEST
        elif i >= head - 64:
            assert code is Reject.BAD_SIGNATURE
    assert _code(gate, frame) is None, "the intact frame still opens after all that"


def test_replay_is_rejected() -> None:
    gate = _gate()
    frame = _frame(Sealer(KEY_A, ALICE), Activations(RUN, 0, 0, 1), [torch.ones(3)])
    assert _code(gate, frame) is None
    assert _code(gate, frame) is Reject.REPLAY
    assert gate.counts[Reject.REPLAY] == 0  # open() raises; the transport counts via gate.reject


def test_replay_window_refuses_old_sequence_numbers() -> None:
    gate = Gate(RUN)
    gate.admit(ALICE, KEY_A.public_key)
    gate.window = 8
    sealer = Sealer(KEY_A, ALICE)
    frames = [_frame(sealer, Ready(RUN, 0, 0, 0.0)) for _ in range(20)]
    for f in frames[15:]:
        assert _code(gate, f) is None
    assert _code(gate, frames[12]) is None  # out of order but inside the window
    assert _code(gate, frames[0]) is Reject.REPLAY  # older than the window


def test_restarted_sender_does_not_collide_with_its_old_sequence_numbers() -> None:
    gate = _gate()
    assert _code(gate, _frame(Sealer(KEY_A, ALICE), Ready(RUN, 0, 0, 0.0))) is None
    assert _code(gate, _frame(Sealer(KEY_A, ALICE), Ready(RUN, 0, 0, 0.0))) is None


@pytest.mark.parametrize(
    ("sender_key", "sender_name", "stream", "message", "code"),
    [
        (KEY_A, ALICE, ALICE, Ready("other-run", 0, 0, 0.0), Reject.WRONG_RUN),
        (KEY_B, BOB, BOB, Ready(RUN, 0, 0, 0.0), Reject.NOT_ADMITTED),
        (KEY_B, ALICE, ALICE, Ready(RUN, 0, 0, 0.0), Reject.BAD_SIGNATURE),
        (KEY_A, ALICE, BOB, Ready(RUN, 0, 0, 0.0), Reject.SENDER_MISMATCH),
    ],
)
def test_run_admission_and_signature(
    sender_key: Identity, sender_name: str, stream: str, message: object, code: Reject
) -> None:
    assert _code(_gate(), _frame(Sealer(sender_key, sender_name), message), stream) is code


def _assigned_gate(stage: int = 1, boundary1: Codec | None = None) -> Gate:
    """A gate with the plan checks of the peer serving ``stage`` of a 3-stage run
    (boundary 1 in ``adatopk:0.1`` unless ``boundary1`` says otherwise)."""
    gate = Gate(RUN)
    for name, key in ((ALICE, KEY_A), (BOB, KEY_B), (COORD, KEY_C)):
        gate.admit(name, key.public_key)
    spec_act = describe(encode_values([torch.zeros(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)])[0])
    view = [[p] if abs(i - stage) <= 1 else [] for i, p in enumerate((ALICE, BOB, "carol"))]  # its neighbourhood
    a = Assign(RUN, stage, 0, {}, [5, 9], view, [1, 1, 1], {}, keys={}, specs=[[], spec_act, spec_act])
    second = boundary1 or Codec("adatopk", 0.1)
    checks = PlanChecks(COORD, a, [Codec(), second], 4, frozenset({0, 1, 2, 3}))
    gate.expect = checks
    return gate


def test_wrong_step_stage_micro_batch_or_sender_are_unexpected() -> None:
    good = [torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)]
    alice = Sealer(KEY_A, ALICE)
    assert _code(_assigned_gate(), _frame(alice, Activations(RUN, 4, 2, 1), good)) is None
    assert _code(_assigned_gate(), _frame(alice, Activations(RUN, 5, 2, 1), good)) is None  # next step may run ahead
    for msg in (Activations(RUN, 9, 2, 1), Activations(RUN, 3, 2, 1), Activations(RUN, 4, 2, 2)):
        assert _code(_assigned_gate(), _frame(alice, msg, good)) is Reject.UNEXPECTED
    assert _code(_assigned_gate(), _frame(alice, Activations(RUN, 4, 7, 1), good)) is Reject.UNEXPECTED
    # the coordinator does not feed stage 1; bob (stage 1 itself) does not send it activations
    assert _code(_assigned_gate(), _frame(Sealer(KEY_C, COORD), Activations(RUN, 4, 0, 1), good), COORD) is (
        Reject.UNEXPECTED
    )
    assert _code(_assigned_gate(), _frame(alice, StepDone(RUN, 4, 1, 0), None)) is Reject.UNEXPECTED


def test_shapes_dtypes_and_codecs_must_match_the_plan() -> None:
    alice = Sealer(KEY_A, ALICE)
    msg = Activations(RUN, 4, 0, 1)
    bad_values = [
        [torch.randn(4, 8, 17), torch.zeros(4, 8, dtype=torch.long)],  # shape
        [torch.randn(4, 8, 16).double(), torch.zeros(4, 8, dtype=torch.long)],  # dtype
        [torch.randn(4, 8, 16)],  # count
        [torch.randn(5, 8, 16), torch.zeros(5, 8, dtype=torch.long)],  # a bigger micro-batch
    ]
    for values in bad_values:
        assert _code(_assigned_gate(), _frame(alice, msg, values)) is Reject.BAD_TENSORS
    smaller = [torch.randn(3, 8, 16), torch.zeros(3, 8, dtype=torch.long)]  # an uneven split's last micro-batch
    assert _code(_assigned_gate(), _frame(alice, msg, smaller)) is None
    # the link from stage 0 is uncompressed in the plan; a compressed tensor is refused
    compressed = [torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)]
    assert _code(_assigned_gate(), _frame(alice, msg, compressed, Link(Codec("fp16")))) is Reject.BAD_TENSORS
    # gradients from stage 2 must use the plan's adatopk:0.1 on boundary 1
    carol = Identity.generate()
    gate = _assigned_gate()
    gate.admit("carol", carol.public_key)
    grads = [torch.randn(4, 8, 16), None]
    sealer = Sealer(carol, "carol")
    assert _code(gate, _frame(sealer, Gradients(RUN, 4, 1, 1), grads, Link(Codec("adatopk", 0.1))), "carol") is None
    assert _code(gate, _frame(sealer, Gradients(RUN, 4, 1, 1), grads), "carol") is Reject.BAD_TENSORS


def test_the_link_plans_codecs_count_from_the_moment_its_frame_is_let_in() -> None:
    """Stage 0 may send its first activations in the link plan's codec before this
    peer's epoch has taken the plan from its mailbox: the gate takes the codecs as the
    plan's frame passes (CI: activations in fp16 refused against an empty list, and the
    run waited out its 300 s). A plan of another epoch or length changes nothing."""
    gate = _assigned_gate()
    assert isinstance(gate.expect, PlanChecks)
    gate.expect.codecs = []  # the epoch has not taken its link plan in yet
    alice, coord = Sealer(KEY_A, ALICE), Sealer(KEY_C, COORD)
    values = [torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)]
    fp16 = _frame(alice, Activations(RUN, 4, 0, 1), values, Link(Codec("fp16")))
    assert _code(gate, fp16) is Reject.BAD_TENSORS
    for stale in (LinkPlan(RUN, [Codec("fp16").to_json()] * 2, epoch=1), LinkPlan(RUN, [Codec("fp16").to_json()])):
        assert _code(gate, _frame(coord, stale), COORD) is None
        assert _code(gate, fp16) is Reject.BAD_TENSORS
    assert _code(gate, _frame(coord, LinkPlan(RUN, [Codec("fp16").to_json()] * 2)), COORD) is None
    assert _code(gate, fp16) is None
    assert _code(gate, _frame(alice, Activations(RUN, 4, 1, 1), values)) is Reject.BAD_TENSORS  # not the plan's


def test_a_codec_pair_is_checked_per_direction() -> None:
    """With ``lowrank:4/int4sr`` on boundary 1, stage 2 sends int4sr gradients back:
    gradients in the forward codec, or in int4 without stochastic rounding, are refused."""
    pair = Codec.parse("lowrank:4/int4sr")
    carol = Identity.generate()
    grads = [torch.randn(4, 8, 16), None]
    cases = ((pair.backward, None), (pair.forward, Reject.BAD_TENSORS), (Codec("int4"), Reject.BAD_TENSORS))
    for link_codec, want in cases:
        gate = _assigned_gate(boundary1=pair)
        gate.admit("carol", carol.public_key)
        frame = _frame(Sealer(carol, "carol"), Gradients(RUN, 4, 1, 1), grads, Link(link_codec))
        assert _code(gate, frame, "carol") is want, link_codec
    # and stage 2 takes activations only at rank 4
    good = [torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)]
    bob = Sealer(KEY_B, BOB)
    assert _code(_assigned_gate(2, pair), _frame(bob, Activations(RUN, 4, 0, 2), good, Link(pair.forward)), BOB) is None
    wrong = Link(Codec("lowrank", rank=5))
    refused = _code(_assigned_gate(2, pair), _frame(bob, Activations(RUN, 4, 0, 2), good, wrong), BOB)
    assert refused is Reject.BAD_TENSORS


def test_oversized_frames_are_rejected_from_their_head() -> None:
    gate = _gate()
    frame = _frame(Sealer(KEY_A, ALICE), Activations(RUN, 0, 0, 0), [torch.zeros(1 << 19)])  # 2 MiB > 1 MiB
    head = frame[: head_length(frame)]
    with pytest.raises(Rejected) as info:
        gate.check_head(head, ALICE)  # no payload byte needed to refuse it
    assert info.value.code is Reject.OVERSIZED
    huge_header = HEAD.pack(b"FLS1", 1 << 30)
    with pytest.raises(Rejected) as info:
        gate.check_head(huge_header + b"{}", ALICE)
    assert info.value.code is Reject.OVERSIZED


def test_hello_binds_a_key_to_the_stream_sender_once() -> None:
    from protocol.wire.messages import Hello

    gate = Gate(RUN)
    gate.accept_hello = True
    assert _code(gate, _frame(Sealer(KEY_B, BOB), Ready(RUN, 0, 0, 0.0)), BOB) is Reject.NOT_ADMITTED
    assert _code(gate, _frame(Sealer(KEY_B, BOB), Hello(RUN, KEY_B.public_hex)), BOB) is None
    assert _code(gate, _frame(Sealer(KEY_B, BOB), Ready(RUN, 0, 0, 0.0)), BOB) is None
    # a hello naming a key it is not signed with binds nothing
    assert _code(gate, _frame(Sealer(KEY_A, ALICE), Hello(RUN, KEY_B.public_hex)), ALICE) is Reject.BAD_SIGNATURE
    assert ALICE not in gate.keys


def test_identity_file_is_created_private_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "peer.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load_or_create(path).public_hex == first.public_hex
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        Identity.load_or_create(path)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="not a PEM private key"):
        Identity.load_or_create(bad)


def test_signed_records_detect_any_change() -> None:
    rec = sign_record(KEY_A, {"kind": "advert", "peer_id": ALICE, "flops": 1e9})
    assert check_record(rec).public_bytes_raw() == KEY_A.public_key.public_bytes_raw()
    for field, value in (("peer_id", BOB), ("flops", 2e9), ("pubkey", KEY_B.public_hex)):
        with pytest.raises(IdentityError):
            check_record({**rec, field: value})


def test_signatures_are_plain_ed25519_both_ways() -> None:
    """Signing and checking go through libsodium; keys are kept with ``cryptography``:
    each accepts the other's signatures, and a changed byte, key or length is refused."""
    data = b"a head" * 60
    KEY_A.public_key.verify(KEY_A.sign(data), data)  # OpenSSL accepts libsodium's (raises if not)
    other = Ed25519PrivateKey.generate()
    assert verify(other.public_key(), other.sign(data), data)
    sig = KEY_A.sign(data)
    assert verify(KEY_A.public_key, sig, data)
    assert not verify(KEY_A.public_key, sig, data[:-1] + b"X")
    assert not verify(KEY_B.public_key, sig, data)
    assert not verify(KEY_A.public_key, sig[:-1], data)
    assert not verify(KEY_A.public_key, bytes(64), data)


# ------------------------------------------------------------------ fuzz

_dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8])
_shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3)
_codecs = st.sampled_from([None, "fp16", "bf16", "int8", "adatopk:0.3", "int4", "int4sr", "lowrank:2"])


@st.composite
def _messages(draw: st.DrawFn) -> tuple[bytes, Reject | None, str]:
    """A sealed frame, then maybe one mutation; returns (frame, the code it must get
    or None for 'any rejection', the mutation's name)."""
    kind = draw(st.sampled_from(["act", "grad", "ready", "done"]))
    step, mb, stage = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    msg = {
        "act": Activations(RUN, step, mb, stage),
        "grad": Gradients(RUN, step, mb, stage),
        "ready": Ready(RUN, stage, 0, 0.5),
        "done": StepDone(RUN, step, stage, 0, {"0": 1.5}),
    }[kind]
    # values from a drawn seed: a frame (its length too: integers travel narrowed) replays exactly
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1 << 20)))
    values = [torch.randn(draw(_shapes), generator=gen).to(draw(_dtypes)) for _ in range(draw(st.integers(0, 3)))]
    codec = draw(_codecs)
    link = Link(Codec.parse(codec), generator=gen) if codec else None
    frame = _frame(Sealer(KEY_A, ALICE), msg, values, link)
    head = head_length(frame)
    mutation = draw(
        st.sampled_from(["none", "flip", "truncate", "extend", "resign-field", "unsigned-field", "garbage", "stranger"])
    )
    if mutation == "none":
        return frame, None, mutation
    if mutation == "flip":
        i = draw(st.integers(0, len(frame) - 1))
        bad = bytearray(frame)
        bad[i] ^= draw(st.integers(1, 255))
        want = Reject.BAD_DIGEST if i >= head else Reject.BAD_SIGNATURE if i >= head - 64 else None
        return bytes(bad), want, mutation
    if mutation == "truncate":
        return frame[: draw(st.integers(0, len(frame) - 1))], None, mutation
    if mutation == "extend":
        return frame + draw(st.binary(min_size=1, max_size=16)), Reject.TRUNCATED, mutation
    if mutation == "garbage":
        return draw(st.binary(min_size=0, max_size=200)), None, mutation
    if mutation == "stranger":  # a well-formed frame from a key nobody admitted
        return _frame(Sealer(KEY_B, ALICE), msg, values, link), Reject.BAD_SIGNATURE, mutation
    # change one envelope field; re-sign it with Alice's key or leave the old signature
    header = json.loads(frame[HEAD.size : head - 64])
    field, value, code = draw(
        st.sampled_from(
            [
                ("run", "another-run", Reject.WRONG_RUN),
                ("v", 99, Reject.VERSION),
                ("sender", BOB, Reject.SENDER_MISMATCH),
                ("kind", "nonsense", Reject.UNKNOWN_KIND),
                ("seq", "seven", Reject.BAD_ENVELOPE),
                ("payload_bytes", 1 << 40, Reject.OVERSIZED),
                ("values", [{"t": "tensor", "dtype": "float32", "shape": [-1], "nbytes": 0}], Reject.BAD_TENSORS),
                ("body", {"build_s": "slow"}, Reject.BAD_BODY),
                ("digest", "0" * 64, Reject.BAD_DIGEST),
            ]
        )
    )
    if field == "body" and kind != "ready":
        field, value, code = "step", -5, Reject.BAD_ENVELOPE
    if field == "values" and not values:
        field, value, code = "seq", -1, Reject.BAD_ENVELOPE
    header[field] = value
    data = json.dumps(header).encode()
    signed = HEAD.pack(b"FLS1", len(data)) + data
    if mutation == "resign-field":
        return signed + KEY_A.sign(signed) + frame[head:], code, mutation
    sig = frame[head - 64 : head]
    early = code in (Reject.BAD_ENVELOPE, Reject.OVERSIZED, Reject.VERSION, Reject.WRONG_RUN, Reject.SENDER_MISMATCH)
    return signed + sig + frame[head:], code if early else Reject.BAD_SIGNATURE, mutation


def _fuzz(examples: int) -> None:
    """``examples`` generated frames through one gate: each gets the code its
    mutation calls for, and every intact one opens and decodes."""
    gate = Gate(RUN, max_payload=1 << 20)
    gate.admit(ALICE, KEY_A.public_key)
    seen: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_messages())
    def check(case: tuple[bytes, Reject | None, str]) -> None:
        frame, want, mutation = case
        seen.append(mutation)
        try:
            opened = gate.open(frame, ALICE)
        except Rejected as exc:
            assert mutation != "none", f"an intact frame was rejected: {exc}"
            assert isinstance(exc.code, Reject)
            if want is not None:
                assert exc.code is want, f"{mutation}: got {exc.code}, want {want}"
            return
        assert mutation == "none", f"a {mutation} frame was accepted"
        Frame({"values": opened.envelope.values}, memoryview(bytearray(frame[head_length(frame) :]))).values()

    check()
    assert len(seen) >= examples
    assert {"none", "flip", "truncate", "resign-field", "unsigned-field"} <= set(seen)


def test_fuzz_a_thousand_messages_through_the_decoder() -> None:
    _fuzz(1_000)


@pytest.mark.slow
def test_fuzz_ten_thousand_messages_through_the_decoder() -> None:
    _fuzz(10_000)
