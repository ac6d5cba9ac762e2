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
  ``auto``'s slow links); ``lowrank8_encode_gbps``: rank 8 of the same 16M
  elements as a 131072 x 128 matrix (activations of 128 channels: an exact SVD),
  and ``lowrank8_wire_ratio`` its fp32 bytes over its bytes on the wire.
- ``sign_verify_fraction_of_transfer``: sealing (BLAKE3 digest + Ed25519 sign)
  and checking (signature, digest) one 4 MiB message, over the time the same
  signed message takes from one transport's ``send`` to the other's inbox on
  loopback (libp2p streams; best of 10); ``..._of_unsigned_transfer`` divides by
  that time minus the crypto instead.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from p2p import transport_pair  # noqa: E402

from protocol.codecs import Codec, decode, encode_parts  # noqa: E402
from protocol.envelope import Gate, Sealer  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import Activations  # noqa: E402
from protocol.wire import Link, encode_values  # noqa: E402

N = 16 * 1024 * 1024
DENSITY = 0.01
MESSAGE = 4 << 20


def _best(fn, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def codec_speeds() -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(N)
    gb = x.numel() * 4 / 1e9
    codec = Codec("adatopk", DENSITY)
    k = round(DENSITY * N)
    enc_s = _best(lambda: encode_parts(x, codec))
    parts = encode_parts(x, codec)
    parts = [memoryview(bytearray(p)) for p in parts]
    dec_s = _best(lambda: decode(parts, codec, torch.float32, [N]))

    def global_topk() -> None:
        idx = x.abs().topk(k, sorted=False).indices
        x[idx].half()
        idx.int()

    glob_s = _best(global_topk, repeats=3)
    fp16_s = _best(lambda: encode_parts(x, Codec("fp16")))
    int4 = Codec("int4", stochastic=True)
    gen = torch.Generator().manual_seed(0)
    int4_s = _best(lambda: encode_parts(x, int4, gen))
    low, matrix = Codec("lowrank", rank=8), x.view(-1, 128)
    low_s = _best(lambda: encode_parts(matrix, low), repeats=3)
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
        "lowrank8_wire_ratio": round(N * 4 / low.wire_bytes(N, torch.float32, list(matrix.shape)), 2),
    }


def sign_verify_seconds() -> float:
    key = Identity.generate()
    sealer = Sealer(key, "p")
    gate = Gate("r")
    gate.admit("p", key.public_key)
    x = torch.randn(MESSAGE // 4)
    descs, chunks = encode_values([x])
    payload = memoryview(bytearray(b"".join(bytes(c) for c in chunks)))

    def once() -> None:
        head, _ = sealer.seal(Activations("r", 0, 0, 1), descs, chunks)
        env, _ = gate.check_head(head, "p")
        gate.check_payload(env, payload, "p")

    return _best(once, repeats=10)


async def _transfer_seconds(repeats: int = 10) -> float:
    async with transport_pair("r") as (a, b):
        x = torch.randn(MESSAGE // 4)
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            await a.send(b.peer_id, Activations("r", 0, i, 1), [x])
            got = await b.inbox.get()
            got.values()
            if i > 0:  # the first opens the stream
                best = min(best, time.perf_counter() - start)
        return best


def main() -> None:
    torch.set_num_threads(2)
    out = codec_speeds()
    sv = sign_verify_seconds()
    transfer = asyncio.run(_transfer_seconds())
    out["sign_verify_ms_4mib"] = round(sv * 1e3, 2)
    out["transfer_ms_4mib"] = round(transfer * 1e3, 2)
    # the end-to-end time of a signed 4 MiB message, sealing and checking included
    out["sign_verify_fraction_of_transfer"] = round(sv / transfer, 3)
    # the stricter reading: against the transfer without the crypto
    out["sign_verify_fraction_of_unsigned_transfer"] = round(sv / max(transfer - sv, 1e-9), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
