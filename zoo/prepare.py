"""``fusionllm data prepare``: a corpus (``zoo.corpus``) through a tokenizer
(``zoo.tokenizer``) into token shards (``zoo.shards``), streamed: memory stays
bounded by a group of chunks whatever the corpus size."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from zoo.corpus import Chunk, Corpus, held_out
from zoo.hf_spec import is_hf, parse_hf
from zoo.shards import META, SPLITS, ShardError, ShardMeta, Split, dtype_for
from zoo.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, train_tokenizer

#: chunks are tokenized in groups of about this many bytes (one library call each)
GROUP_BYTES = 8 << 20
#: the files a shard directory holds besides the splits' arrays
OWN_FILES = (META, TOKENIZER_FILE, *(f"{s}.bin" for s in SPLITS))


@dataclass(frozen=True)
class PrepareOptions:
    inputs: list[str]
    out: Path
    tokenizer: str = "bytes"  # bytes, gpt2 or a tokenizer.json; ignored when train_vocab is set
    train_vocab: int = 0  # train a byte-level BPE of this vocabulary on the corpus (0: no)
    val_fraction: float = 0.05


@dataclass
class _Writer:
    """One split's array file, written under a temporary name until it is complete."""

    path: Path
    dtype: str
    file: BinaryIO
    tokens: int = 0
    documents: int = 0

    def write(self, ids: np.ndarray) -> None:
        self.file.write(ids.astype(self.dtype).tobytes())
        self.tokens += int(ids.size)

    def finish(self) -> Split:
        self.file.close()
        os.replace(self.file.name, self.path)
        return Split(self.path.name, self.tokens, self.documents)


@dataclass
class _Group:
    """Chunks waiting to be tokenized: (split, chunk, ends its document)."""

    items: list[tuple[str, Chunk, bool]] = field(default_factory=list)
    size: int = 0


def prepare(opts: PrepareOptions) -> ShardMeta:
    """Write the shards of ``opts.inputs`` into ``opts.out``; their meta."""
    corpus = Corpus.scan(opts.inputs)
    val = held_out(corpus.documents, opts.val_fraction)
    _check_out(opts.out, opts.inputs)
    if opts.train_vocab:
        texts = (c for i, doc in enumerate(corpus.documents_of(False)) if i not in val for c in doc)
        tok: Tokenizer = train_tokenizer(texts, opts.train_vocab)
    else:
        tok = load_tokenizer(opts.tokenizer)
    opts.out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(tok.vocab_size)
    writers = {s: _Writer(opts.out / f"{s}.bin", dtype, open(opts.out / f".{s}.bin.partial", "wb")) for s in SPLITS}
    try:
        group = _Group()
        for item in _pieces(corpus, val, tok.as_bytes):
            group.items.append(item)
            group.size += len(item[1])
            if group.size >= GROUP_BYTES:
                _flush(group, tok, writers)
        _flush(group, tok, writers)
        splits = {s: w.finish() for s, w in writers.items() if w.documents}
    finally:
        for w in writers.values():
            w.file.close()
            Path(w.file.name).unlink(missing_ok=True)
    for name in SPLITS:
        if name not in splits:
            (opts.out / f"{name}.bin").unlink(missing_ok=True)  # a split an earlier run wrote
    tok.save(opts.out)
    meta = ShardMeta(tok.vocab_size, dtype, tok.meta, tok.eot, splits, corpus.bytes, opts.val_fraction)
    tmp = opts.out / f".{META}.partial"
    tmp.write_text(meta.to_json())
    os.replace(tmp, opts.out / META)
    return meta


def _pieces(corpus: Corpus, val: frozenset[int], as_bytes: bool) -> Iterator[tuple[str, Chunk, bool]]:
    """Every chunk of the corpus with its split; the last of a document says so (an
    empty document is one empty chunk)."""
    for i, doc in enumerate(corpus.documents_of(as_bytes)):
        split = "val" if i in val else "train"
        previous: Chunk | None = None
        for chunk in doc:
            if previous is not None:
                yield split, previous, False
            previous = chunk
        yield split, previous if previous is not None else (b"" if as_bytes else ""), True


def _flush(group: _Group, tok: Tokenizer, writers: dict[str, _Writer]) -> None:
    """Tokenize the waiting chunks in one call and append them, in order, to their splits."""
    if not group.items:
        return
    encoded = tok.encode([chunk for _, chunk, _ in group.items])
    eot = None if tok.eot is None else np.array([tok.eot], dtype=np.int64)
    for (split, _, last), ids in zip(group.items, encoded):
        if ids.size and (int(ids.max()) >= tok.vocab_size or int(ids.min()) < 0):
            raise ShardError(f"the tokenizer gave id {int(ids.max())}, outside its vocabulary of {tok.vocab_size}")
        writers[split].write(ids)
        if last:
            writers[split].documents += 1
            if eot is not None:
                writers[split].write(eot)
    group.items, group.size = [], 0


def _check_out(out: Path, inputs: list[str]) -> None:
    """``out`` must be a new or empty folder, or shards written before (only their files are
    replaced), and outside the inputs (a later run would read the shards as text)."""
    if out.exists() and not out.is_dir():
        raise ShardError(f"-o {out}: not a folder")
    if out.is_dir() and not (out / META).is_file() and any(out.iterdir()):
        raise ShardError(f"-o {out}: a folder with other files in it and no {META}; give a new or empty folder")
    resolved = out.resolve()
    for item in inputs:
        source = Path(_hf_name(item) if is_hf(item) else item).expanduser().resolve()
        if source.is_dir() and (resolved == source or source in resolved.parents):
            raise ShardError(f"-o {out} lies inside the input folder {item}")


def _hf_name(item: str) -> str:
    try:
        return parse_hf(item).name
    except ValueError as exc:
        raise ShardError(str(exc)) from None


def summary(meta: ShardMeta, out: Path) -> str:
    """One line on what ``prepare`` wrote."""
    parts = [f"{s} {v.tokens:,} tokens ({v.documents:,} documents)" for s, v in meta.splits.items()]
    tok: dict[str, Any] = meta.tokenizer
    return (
        f"wrote {out}: {', '.join(parts)}, {meta.source_bytes / 1e6:.2f} MB of text, {meta.dtype} ids, "
        f"vocabulary {meta.vocab_size:,} ({tok['name']}); train on it with --data tokens:{out}"
        f"{'' if meta.vocab_size == 256 else f' --model-args vocab_size={meta.vocab_size}'}"
    )
