"""Your own corpus: how fast ``fusionllm data prepare`` tokenizes, how fast the
``tokens:DIR`` loader feeds a run against what the swarm consumes, and whether
the loader's memory stays flat over a corpus of a gigabyte.
Prints one JSON object.

- ``prepare_mb_per_s``: MB (1e6 bytes) of text per second through ``prepare``
  with a byte-level BPE given as a tokenizer.json (the one whose training on
  the same text, vocabulary 4096, ``train_tokenizer_mb_per_s`` measures);
  ``prepare_bytes_mb_per_s``: the same with the bytes tokenizer. The text is
  the running Python's standard library (``corpus_mb`` of it, one document per
  file); the tokenizers library uses every core.
- ``loader_tokens_per_s``: tokens per second the loader yields in the demo's
  batches (16 windows of 64 tokens) from a shard of ``rss_corpus_gb`` GB;
  ``swarm_tokens_per_s``: what the demo's model (``--model gpt``, its default
  batch) trains at in one process here, measured over a few steps: the most
  the demo's swarm of peers on this machine consumes (they share its cores;
  README: 4,582 tokens/s for the 4-peer demo); ``loader_vs_swarm`` is their
  ratio (goal: at least 100).
- ``rss_mb_start`` / ``rss_mb_peak``: the process's resident memory before and
  at its highest while ``loader_batches`` batches are drawn from that shard
  (token ids written directly with numpy, in pieces, to a temporary folder that
  is removed after); ``rss_growth_mb`` is the difference (goal: flat, a few MB).

``--short`` runs the same paths smaller, for the test suite: 1 MB of text
instead of 8, a 34 MB shard instead of 1 GiB, 2,000 batches instead of 50,000.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from fusionllm.local import train_reference
from protocol.model.job import JobSpec
from zoo.corpus import Corpus
from zoo.prepare import PrepareOptions, prepare
from zoo.shards import ShardMeta, Split, dtype_for
from zoo.tokenizer import train_tokenizer
from zoo.tokens import token_batches

VOCAB = 4096  # the trained tokenizer's
SHARD_VOCAB = 50257  # GPT-2's: the written shard's ids are uint16
PIECE_TOKENS = 1 << 24  # the shard is written this many tokens at a time


@dataclass(frozen=True)
class Sizes:
    text_bytes: int  # of the standard library copied as the corpus
    shard_tokens: int  # of the shard the loader reads
    batches: int  # drawn from it
    train_steps: int  # of the demo's model, timed


FULL = Sizes(text_bytes=8_000_000, shard_tokens=1 << 29, batches=50_000, train_steps=8)
SHORT = Sizes(text_bytes=1_000_000, shard_tokens=1 << 24, batches=2_000, train_steps=2)


def _say(text: str) -> None:
    print(f"data.py: {text}", file=sys.stderr, flush=True)


def _write_corpus(root: Path, size: int) -> int:
    """Copy standard-library source files into ``root`` until ``size`` bytes; the bytes copied."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    copied = 0
    for i, path in enumerate(sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)):
        if copied >= size:
            break
        data = path.read_bytes()
        (root / f"{i:05d}.py").write_bytes(data)
        copied += len(data)
    return copied


def _prepare_rates(tmp: Path, sizes: Sizes) -> dict[str, float]:
    text = tmp / "text"
    text.mkdir()
    mb = _write_corpus(text, sizes.text_bytes) / 1e6
    _say(f"training a BPE of {VOCAB} on {mb:.1f} MB")
    corpus = Corpus.scan([str(text)])
    t0 = time.perf_counter()
    tok = train_tokenizer((chunk for doc in corpus.documents_of(False) for chunk in doc), VOCAB)
    rates = {"train_tokenizer_mb_per_s": round(mb / (time.perf_counter() - t0), 2)}
    (tmp / "bpe").mkdir()
    tok.save(tmp / "bpe")
    for name, spec in (("prepare_mb_per_s", str(tmp / "bpe" / "tokenizer.json")), ("prepare_bytes_mb_per_s", "bytes")):
        t0 = time.perf_counter()
        prepare(PrepareOptions([str(text)], tmp / name, tokenizer=spec))
        rates[name] = round(mb / (time.perf_counter() - t0), 2)
    rates["corpus_mb"] = round(mb, 2)
    return rates


def _write_shard(directory: Path, tokens: int) -> None:
    """A shard of ``tokens`` random uint16 ids written piece by piece (never all in memory)."""
    directory.mkdir()
    dtype = dtype_for(SHARD_VOCAB)
    rng = np.random.default_rng(0)
    with (directory / "train.bin").open("wb") as f:
        for start in range(0, tokens, PIECE_TOKENS):
            f.write(rng.integers(0, SHARD_VOCAB, size=min(PIECE_TOKENS, tokens - start), dtype=dtype).tobytes())
    tok = {"kind": "bytes", "name": "random ids", "file": None}
    meta = ShardMeta(SHARD_VOCAB, dtype, tok, None, {"train": Split("train.bin", tokens, 1)})
    (directory / "meta.json").write_text(meta.to_json())


def _loader(tmp: Path, sizes: Sizes) -> dict[str, float]:
    shard = tmp / "shard"
    _say(f"writing a shard of {sizes.shard_tokens * 2 / 1e9:.2f} GB")
    _write_shard(shard, sizes.shard_tokens)
    proc = psutil.Process()
    batches = token_batches(0, 16, 64, path=str(shard))
    next(batches)  # the first map and the imports behind it
    start_rss = peak = proc.memory_info().rss
    _say(f"drawing {sizes.batches} batches")
    t0 = time.perf_counter()
    for i in range(sizes.batches):
        idx, _ = next(batches)
        if i % 500 == 0:
            peak = max(peak, proc.memory_info().rss)
    seconds = time.perf_counter() - t0
    peak = max(peak, proc.memory_info().rss)
    return {
        "loader_tokens_per_s": round(sizes.batches * idx.numel() / seconds),
        "rss_corpus_gb": round(sizes.shard_tokens * 2 / 1e9, 3),
        "rss_mb_start": round(start_rss / 1e6, 1),
        "rss_mb_peak": round(peak / 1e6, 1),
        "rss_growth_mb": round((peak - start_rss) / 1e6, 1),
        "loader_batches": sizes.batches,
    }


def _swarm_tokens_per_s(steps: int) -> float:
    """The demo's model and batch trained in one process: tokens per second (after a warm-up step)."""
    train_reference(JobSpec(steps=1))
    result = train_reference(JobSpec(steps=steps))
    return result.tokens / result.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="a quick run of the same paths (for the test suite)")
    args = ap.parse_args()
    sizes = SHORT if args.short else FULL
    tmp = Path(tempfile.mkdtemp(prefix="fusionllm-data-bench-"))
    try:
        out: dict[str, object] = _prepare_rates(tmp, sizes)
        out.update(_loader(tmp, sizes))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say("timing the demo's model")
    swarm = _swarm_tokens_per_s(sizes.train_steps)
    out["swarm_tokens_per_s"] = round(swarm)
    out["loader_vs_swarm"] = round(float(out["loader_tokens_per_s"]) / swarm, 1)  # type: ignore[arg-type]
    if args.short:
        out["short"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
