"""What the command line and its commands share: the exit codes, the error for a
request that cannot be done, and the parsed arguments as a job or a cut. The parser
(``fusionllm.cli``) and the commands import this module; it imports neither."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, as shells report a SIGINT
#: what ``fusionllm export --to`` writes: GPT-2's Hugging Face layout (``GPT2LMHeadModel``)
EXPORT_FORMATS = ("gpt2-hf",)


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


def job_from_args(args: argparse.Namespace) -> Any:
    from protocol.model.job import JobSpec

    data = args.data
    if data is None:
        data = "branchy" if args.model == "branchy" else "stdlib"
    data = tokens_data(data)
    if args.save is not None and not args.save.endswith(".safetensors"):
        raise UsageError(f"--save {args.save}: the checkpoint file must end in .safetensors")
    if args.init is not None and not Path(args.init).is_file():
        raise UsageError(f"--init {args.init}: no such file")
    job = JobSpec(
        model=args.model,
        model_args=args.model_args,
        data=data,
        data_args=args.data_args,
        seed=args.seed,
        steps=args.steps,
        micro_batches=args.micro_batches,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        warmup=args.warmup,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        betas=args.betas,
        decay_all=args.weight_decay_all,
        clip_grad_norm=args.clip_grad_norm,
        precision=args.precision,
        init=str(Path(args.init).resolve()) if args.init else "",
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )
    job.recipe()  # a recipe that cannot train is refused before anything starts
    return job


def tokens_data(data: str) -> str:
    """``--data tokens:DIR`` with DIR made absolute (the run's record and a resume find it
    from anywhere), refused in one line where DIR holds no shards; other specs as given."""
    from protocol.model.options import TOKENS_PREFIX
    from zoo.shards import META

    if not data.startswith(TOKENS_PREFIX):
        return data
    directory = Path(data.removeprefix(TOKENS_PREFIX)).expanduser()
    if not (directory / META).is_file():
        raise UsageError(f"--data {data}: no token shards there (no {META}); make them with 'fusionllm data prepare'")
    return TOKENS_PREFIX + str(directory.resolve())


def parse_cut(text: str) -> Any:
    from protocol.model.graph import Cut

    try:
        return Cut(tuple(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise UsageError(f"--cut '{text}' is not a comma-separated list of op indices") from None


def positive_int(text: str, what: str = "an integer") -> int:
    """An argparse type: ``text`` as an integer of at least 1 (``what`` names it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
