"""The tokenizers ``fusionllm data prepare`` encodes with, each a real library's:
bytes (ids 0-255, no library), GPT-2's BPE through ``tiktoken`` (its files read
from tiktoken's cache only: nothing is downloaded), a Hugging Face
``tokenizer.json`` (``tokenizers``), or a byte-level BPE that ``tokenizers``
trains on the corpus itself, offline."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from zoo.shards import MAX_VOCAB, ShardError

#: the separator a trained tokenizer appends after each document (its id: 0)
END_OF_TEXT = "<|endoftext|>"
#: the end-of-document tokens looked for in a given tokenizer.json, in order
EOT_NAMES = (END_OF_TEXT, "</s>", "<eos>", "[SEP]")
#: a trained tokenizer's vocabulary: the 256 bytes and the separator at the least
MIN_TRAINED_VOCAB = 257
TOKENIZER_FILE = "tokenizer.json"
#: GPT-2's two BPE files as tiktoken fetches (and caches) them
GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


class Tokenizer:
    """Encodes chunks of text to token ids; ``meta`` says what it is for the shards."""

    as_bytes = False  # whether it takes the raw bytes of files instead of text
    vocab_size: int
    eot: int | None
    meta: dict[str, Any]

    def encode(self, chunks: list[Any]) -> list[np.ndarray]:
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Write what decodes the shards into ``directory`` (nothing, for bytes and GPT-2)."""


class Bytes(Tokenizer):
    as_bytes = True

    def __init__(self) -> None:
        self.vocab_size, self.eot, self.meta = 256, None, {"kind": "bytes", "name": "bytes", "file": None}

    def encode(self, chunks: list[Any]) -> list[np.ndarray]:
        return [np.frombuffer(c, dtype=np.uint8) for c in chunks]


class Tiktoken(Tokenizer):
    def __init__(self, encoding: Any) -> None:
        self.enc = encoding
        self.vocab_size, self.eot = encoding.n_vocab, encoding.eot_token
        self.meta = {"kind": "tiktoken", "name": encoding.name, "file": None}

    def encode(self, chunks: list[Any]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.enc.encode_ordinary_batch(chunks)]


class HuggingFace(Tokenizer):
    def __init__(self, tok: Any, name: str) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot = next((i for i in map(tok.token_to_id, EOT_NAMES) if i is not None), None)
        self.meta = {"kind": "tokenizers", "name": name, "file": TOKENIZER_FILE}
        if not 1 <= self.vocab_size <= MAX_VOCAB:
            raise ShardError(f"tokenizer {name} has {self.vocab_size} tokens, not 1 to {MAX_VOCAB}")

    def encode(self, chunks: list[Any]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch_fast(chunks, add_special_tokens=False)]

    def save(self, directory: Path) -> None:
        self.tok.save(str(directory / TOKENIZER_FILE))


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes``, ``gpt2`` or a path to a ``tokenizer.json``."""
    if spec == "bytes":
        return Bytes()
    if spec == "gpt2":
        return _gpt2()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ShardError(f"--tokenizer {spec}: not bytes, gpt2 or a tokenizer.json file")
    tokenizers = _tokenizers()
    try:
        return HuggingFace(tokenizers.Tokenizer.from_file(str(path)), path.name)
    except Exception as exc:  # the library's own error: a malformed file
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ShardError(f"--tokenizer {spec}: not a Hugging Face tokenizer.json: {first}") from None


def gpt2_cache() -> tuple[str, list[Path]]:
    """tiktoken's cache folder and where GPT-2's files lie in it (its own naming)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache is None:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return cache, [Path(cache) / hashlib.sha1(url.encode()).hexdigest() for url in GPT2_URLS]


def _gpt2() -> Tiktoken:
    cache, files = gpt2_cache()
    if not cache or not all(f.is_file() for f in files):
        raise ShardError(
            f"--tokenizer gpt2: GPT-2's BPE files are not in tiktoken's cache ({cache or 'off'}) and nothing is "
            'downloaded here: on a machine with internet run TIKTOKEN_CACHE_DIR=DIR python -c "import tiktoken; '
            "tiktoken.get_encoding('gpt2')\", copy DIR here and set TIKTOKEN_CACHE_DIR=DIR (or pass --tokenizer "
            "PATH/tokenizer.json)"
        )
    try:
        import tiktoken
    except ImportError:
        raise ShardError("--tokenizer gpt2 needs tiktoken: pip install tiktoken") from None
    try:
        return Tiktoken(tiktoken.get_encoding("gpt2"))
    except Exception as exc:  # a corrupt cache makes tiktoken try the network
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ShardError(f"--tokenizer gpt2: tiktoken cannot read GPT-2's files in {cache}: {first}") from None


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ShardError("this tokenizer needs Hugging Face tokenizers: pip install tokenizers") from None
    return tokenizers


def train_tokenizer(texts: Iterable[str], vocab: int) -> HuggingFace:
    """A byte-level BPE of ``vocab`` tokens (fewer where the corpus has too few pairs to
    merge) trained on ``texts``, with ``END_OF_TEXT`` as id 0."""
    if not MIN_TRAINED_VOCAB <= vocab <= MAX_VOCAB:
        raise ShardError(f"--train-tokenizer {vocab}: the vocabulary must be {MIN_TRAINED_VOCAB} to {MAX_VOCAB}")
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HuggingFace(tok, "byte-level BPE trained on the corpus")
