"""Codec and signing speed, measured in one run. Prints one JSON object.

- ``adatopk_encode_gbps`` / ``adatopk_decode_gbps``: GB/s (1e9 bytes) of fp32
  input through AdaTopK at 1% density (blocks of 256, uint8 indices, fp16 values)
  for a 16M-element tensor; ``global_topk_gbps``: the same for one global
  ``torch.topk`` over the whole tensor (with the value gather and fp16 cast);
  ``adatopk_vs_global_topk`` is their ratio.
- ``adatopk_wire_vs_ideal``: AdaTopK's bytes on the wire (including its signed
  envelope head) over k x (value bytes + index bytes), k = 1% of the elements.
- ``fp16_encode_gbps``: the fp16 cast codec.
- ``int4sr_encode_gbps``: 4-bit codes with stochastic rounding (blocks of 128) (the gradients of
  ``auto-lowrank``'s slow links); ``lowrank8_encode_gbps``: rank 8 of the same 16M
  elements as a 131072 x 128 matrix (activations of 128 channels: an exact SVD),
  and ``lowrank8_wire_ratio`` its fp32 bytes over its bytes on the wire.
- ``sign_verify_fraction_of_transfer``: the signing and checking that stand on a
  4 MiB message's critical path, over the time the same signed message takes from
  one transport's ``send`` to the other's inbox on loopback (the direct data path;
  best of 10), the median of 5 such runs in this process (``..._runs`` lists them).
  Such a message travels payload first (``protocol.net.payload_first``): each side
  hashes it a ``HASH_STEP`` at a time while the rest is on the wire, so on the path
  are the hashing of its last ``HASH_TAIL`` bytes on each side, signing its head over the digest
  (Ed25519) and checking the head's signature and the digest's value
  (``sign_verify_ms_4mib``); ``stream_hash_ms_4mib`` is the whole hashing, and
  ``sign_verify_fraction_if_hashed_after`` the fraction had it been a pass of its
  own (as a head-first frame's sender, on libp2p, still hashes before its first
  byte). ``..._of_unsigned_transfer`` divides by the transfer time minus the
  crypto instead.

``--short`` runs the same paths smaller, for the test suite: 1M elements instead
of 16M, 1 MiB messages instead of 4 MiB (the ``*_4mib`` keys then hold the 1 MiB
figures) and fewer repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from p2p import transport_pair  # noqa: E402

from protocol.trust.identity import Identity  # noqa: E402
from protocol.wire.codecs import Codec, decode, encode_parts  # noqa: E402
from protocol.wire.encoding import HASH_TAIL, Link, encode_values  # noqa: E402
from protocol.wire.envelope import Sealer  # noqa: E402
from protocol.wire.gate import Gate  # noqa: E402
from protocol.wire.messages import Activations  # noqa: E402

DENSITY = 0.01


@dataclass(frozen=True)
class Sizes:
    n: int  # elements of the codec benchmarks' tensor (a multiple of 128)
    message: int  # bytes of the signed message
    repeats: int  # timed runs of each codec (after a warm-up)
    transfers: int  # timed transfers (after one that opens the stream)
    runs: int = 5  # side-by-side runs of the signing figures (their median is reported)


FULL = Sizes(n=16 * 1024 * 1024, message=4 << 20, repeats=5, transfers=10)
SHORT = Sizes(n=1024 * 1024, message=1 << 20, repeats=2, transfers=3, runs=1)


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def codec_speeds(sizes: Sizes) -> dict[str, float]:
    n, repeats, few = sizes.n, sizes.repeats, min(sizes.repeats, 3)
    torch.manual_seed(0)
    x = torch.randn(n)
    gb = x.numel() * 4 / 1e9
    codec = Codec("adatopk", DENSITY)
    k = round(DENSITY * n)
    enc_s = _best(lambda: encode_parts(x, codec), repeats)
    parts = encode_parts(x, codec)
    parts = [memoryview(bytearray(p)) for p in parts]
    dec_s = _best(lambda: decode(parts, codec, torch.float32, [n]), repeats)

    def global_topk() -> None:
        idx = x.abs().topk(k, sorted=False).indices
        x[idx].half()
        idx.int()

    glob_s = _best(global_topk, few)
    fp16_s = _best(lambda: encode_parts(x, Codec("fp16")), repeats)
    int4 = Codec("int4", stochastic=True)
    gen = torch.Generator().manual_seed(0)
    int4_s = _best(lambda: encode_parts(x, int4, gen), repeats)
    low, matrix = Codec("lowrank", rank=8), x.view(-1, 128)
    low_s = _best(lambda: encode_parts(matrix, low), few)
    descs, chunks = encode_values([x], Link(codec))
    head, payload = Sealer(Identity.generate(), "p").seal(Activations("r", 0, 0, 1), descs, chunks, str(codec))
    ideal = k * (2 + 1)
    return {
        "adatopk_encode_gbps": round(gb / enc_s, 3),
        "adatopk_decode_gbps": round(gb / dec_s, 3),
        "global_topk_gbps": round(gb / glob_s, 3),
        "adatopk_vs_global_topk": round(glob_s / enc_s, 2),
        "adatopk_wire_vs_ideal": round((len(head) + payload) / ideal, 4),
        "fp16_encode_gbps": round(gb / fp16_s, 3),
        "int4sr_encode_gbps": round(gb / int4_s, 3),
        "lowrank8_encode_gbps": round(gb / low_s, 3),
        "lowrank8_wire_ratio": round(n * 4 / low.wire_bytes(n, torch.float32, list(matrix.shape)), 2),
    }


def sign_verify_seconds(sizes: Sizes) -> float:
    key = Identity.generate()
    sealer = Sealer(key, "p")
    gate = Gate("r")
    gate.admit("p", key.public_key)
    x = torch.randn(sizes.message // 4)
    descs, chunks = encode_values([x])
    payload = memoryview(bytearray(b"".join(bytes(c) for c in chunks)))

    digest = blake3(payload).hexdigest()

    def once() -> None:
        # payload first (a direct stream): hashed on both sides while it travels, so what
        # waits for the crypto is signing the head over the digest and checking it
        head, _ = sealer.seal(Activations("r", 0, 0, 1), descs, chunks, digest=digest)
        env, _ = gate.check_head(head, "p")
        gate.check_payload(env, payload, "p", digest)  # hashed as it arrived (stream_hash_seconds)

    return _best(once, 2 * sizes.repeats)


def stream_hash_seconds(sizes: Sizes) -> float:
    """The receiver's hashing of a message's payload, in the 64 KiB chunks a stream
    hands over (done while the rest arrives)."""
    payload = memoryview(bytearray(sizes.message))

    def once() -> None:
        h = blake3()
        for i in range(0, len(payload), 1 << 16):
            h.update(payload[i : i + (1 << 16)])
        h.hexdigest()

    return _best(once, 2 * sizes.repeats)


async def _transfer_seconds(sizes: Sizes) -> float:
    async with transport_pair("r") as (a, b):
        x = torch.randn(sizes.message // 4)
        best = float("inf")
        for i in range(sizes.transfers + 1):
            start = time.perf_counter()
            await a.send(b.peer_id, Activations("r", 0, i, 1), [x])
            got = await b.inbox.get()
            got.values()
            if i > 0:  # the first opens the stream
                best = min(best, time.perf_counter() - start)
        return best


def sign_verify_figures(sizes: Sizes) -> dict[str, object]:
    """The crypto on a message's critical path over its transfer time, measured side by
    side ``sizes.runs`` times (the machine is shared: the median, and every run)."""
    runs = []
    for _ in range(sizes.runs):
        hashed = stream_hash_seconds(sizes)
        # the last HASH_TAIL bytes are hashed after they land, on each side, before the head can go or be checked
        sv = sign_verify_seconds(sizes) + 2 * hashed * min(1.0, HASH_TAIL / sizes.message)
        runs.append((sv, hashed, asyncio.run(_transfer_seconds(sizes))))
    fractions = [sv / transfer for sv, _, transfer in runs]
    sv, hashed, transfer = sorted(runs, key=lambda r: r[0] / r[2])[len(runs) // 2]
    return {
        "sign_verify_ms_4mib": round(sv * 1e3, 3),
        "stream_hash_ms_4mib": round(hashed * 1e3, 3),
        "transfer_ms_4mib": round(transfer * 1e3, 2),
        # the end-to-end time of a signed 4 MiB message, sealing and checking included
        "sign_verify_fraction_of_transfer": round(statistics.median(fractions), 4),
        "sign_verify_fraction_of_transfer_runs": [round(f, 4) for f in fractions],
        "sign_verify_fraction_if_hashed_after": round((sv + hashed) / transfer, 4),
        # the stricter reading: against the transfer without the crypto
        "sign_verify_fraction_of_unsigned_transfer": round(sv / max(transfer - sv, 1e-9), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    torch.set_num_threads(2)
    out: dict[str, object] = dict(codec_speeds(sizes))
    out.update(sign_verify_figures(sizes))
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
