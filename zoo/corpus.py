"""A text corpus as documents: the files ``fusionllm data prepare`` reads, read in
bounded chunks, and which documents it holds out for validation.

A document is a file, one line of a ``.jsonl`` file (its ``"text"``), or one row of
an ``hf:DATASET`` (``zoo.hf_corpus``). A folder stands for every file under it
(hidden ones skipped), in sorted order; the files come first, then the datasets in
the order given."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.hf_corpus import HFSource
from zoo.hf_spec import is_hf
from zoo.shards import ShardError

#: text is read and tokenized in pieces of about this many bytes, cut after a newline
CHUNK_BYTES = 1 << 20
#: the longest line of a .jsonl file read (one document)
MAX_LINE_BYTES = 64 << 20
JSONL = ".jsonl"

Chunk = str | bytes


@dataclass(frozen=True)
class Corpus:
    files: tuple[Path, ...]
    documents: int
    bytes: int  # of the files read, and of the datasets' text (UTF-8)
    datasets: tuple[HFSource, ...] = ()

    @classmethod
    def scan(cls, inputs: list[str]) -> Corpus:
        """The files of ``inputs`` (files, folders or ``hf:DATASET``), their documents
        counted; a missing input or a corpus without text is refused in one line."""
        files: list[Path] = []
        sets = tuple(HFSource.open(item) for item in inputs if is_hf(item))
        for item in inputs:
            if is_hf(item):
                continue
            path = Path(item).expanduser()
            if path.is_dir():
                files.extend(sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)))
            elif path.is_file():
                files.append(path)
            else:
                raise ShardError(f"{item}: no such file or folder")
        files = list(dict.fromkeys(files))
        documents = sum(_count_documents(p) for p in files) + sum(d.documents for d in sets)
        size = sum(p.stat().st_size for p in files) + sum(d.bytes for d in sets)
        if not documents or not size:
            raise ShardError(f"no text in {', '.join(inputs)}: the corpus is empty")
        return cls(tuple(files), documents, size, sets)

    def documents_of(self, as_bytes: bool) -> Iterator[Iterator[Chunk]]:
        """Every document in order, each as its chunks (``bytes`` or ``str``)."""
        for path in self.files:
            if path.suffix == JSONL:
                for text in _jsonl_texts(path):
                    yield iter([text.encode("utf-8") if as_bytes else text])
            else:
                yield _file_chunks(path, as_bytes)
        for source in self.datasets:
            for text in source.texts():
                yield iter([text.encode("utf-8") if as_bytes else text])


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def held_out(documents: int, fraction: float) -> frozenset[int]:
    """The documents (by index) held out for validation: ``fraction`` of them, at least
    one where the fraction is above 0, spread evenly; refused where none would be left
    for training, or none could be held out."""
    if fraction <= 0:
        return frozenset()
    k = max(1, round(documents * fraction))
    if k >= documents:
        raise ShardError(
            f"--val-fraction {fraction:g} of {documents} document(s) leaves none for training: give more documents "
            "(files, lines of a .jsonl, rows of a dataset), or --val-fraction 0"
        )
    return frozenset(int((j + 0.5) * documents / k) for j in range(k))


def _count_documents(path: Path) -> int:
    if path.suffix != JSONL:
        return 1
    return sum(1 for _ in _jsonl_lines(path))


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a .jsonl file, with their numbers."""
    try:
        with path.open("rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(line) > MAX_LINE_BYTES:
                    raise ShardError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES >> 20} MiB")
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror}") from None


def _jsonl_texts(path: Path) -> Iterator[str]:
    for number, line in _jsonl_lines(path):
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ShardError(f"{path}:{number}: not JSON: {exc}") from None
        text = doc.get("text") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            raise ShardError(f'{path}:{number}: not an object with a "text" string')
        yield text


def _file_chunks(path: Path, as_bytes: bool) -> Iterator[Chunk]:
    """A file's content in pieces of about ``CHUNK_BYTES``, each ending after a newline
    where the piece has one (so that no word is cut), UTF-8 decoded unless ``as_bytes``."""
    decode = (lambda raw, final=False: raw) if as_bytes else codecs.getincrementaldecoder("utf-8")("replace").decode
    carry: Any = b"" if as_bytes else ""
    try:
        with path.open("rb") as f:
            while raw := f.read(CHUNK_BYTES):
                piece = carry + decode(raw)
                cut = piece.rfind(b"\n" if as_bytes else "\n") + 1
                cut = cut or len(piece)  # no newline in a whole chunk: cut anyway
                carry = piece[cut:]
                yield piece[:cut]
    except OSError as exc:
        raise ShardError(f"cannot read {path}: {exc.strerror}") from None
    tail = carry + decode(b"", final=True)
    if tail:
        yield tail
