"""The parser of ``fusionllm data``: its subcommands and flags, without numpy or
torch (``fusionllm.cli`` adds it; ``fusionllm.data_cmds`` runs it)."""

from __future__ import annotations

import argparse

from fusionllm.usage import positive_int
from zoo.hf_spec import is_hf, parse_hf

#: the validation share ``data prepare`` holds out by default
DEFAULT_VAL_FRACTION = 0.05


def _val_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction in [0, 1)")
    return value


def _input(text: str) -> str:
    """A file or folder as given; an ``hf:`` input checked for its syntax."""
    if is_hf(text):
        try:
            parse_hf(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _vocab(text: str) -> int:
    return positive_int(text, "a whole number of tokens")


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """``fusionllm data prepare``: a corpus into token shards for ``--data tokens:DIR``."""
    p = sub.add_parser("data", help="prepare your own corpus as token shards (--data tokens:DIR)")
    data_sub = p.add_subparsers(dest="data_command", metavar="prepare", required=True)
    q = data_sub.add_parser(
        "prepare",
        help='tokenize text files (or folders of them, .jsonl with a "text" per line, or hf:DATASET) into token shards',
        description="Tokenize a corpus into DIR: one memory-mapped array of token ids per split (train.bin, "
        "val.bin), meta.json and the tokenizer. A document is a file, a line of a .jsonl or a row of a Hugging Face "
        "dataset (hf:NAME[#CONFIG][:SPLIT][@COLUMN]: a local folder, or a hub dataset already in the offline cache; "
        "SPLIT defaults to train, COLUMN to text or the only string column; needs pip install 'fusionllm[hf]'). "
        "Validation holds out whole documents. Train on it with --data tokens:DIR.",
    )
    q.add_argument(
        "inputs",
        nargs="+",
        type=_input,
        metavar="FILE|DIR|hf:DATASET",
        help="text files, .jsonl files, folders of them, or hf:NAME[#CONFIG][:SPLIT][@COLUMN] (Hugging Face datasets)",
    )
    q.add_argument("-o", "--out", required=True, metavar="DIR", help="where the shards go (a new or empty folder)")
    q.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|gpt2|PATH",
        help="bytes (256 ids, the built-in gpt's vocabulary), gpt2 (tiktoken's GPT-2 BPE, from its offline "
        "cache) or a Hugging Face tokenizer.json (default: bytes)",
    )
    q.add_argument(
        "--train-tokenizer",
        type=_vocab,
        default=0,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB tokens on the corpus (its training documents) instead",
    )
    q.add_argument(
        "--val-fraction",
        type=_val_fraction,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"share of the documents held out for validation, 0 <= F < 1 (default: {DEFAULT_VAL_FRACTION})",
    )
