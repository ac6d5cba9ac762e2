"""The format of token shards (``--data tokens:DIR``), as ``fusionllm data prepare``
(``zoo.corpus``) writes it and the loader (``zoo.tokens``) reads it.

A shard directory holds ``meta.json`` (:class:`ShardMeta`), one raw little-endian
array of token ids per split (``train.bin``, ``val.bin``, of the narrowest unsigned
dtype that holds the vocabulary) and a copy of the tokenizer that made them. Numpy
only: preparing shards imports no torch."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "fusionllm-tokens"
VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
#: the most bytes of meta.json read: it is a few hundred bytes; anything larger is not ours
MAX_META_BYTES = 1 << 16
#: unsigned dtypes by width; a vocabulary takes the first that holds every id
DTYPES = ("uint8", "uint16", "uint32")
#: the largest vocabulary a shard may declare (and ``--train-tokenizer`` may ask for)
MAX_VOCAB = 1 << 22


class ShardError(ValueError):
    """Shards that cannot be read or trained on; ``str()`` is one line."""


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned dtype holding the ids ``0 .. vocab_size - 1``."""
    for name in DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    raise ShardError(f"a vocabulary of {vocab_size} tokens does not fit {DTYPES[-1]}")


@dataclass(frozen=True)
class Split:
    file: str  # the array's file name inside the shard directory
    tokens: int
    documents: int


@dataclass(frozen=True)
class ShardMeta:
    """``meta.json``: what the shards hold and what made them."""

    vocab_size: int
    dtype: str
    tokenizer: dict[str, Any]  # kind (bytes, tiktoken, tokenizers), name, file (a copy in the directory) or None
    eot: int | None  # the id appended after each document, or None
    splits: dict[str, Split] = field(default_factory=dict)
    source_bytes: int = 0
    val_fraction: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, **asdict(self)}, indent=1)

    @classmethod
    def read(cls, directory: Path) -> ShardMeta:
        """The checked meta of ``directory`` (``ShardError`` in one line otherwise)."""
        path = directory / META
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_META_BYTES + 1)
        except OSError as exc:
            raise ShardError(f"cannot read {path}: {exc.strerror} (make it with 'fusionllm data prepare')") from None
        try:
            doc = json.loads(raw) if len(raw) <= MAX_META_BYTES else None
            return cls._checked(doc)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ShardError(f"{path} is not a token shard's meta: {exc}") from None

    @classmethod
    def _checked(cls, doc: Any) -> ShardMeta:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"no 'format': '{FORMAT}'")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, this FusionLLM reads {VERSION}")
        vocab, dtype, eot = doc["vocab_size"], doc["dtype"], doc.get("eot")
        if not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB or dtype != dtype_for(vocab):
            raise ValueError(f"vocab_size {vocab!r} with dtype {dtype!r}")
        if eot is not None and (not isinstance(eot, int) or not 0 <= eot < vocab):
            raise ValueError(f"eot {eot!r} is not a token id")
        splits = {}
        for name, s in doc["splits"].items():
            split = Split(str(s["file"]), int(s["tokens"]), int(s["documents"]))
            plain = Path(split.file).name == split.file and not split.file.startswith(".")  # a file in the folder
            if name not in SPLITS or not plain or split.tokens < 0:
                raise ValueError(f"split {name!r}: {s!r}")
            splits[name] = split
        tok = doc["tokenizer"]
        if not isinstance(tok, dict):
            raise ValueError("'tokenizer' is not an object")
        return cls(vocab, dtype, tok, eot, splits, int(doc.get("source_bytes", 0)), float(doc.get("val_fraction", 0)))
