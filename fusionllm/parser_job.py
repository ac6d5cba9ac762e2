"""The flag groups of a training job (model and data, recipe, evaluation, weights in
and out), each added only to the commands that use it, and the parsers of the
one-process commands: ``train``, ``inspect``, ``compare``, ``status``, ``export``.
No torch here (``fusionllm.cli`` builds the parser before any command's import)."""

from __future__ import annotations

import argparse

from fusionllm import parser_types as t
from fusionllm.usage import DEFAULT_STEPS, EXPORT_FORMATS
from protocol.model.options import PRECISIONS, SCHEDULES

#: ``compare``'s default tolerance: the equivalence the project promises
DEFAULT_TOLERANCE = 1e-5


def add_model_flags(p: argparse.ArgumentParser, model_help: str = "", seed_help: str = "") -> None:
    """What to train: the model and its data, and the seed of both."""
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        default="gpt",
        metavar="NAME",
        help=model_help or "built-in name (gpt, gpt2, branchy) or MODULE:FUNC / file.py:FUNC",
    )
    g.add_argument(
        "--model-args",
        default="",
        metavar="K=V,...",
        help="keyword arguments for the model factory, k=v,k=v (default: none)",
    )
    g.add_argument(
        "--data",
        default=None,
        metavar="NAME",
        help="built-in name (stdlib, branchy), tokens:DIR (shards of 'fusionllm data prepare') or MODULE:FUNC "
        "called with the seed (default: branchy for --model branchy, else stdlib)",
    )
    g.add_argument(
        "--data-args",
        default="",
        metavar="K=V,...",
        help="keyword arguments for the data factory, k=v,k=v (default: none)",
    )
    g.add_argument("--seed", type=int, default=0, help=seed_help or "seeds the initial weights and the batches")


def add_micro_batches(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--micro-batches", type=t.positive, default=4, metavar="M", help="each batch is split into M parts along dim 0"
    )


def add_precision(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="autocast precision; weights and optimizer state stay fp32; fp16 scales the loss",
    )


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """How to train: steps, batch split, precision and the optimizer recipe."""
    g = p.add_argument_group("training recipe")
    g.add_argument("--steps", type=t.positive, default=DEFAULT_STEPS, metavar="N", help="optimizer steps")
    add_micro_batches(g)
    add_precision(g)
    g.add_argument("--lr", type=t.positive_float, default=3e-3, help="peak learning rate (default: 3e-3)")
    g.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default="constant",
        help="after the warm-up: hold the rate, or bring it to --min-lr by the last step",
    )
    g.add_argument("--warmup", type=t.natural, default=0, metavar="STEPS", help="linear warm-up steps")
    g.add_argument("--min-lr", type=t.non_negative_float, default=0.0, help="the rate at the last step")
    g.add_argument(
        "--weight-decay",
        type=t.non_negative_float,
        default=0.0,
        help="decoupled (AdamW) weight decay, not on biases and norms",
    )
    g.add_argument("--weight-decay-all", action="store_true", help="decay biases and norms too")
    g.add_argument("--betas", type=t.betas, default=(0.9, 0.999), metavar="B1,B2", help="AdamW's (default: 0.9,0.999)")
    g.add_argument(
        "--clip-grad-norm",
        type=t.non_negative_float,
        default=0.0,
        metavar="X",
        help="clip the gradient norm over every stage's parameters to X (default: 0, off)",
    )


def add_eval_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument(
        "--eval-every",
        type=t.natural,
        default=0,
        metavar="N",
        help="validation loss every N steps and after the last (default: 0, never)",
    )
    g.add_argument("--eval-batches", type=t.positive, default=4, metavar="N", help="validation batches per evaluation")


def add_weights_flags(p: argparse.ArgumentParser, save_default: str = "not written") -> None:
    """Weights in (``--init``) and out (``--save``)."""
    g = p.add_argument_group("weights")
    g.add_argument(
        "--init",
        default=None,
        metavar="PATH.safetensors",
        help="start from these weights: the model's names, or GPT-2's layout for gpt2 (default: the seeded "
        "initialisation)",
    )
    g.add_argument(
        "--save",
        default=None,
        metavar="PATH.safetensors",
        help=f"write the trained model here (default: {save_default})",
    )


def add_training_job(p: argparse.ArgumentParser, save_default: str = "not written") -> None:
    """Every group of a command that trains: train, demo, coordinator."""
    add_model_flags(p)
    add_recipe_flags(p)
    add_eval_flags(p)
    add_weights_flags(p, save_default)


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=t.natural,
        default=0,
        help="torch CPU threads (default: 0, torch's choice); a swarm's demo peers use 1, and a reference "
        "trained with the same count gives bitwise the same weights",
    )


def _add_cut_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cut", default=None, help="explicit stage boundaries (op indices), e.g. 10,40 (default: a balanced cut)"
    )


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train in one process: the whole model or its stages")
    add_training_job(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--reference", action="store_true", help="train the whole model")
    mode.add_argument("--stages", type=t.positive, metavar="K", help="train through K rebuilt stages")
    add_threads_flag(p)
    _add_cut_flag(p)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="print the OP-DAG and a K-stage cut, and check it against the whole model")
    add_model_flags(p)
    g = p.add_argument_group("the batch checked")
    add_micro_batches(g)
    add_precision(g)
    p.add_argument("--stages", type=t.positive, default=2, metavar="K", help="stages to cut the model into")
    _add_cut_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="largest relative difference between two checkpoints")
    p.add_argument("a", metavar="A.safetensors", help="one checkpoint")
    p.add_argument("b", metavar="B.safetensors", help="the other")
    p.add_argument(
        "--tol", type=t.tolerance, default=DEFAULT_TOLERANCE, metavar="X", help="exit 1 when they differ by more"
    )


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="print a coordinator's status page in the terminal")
    p.add_argument(
        "--coordinator",
        default="http://127.0.0.1:8470",
        metavar="URL",
        help="the status page's address, as demo and coordinator print it",
    )
    p.add_argument("--json", action="store_true", help="print the raw /api/v1/state JSON")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's weights as another library's model (GPT-2 for Hugging Face)")
    p.add_argument("run", metavar="RUN.safetensors", help="the run's weights, as --save writes them")
    p.add_argument("dir", metavar="DIR", help="the folder to write (absent or empty, unless --force)")
    p.add_argument(
        "--to",
        choices=EXPORT_FORMATS,
        required=True,
        help="gpt2-hf: config.json and model.safetensors that transformers loads as GPT2LMHeadModel",
    )
    p.add_argument("--model", default="gpt2", metavar="NAME", help="the run's --model")
    p.add_argument(
        "--model-args", default="", metavar="K=V,...", help="the run's --model-args, k=v,k=v (default: none)"
    )
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")


def add_local_commands(sub: argparse._SubParsersAction) -> None:
    """The commands that run in this one process."""
    _add_train(sub)
    _add_inspect(sub)
    _add_compare(sub)
    _add_status(sub)
    _add_export(sub)
