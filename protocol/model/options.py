"""A job's options as names and text, without torch, so that the command line
parses its flags before it imports anything heavy: the learning-rate schedules,
the precisions, AdamW's betas and the forms a stage travels in (``recipe`` checks
a recipe with them; ``program`` is the program form)."""

from __future__ import annotations

SCHEDULES = ("constant", "linear", "cosine")
#: compute precisions (``recipe.AUTOCAST_DTYPES``: the autocast dtype of each; fp32: none)
PRECISIONS = ("fp32", "bf16", "fp16")
#: how a coordinator sends stages: as programs (``program``), or as the job's model code to rebuild
STAGE_FORMS = ("program", "code")
#: ``--data tokens:DIR``: the token shards ``fusionllm data prepare`` wrote to DIR
TOKENS_PREFIX = "tokens:"


class RecipeError(ValueError):
    """A recipe that cannot train; ``str()`` is one line."""


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` -> (0.9, 0.95); a one-line error otherwise."""
    parts = [p.strip() for p in text.split(",")]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        raise RecipeError(f"betas '{text}' are not two comma-separated numbers") from None
    if not betas_ok(betas):
        raise RecipeError(f"betas '{text}' are not two numbers in [0, 1)")
    return betas  # type: ignore[return-value]


def betas_ok(betas: tuple[float, ...]) -> bool:
    return len(betas) == 2 and all(isinstance(b, float) and 0 <= b < 1 for b in betas)
