"""``fusionllm data``: preparing a corpus as token shards. Output here is the CLI's
own, so ``print`` is allowed."""

from __future__ import annotations

import argparse
from pathlib import Path

from fusionllm.usage import UsageError
from zoo.prepare import PrepareOptions, prepare, summary
from zoo.shards import ShardError


def cmd_data(args: argparse.Namespace) -> int:
    """``data prepare``; every problem with the corpus or the tokenizer is one line, exit 2."""
    if args.train_tokenizer and args.tokenizer != "bytes":
        raise UsageError("--train-tokenizer trains its own tokenizer: give it or --tokenizer, not both")
    out = Path(args.out).expanduser()
    opts = PrepareOptions(args.inputs, out, args.tokenizer, args.train_tokenizer, args.val_fraction)
    try:
        meta = prepare(opts)
    except ShardError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(summary(meta, out))
    return 0
