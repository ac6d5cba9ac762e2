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


#: optimizer steps a command trains for without --steps: the same for demo, coordinator and
#: train, so that ``train --reference`` with a run's other flags reproduces that run
DEFAULT_STEPS = 1200
#: the job's fields a command may take from its flags (each flag's dest where it differs)
_JOB_FIELDS = (
    "model",
    "model_args",
    "data_args",
    "seed",
    "steps",
    "micro_batches",
    "lr",
    "lr_schedule",
    "warmup",
    "min_lr",
    "weight_decay",
    "betas",
    "clip_grad_norm",
    "precision",
    "eval_every",
    "eval_batches",
)
_JOB_FLAGS = {name: name for name in _JOB_FIELDS} | {"decay_all": "weight_decay_all"}


def job_from_args(args: argparse.Namespace) -> Any:
    """The job the parsed flags describe; a flag the command does not take keeps the
    job's default (``plan`` takes no recipe, ``inspect`` no steps)."""
    from protocol.model.job import JobSpec

    data = args.data
    if data is None:
        data = "branchy" if args.model == "branchy" else "stdlib"
    save, init = getattr(args, "save", None), getattr(args, "init", None)
    if save is not None and not save.endswith(".safetensors"):
        raise UsageError(f"--save {save}: the checkpoint file must end in .safetensors")
    if init is not None and not Path(init).is_file():
        raise UsageError(f"--init {init}: no such file")
    given = {field: getattr(args, flag) for field, flag in _JOB_FLAGS.items() if hasattr(args, flag)}
    job = JobSpec(**given, data=tokens_data(data), init=str(Path(init).resolve()) if init else "")
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
